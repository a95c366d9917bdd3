"""test/benchmark/engine/draft_model_cost.py runs end to end on the CPU (--tiny): with echo weights
on both models every draft of every cycle is accepted (a cycle emits batch x (k + 1) tokens), and
the table's arithmetic holds."""

import re

from benchmark.engine import draft_model_cost


def test_draft_model_cost_reports_cycles_where_every_draft_is_accepted(tmp_path):
    out = tmp_path / "cost.md"
    assert draft_model_cost.main(["--tiny", "--device", "cpu", "--batches", "1,3", "--ks", "1,3", "--iters", "2",
                                  "--context", "16", "--out-md", str(out)]) == 0
    text = out.read_text()
    num = r"(\d+\.\d+)"
    for batch in (1, 3):
        plain = re.search(rf"\| {batch} \| 0 \| {num} \|", text)
        assert plain, text
        for k in (1, 3):
            row = re.search(rf"\| {batch} \| {k} \| {num} \| {num} \| {num} \| {num} \| (\d+) \| {num} \| {num} \|", text)
            assert row, text
            _, propose, verify, cycle, tokens, _, x_plain = row.groups()
            assert int(tokens) == batch * (k + 1)
            assert abs(float(cycle) - float(propose) - float(verify)) < 2e-3
            expected = (int(tokens) / float(cycle)) / (batch / float(plain.group(1)))
            assert abs(float(x_plain) - expected) < 0.01 + 0.01 * expected
