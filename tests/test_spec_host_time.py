"""test/benchmark/engine/spec_host_time.py runs end to end on the CPU (tiny model) and reports what it
promises: per scenario, plain steps and steps with drafts, their period split into the device's
work and the host's, and the parts."""

import re
from types import SimpleNamespace

from benchmark.engine import spec_host_time


def test_spec_host_time_reports_steps_with_drafts(tmp_path):
    out = tmp_path / "host.md"
    assert spec_host_time.main(["--device", "cpu", "--scenarios", "2x3", "--alpha", "0.9", "--new-tokens", "48",
                                "--warmup", "4", "--steps", "8", "--profile-steps", "2", "--top", "5",
                                "--out-md", str(out)]) == 0
    text = out.read_text()
    number = r"(\d+\.\d+)"
    row = rf"\| {{}} \| \d+ \| {number} \| {number} \| {number} \| {number} \| {number} \| {number} \| {number} \|"
    plain = re.search(row.format("plain, plain steps"), text)
    drafted = re.search(row.format(re.escape("spec k=3, steps with drafts")), text)
    assert plain and drafted, text
    assert float(plain.group(6)) == 2.0  # two requests, a token each a step
    assert float(drafted.group(6)) > 2.0  # the oracle's drafts are accepted: more than a token a step each
    for match in (plain, drafted):
        period, forward, sampler, host = (float(match.group(i)) for i in (2, 3, 4, 5))
        assert forward > 0 and host > 0 and abs(period - forward - sampler - host) < 0.01
    assert "| scheduler._plan_drafts |" in text and "cProfile" in text


def test_spec_host_time_drafts_with_a_host_source_when_asked():
    """`--method suffix` (or ngram) times the source itself, not the controlled draft's oracle."""
    from lightllm.engine.spec.drafts import NgramDraft, SuffixDraft

    runner = SimpleNamespace(config=SimpleNamespace(vocab_size=512))
    for method, kind in (("suffix", SuffixDraft), ("ngram", NgramDraft)):
        spec = spec_host_time.pinned_speculator(runner, None, 0.8, 4, 8, method)
        assert isinstance(spec.source, kind) and spec.k_max == 4 and spec.guard is None
