"""test/benchmark/serving/rate_sweep.py: percentiles and goodput by their definitions, and a sweep of a
real server on the tiny model (CPU) with its table, JSON and plots."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmark.serving import rate_sweep
from benchmark.lib.serving_metrics import SLO, RequestResult, format_summary, goodput, summarize
from benchmark.lib.sharegpt import SampledRequest, save_requests
from seeds import fresh_rng

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HUGE, TINY = SLO(1e9, 1e9), SLO(1e-3, 1e-3)


def streamed(ttft: float, tpot: float, tokens: int, success: bool = True) -> RequestResult:
    """A request whose TTFT and TPOT are exactly the given seconds (binary fractions stay exact)."""
    latency = ttft + tpot * (tokens - 1)
    return RequestResult(10, tokens, success, tokens, latency=latency, ttft=ttft, itl=[tpot] * (tokens - 1))


def test_percentiles_interpolate_between_ranked_values():
    ttfts_ms = list(range(1, 101))
    random.Random(0).shuffle(ttfts_ms)
    results = [streamed(ms / 1000, 0.25 * (i % 4 + 1), 3) for i, ms in enumerate(ttfts_ms)]
    summary = summarize(results, duration=10.0)
    # 100 ranked values 1..100 ms: rank q sits (100 - 1) * q / 100 places after the first
    assert summary["median_ttft_ms"] == pytest.approx(50.5)
    assert summary["p90_ttft_ms"] == pytest.approx(90.1)
    assert summary["p99_ttft_ms"] == pytest.approx(99.01)
    # TPOT is 250, 500, 750 or 1000 ms, 25 requests each
    assert (summary["median_tpot_ms"], summary["p90_tpot_ms"], summary["p99_tpot_ms"]) == pytest.approx(
        (625.0, 1000.0, 1000.0))
    assert "P90 TTFT (ms):" in format_summary(summary) and "P90 TPOT (ms):" in format_summary(summary)


def test_goodput_counts_successful_requests_within_both_bounds():
    results = [
        streamed(0.125, 0.015625, 5),  # good
        streamed(0.25, 0.0, 1),  # good: a single token's TPOT counts as 0
        streamed(0.5, 0.03125, 4),  # good: TTFT on its bound
        streamed(0.625, 0.015625, 5),  # TTFT over
        streamed(0.125, 0.0625, 5),  # TPOT over
        streamed(0.125, 0.015625, 5, success=False),  # failed
        RequestResult(10, 5, True, 5, latency=0.25),  # not streamed: its TTFT is unknown
    ]
    assert goodput(results, 2.0, SLO()) == pytest.approx(1.5)
    assert goodput(results, 2.0, SLO(ttft_ms=500.0, tpot_ms=62.5)) == pytest.approx(2.0)  # TPOT on its bound too
    assert goodput(results, 2.0, HUGE) == pytest.approx(2.5)  # every streamed success
    assert goodput(results, 2.0, TINY) == 0.0
    assert goodput(results, 2.0, HUGE) <= summarize(results, 2.0)["request_throughput"]


@pytest.mark.parametrize("text", ["", "0,5", "-1", "5,inf", "nan"])
def test_rates_must_be_positive_and_finite(text):
    with pytest.raises(SystemExit):
        rate_sweep.parse_args(["--rates", text])


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from lightllm.tools.bench_model import write_bench_model
    from server_utils import start_server

    model = write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)
    # without the prefix cache every rate prefills its prompts afresh, as a sweep should
    server = start_server(["--model_dir", str(model), "--disable_prefix_cache"],
                          tmp_path_factory.mktemp("server") / "server.log")
    yield server, model
    assert server.stop() == 0


def short_requests(model: Path, count: int, path: Path) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    rng = fresh_rng()
    words = "the river stone light model cache runs over under quickly".split()
    prompts = [" ".join(rng.choices(words, k=rng.randint(4, 40))) for _ in range(count)]
    save_requests(path, [SampledRequest(p, tokenizer(p).input_ids, rng.randint(4, 12)) for p in prompts])
    return path


def sweep(server, requests: Path, rates: str, slo: SLO, label: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{label}.json"
    argv = ["--base-url", server.url, "--requests", str(requests), "--num-prompts", "8", "--rates", rates,
            "--slo-ttft-ms", str(slo.ttft_ms), "--slo-tpot-ms", str(slo.tpot_ms), "--label", label,
            "--out-json", str(out), "--plot", str(tmp_path / f"{label}.png"), "--warmup", "2", "--no-progress"]
    assert rate_sweep.main(argv) == 0
    return json.loads(out.read_text())


def check_sweep(result: dict, rates: list[float]) -> None:
    assert [entry["request_rate"] for entry in result["rates"]] == rates  # one entry per rate
    for entry in result["rates"]:
        assert (entry["completed"], entry["failed"]) == (8, 0), entry["errors"]
        for key in ("ttft", "tpot"):
            ranked = [entry[f"{stat}_{key}_ms"] for stat in ("median", "p90", "p99")]
            assert 0 < ranked[0] and ranked == sorted(ranked), (key, ranked)
        assert 0 <= entry["goodput"] <= entry["request_throughput"]


@pytest.mark.timeout(300)
def test_sweep_of_a_real_server(tiny_server, tmp_path, capsys):
    server, model = tiny_server
    requests = short_requests(model, 8, tmp_path / "requests.json")
    huge = sweep(server, requests, "4,8", HUGE, "huge", tmp_path)
    check_sweep(huge, [4.0, 8.0])
    assert all(e["goodput"] == pytest.approx(e["request_throughput"]) for e in huge["rates"])
    tiny = sweep(server, requests, "8", TINY, "tiny", tmp_path)
    check_sweep(tiny, [8.0])
    assert tiny["rates"][0]["goodput"] == 0.0
    assert (tmp_path / "huge.png").read_bytes()[:8] == PNG_MAGIC

    capsys.readouterr()
    both = tmp_path / "both.png"
    assert rate_sweep.main(["--plot-only", str(both), f"A={tmp_path / 'huge.json'}", str(tmp_path / "tiny.json")]) == 0
    assert both.read_bytes()[:8] == PNG_MAGIC
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [float(row.split("|")[1]) for row in rows] == [4.0, 8.0, 8.0]  # a table row per rate of each sweep


def test_tail_trace_places_slow_requests_among_the_steps(tmp_path):
    """tail_trace.py: the trace's clock placed on the client's by origin_unix_s; a slow request
    is held up by the steps that overlap its wait, and a step far over its kind's median is found."""
    from benchmark.serving import tail_trace

    origin, sent0 = 1000.0, 1000.5  # the trace began 0.5 s before the first request was sent
    decode = {"decodes": 4, "chunk_tokens": 0, "chunks": 0, "graph": True, "launch_ms": 0.1}
    steps = [{**decode, "start_ms": 500.0 + 10 * i, "end_ms": 505.0 + 10 * i} for i in range(20)]
    steps[3].update(end_ms=900.0)  # 0.03-0.4 s on the client's clock: 370 ms, 74x its kind's median
    steps[3]["new_kernel_names"], steps[3]["new_kernels"] = ["_random_uniform_kernel"], 1
    steps[0]["origin_unix_s"] = origin
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    loaded = tail_trace.load_steps(path, sent0)
    assert loaded[0]["start"] == pytest.approx(0.0) and loaded[3]["end"] == pytest.approx(0.4)
    rows = {"sent_s": [0.0, 0.02, 0.3], "ttft_s": [0.01, 0.45, 0.2], "prompt_len": [5, 700, 9]}
    slow = tail_trace.slow_requests(rows, slow_ms=150)
    assert [(r["index"], r["ttft_ms"]) for r in slow] == [(1, pytest.approx(450.0)), (2, pytest.approx(200.0))]
    held = tail_trace.steps_while_waiting(loaded, slow)
    assert held[0]["end_ms"] == 900.0 and held[0]["waiting"] == [1, 2]  # the long step held both
    assert all(s["waiting"] == [1] for s in held[1:]) and len(held) == 18  # steps 2-19; all but 3 end by 0.2 s
    medians = tail_trace.kind_medians(loaded)
    over = tail_trace.far_over(loaded, medians, 3.0)
    assert [s["end_ms"] for s in over] == [900.0]
    text = "\n".join(tail_trace.step_rows(over, medians, 5))
    assert "_random_uniform_kernel" in text and "| 370.0 | 5.0 |" in text
