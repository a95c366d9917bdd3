"""test/benchmark/plot_runs.py reads both result formats and writes a PNG."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test" / "benchmark"))
import plot_runs  # noqa: E402


def test_plot_runs_reads_compare_and_benchmark_json(tmp_path):
    result = {"request_throughput": 49.3, "median_ttft_ms": 3586.0, "median_tpot_ms": 29.5}
    (tmp_path / "compare.json").write_text(json.dumps({"lightllm": result, "transformers": {}}))
    (tmp_path / "bench.json").write_text(json.dumps({**result, "request_throughput": 39.6}))
    assert plot_runs.load(tmp_path / "compare.json") == result
    out = tmp_path / "runs.png"
    assert plot_runs.main(["--out", str(out), f"fp8={tmp_path / 'compare.json'}",
                           f"bf16={tmp_path / 'bench.json'}"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
