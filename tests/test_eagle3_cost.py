"""test/benchmark/engine/eagle3_cost.py runs end to end on the CPU (--tiny) and reports what it
promises: the target's step with and without the aux capture, k = 1..4 chained head steps and
drafting cycles (an extend of k + 1 kept tokens, then k - 1 steps) with their share of a target
step, and drafts that agree across k."""

import re

from benchmark.engine import eagle3_cost


def test_eagle3_cost_reports_chained_head_steps_against_a_target_step(tmp_path):
    out = tmp_path / "cost.md"
    assert eagle3_cost.main(["--tiny", "--device", "cpu", "--iters", "2", "--context", "24", "--out-md", str(out)]) == 0
    text = out.read_text()
    number = r"(\d+\.\d+)"
    target = re.search(rf"\| eager \| target step \| {number} \| - \| - \|", text)
    assert target and re.search(rf"\| eager \| target step \+ aux \| {number} \|", text), text
    for what in ("head", "cycle"):
        for k in range(1, 5):
            row = re.search(rf"\| eager \| {what} x {k} \| {number} \| {number} \| {number} \|", text)
            assert row, text
            ms, per_draft, share = (float(row.group(i)) for i in (1, 2, 3))
            assert ms > 0 and abs(per_draft - ms / k) < 2e-3
            assert abs(share - per_draft / float(target.group(1))) < 2e-3
    assert "drafts agree across k and modes: yes" in text
