"""test/benchmark/serving/plot_runs.py reads every result format (compare.py's, an older
compare.json, benchmark_serving.py's) and writes a PNG."""

import json

from benchmark.serving import plot_runs


def test_plot_runs_reads_compare_and_benchmark_json(tmp_path):
    """compare.py's results (its first variant, or one by name), an older compare.json's
    "lightllm" side and a benchmark_serving.py result."""
    result = {"request_throughput": 49.3, "median_ttft_ms": 3586.0, "median_tpot_ms": 29.5}
    (tmp_path / "compare.json").write_text(json.dumps({"lightllm": result, "transformers": {}}))
    (tmp_path / "bench.json").write_text(json.dumps({**result, "request_throughput": 39.6}))
    assert plot_runs.load(tmp_path / "compare.json") == result
    other = {**result, "request_throughput": 12.5}
    (tmp_path / "variants.json").write_text(json.dumps({"results": {"requests": {"new": result, "old": other}}}))
    assert plot_runs.load(tmp_path / "variants.json") == result
    assert plot_runs.load(f"{tmp_path / 'variants.json'}#old") == other
    out = tmp_path / "runs.png"
    assert plot_runs.main(["--out", str(out), f"fp8={tmp_path / 'compare.json'}",
                           f"bf16={tmp_path / 'bench.json'}"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
