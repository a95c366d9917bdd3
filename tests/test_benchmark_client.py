"""The ShareGPT benchmark client: sampling rules, failure accounting, metrics, end to end."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from aiohttp import web

from helpers import BENCHMARK  # and makes the benchmark package importable

from benchmark.lib import sharegpt
from benchmark.lib.server_process import start_server
from benchmark.lib.serving_client import arrival_offsets, run_requests, run_requests_in_processes
from benchmark.lib.serving_metrics import RequestResult, format_summary, slowest_first_tokens, summarize
from benchmark.lib.sharegpt import SampledRequest

METRIC_LINES = (
    "Successful requests:",
    "Failed requests:",
    "Benchmark duration (s):",
    "Total input tokens:",
    "Total generated tokens:",
    "Request throughput (req/s):",
    "Output token throughput (tok/s):",
    "Total Token throughput (tok/s):",
) + tuple(
    f"{stat} {name} (ms):" for name in ("TTFT", "TPOT", "ITL", "E2E Latency") for stat in ("Mean", "Median", "P99")
)


class WordTokenizer:
    """One token per whitespace-separated word: lengths in tests are exact and obvious."""

    class Encoding:
        def __init__(self, input_ids):
            self.input_ids = input_ids

    def __call__(self, texts):
        return self.Encoding([[len(word) for word in text.split()] for text in texts])


def words(count: int, rng: random.Random) -> str:
    return " ".join(rng.choice(["a", "bb", "ccc", "dddd"]) for _ in range(count))


def conversation(prompt_len: int, completion_len: int, rng: random.Random, turns: int = 2) -> dict:
    values = [words(prompt_len, rng), words(completion_len, rng)] + ["more"] * (turns - 2)
    return {"id": str(rng.random()), "conversations": [{"from": "x", "value": v} for v in values[:turns]]}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A ShareGPT-like file with edge cases, cut short inside its last record."""
    rng = random.Random(1)
    records = [conversation(rng.randint(1, 1100), rng.randint(1, 1100), rng) for _ in range(300)]
    records += [
        conversation(4, 4, rng),  # shortest kept
        conversation(3, 50, rng),  # prompt too short
        conversation(50, 3, rng),  # completion too short
        conversation(1025, 10, rng),  # prompt too long
        conversation(1024, 1024, rng),  # total 2048: kept
        conversation(1000, 1049, rng),  # total 2049: dropped
        conversation(20, 20, rng, turns=1),  # one turn: dropped
        conversation(30, 30, rng, turns=3),  # first two turns used
    ]
    rng.shuffle(records)
    text = json.dumps(records + [conversation(10, 10, rng)], indent=2)
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(text[: len(text) - 40])  # torn inside the extra last record
    return path, records


def passes(prompt_len: int, completion_len: int) -> bool:
    return 4 <= prompt_len <= 1024 and completion_len >= 4 and prompt_len + completion_len <= 2048


def test_lenient_load_keeps_every_whole_record(dataset):
    path, records = dataset
    assert sharegpt.load_records(path) == records


def test_sampling_is_deterministic_and_follows_the_filters(dataset):
    path, records = dataset
    pairs = sharegpt.conversation_pairs(sharegpt.load_records(path))
    assert len(pairs) == len(records) - 1  # the one-turn conversation
    tokenizer = WordTokenizer()
    everything = sharegpt.sample_requests(pairs, tokenizer, num_prompts=10_000, seed=0)
    expected = [(p, c) for p, c in pairs if passes(len(p.split()), len(c.split()))]
    assert sorted(r.prompt for r in everything) == sorted(p for p, _ in expected)
    by_prompt = {p: len(c.split()) for p, c in expected}
    assert all(r.output_len == by_prompt[r.prompt] and r.prompt_len == len(r.prompt.split()) for r in everything)
    assert any(r.prompt_len + r.output_len == 2048 for r in everything)

    first = sharegpt.sample_requests(pairs, tokenizer, num_prompts=50, seed=0)
    assert first == everything[:50]  # the first kept pairs of one seeded order
    assert first == sharegpt.sample_requests(pairs, tokenizer, num_prompts=50, seed=0)
    assert first != sharegpt.sample_requests(pairs, tokenizer, num_prompts=50, seed=1)


def test_sampled_requests_round_trip_through_a_file(dataset, tmp_path):
    path, _ = dataset
    pairs = sharegpt.conversation_pairs(sharegpt.load_records(path))
    requests = sharegpt.sample_requests(pairs, WordTokenizer(), num_prompts=20, seed=3)
    sharegpt.save_requests(tmp_path / "requests.json", requests)
    assert sharegpt.read_requests(tmp_path / "requests.json") == requests


def test_summary_figures_follow_their_definitions():
    results = [
        RequestResult(10, 3, True, 3, latency=0.5, ttft=0.1, itl=[0.2, 0.2]),
        RequestResult(20, 5, True, 5, latency=1.0, ttft=0.2, itl=[0.2] * 4),
        RequestResult(30, 4, False, 0, latency=0.1, error="HTTP 500: boom"),
    ]
    summary = summarize(results, duration=2.0)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (30, 8)
    assert summary["output_throughput"] == pytest.approx(4.0)
    assert summary["total_token_throughput"] == pytest.approx(19.0)
    assert summary["mean_ttft_ms"] == pytest.approx(150.0)
    assert summary["mean_tpot_ms"] == pytest.approx(200.0)  # (0.5-0.1)/2 and (1.0-0.2)/4
    assert summary["median_itl_ms"] == pytest.approx(200.0)
    assert summary["mean_e2el_ms"] == pytest.approx(750.0)
    assert summary["errors"] == {"HTTP 500: boom": 1}
    text = format_summary(summary)
    assert all(name in text for name in METRIC_LINES)
    assert "per_request" not in summary  # no send times: nothing to place


def test_the_summary_places_each_request_in_the_run():
    results = [
        RequestResult(10, 3, True, 3, latency=0.5, ttft=0.1, sent_at=1000.25),
        RequestResult(20, 5, True, 5, latency=1.0, ttft=0.4, sent_at=1000.0),
        RequestResult(30, 4, False, 0, latency=0.1, error="HTTP 500: boom", sent_at=1001.0),
    ]
    rows = summarize(results, duration=2.0)["per_request"]
    assert rows == {"sent_s": [0.25, 0.0, 1.0], "prompt_len": [10, 20, 30], "output_len": [3, 5, 0],
                    "ttft_s": [0.1, 0.4, None], "latency_s": [0.5, 1.0, None]}
    assert slowest_first_tokens(rows, 1) == "400 ms (sent at 0.00 s, prompt 20)"  # the failed one has none
    assert slowest_first_tokens(rows) == "400 ms (sent at 0.00 s, prompt 20), 100 ms (sent at 0.25 s, prompt 10)"


def fake_server_app() -> web.Application:
    """/generate and /generate_stream that misbehave on request: the prompt says how."""

    def tokens_to_send(body):
        wanted = body["parameters"]["max_new_tokens"]
        return wanted - 1 if "short" in body["inputs"] else wanted

    async def generate(request):
        body = await request.json()
        if "fail" in body["inputs"]:
            return web.json_response({"error": "boom", "error_type": "test"}, status=500)
        count = tokens_to_send(body)
        reply = {"generated_text": ["x" * count], "count_output_tokens": count, "finish_reason": "length"}
        return web.json_response(reply)

    async def generate_stream(request):
        body = await request.json()
        if "fail" in body["inputs"]:
            return web.json_response({"error": "boom", "error_type": "test"}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        count = tokens_to_send(body)
        for i in range(count):
            last = i == count - 1
            event = {"token": {"id": i, "text": "x", "logprob": 0.0, "special": False}, "finished": last}
            await response.write(f"data:{json.dumps(event)}\n\n".encode())
        return response

    async def completions(request):
        """vLLM's stream: the first chunk's text is empty and the next comes FIRST_GAP_S later."""
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        count = body["max_tokens"] - ("short" in body["prompt"])
        for i in range(count):
            choice = {"index": 0, "text": "x" if i else "", "finish_reason": "length" if i == count - 1 else None}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if i == 0:
                await asyncio.sleep(FIRST_GAP_S)
        usage = {"prompt_tokens": 3, "completion_tokens": count, "total_tokens": 3 + count}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/v1/completions", completions)
    return app


FIRST_GAP_S = 0.5


async def run_against_fake_server(requests, stream, **options):
    runner = web.AppRunner(fake_server_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await run_requests(f"http://127.0.0.1:{port}", requests, stream, progress=False, **options)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])
def test_failed_requests_are_counted_not_hidden(stream):
    kinds = ["ok"] * 7 + ["fail"] * 2 + ["short"] * 3
    random.Random(0).shuffle(kinds)
    requests = [SampledRequest(f"{kind} prompt {i}", [1, 2, 3, 4], 5 + i) for i, kind in enumerate(kinds)]
    results, duration = asyncio.run(run_against_fake_server(requests, stream))
    assert [r.success for r in results] == [kind == "ok" for kind in kinds]
    summary = summarize(results, duration)
    assert (summary["completed"], summary["failed"]) == (7, 5)
    ok_outputs = [r.output_len for r, kind in zip(requests, kinds) if kind == "ok"]
    assert summary["total_output_tokens"] == sum(ok_outputs)
    assert sum(count for error, count in summary["errors"].items() if error.startswith("HTTP 500")) == 2
    assert sum(count for error, count in summary["errors"].items() if error.startswith("expected")) == 3
    if stream:
        assert all(r.ttft is not None and len(r.itl) == r.output_len - 1 for r in results if r.success)


def test_completions_are_timed_as_vllm_times_them():
    """TTFT at the first chunk with a choice though its text is empty (vLLM's client), an ITL
    between chunks, the token count from the usage chunk: a short answer fails on it."""
    requests = [SampledRequest(f"{kind} prompt", [1, 2, 3], 4) for kind in ("ok", "short", "ok")]
    results, _ = asyncio.run(run_against_fake_server(requests, True, api="completions"))
    assert [(r.success, r.output_len) for r in results] == [(True, 4), (False, 3), (True, 4)]
    for r in (results[0], results[2]):
        # the gap on the right side of the first chunk; measured by one event loop with the server's
        # writes, which can take the first chunk a few ms late (0.497 s seen once under a full test run)
        assert r.ttft < FIRST_GAP_S / 2 < r.itl[0] and len(r.itl) == 3 and r.output_text == "xxx"


def gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(offsets)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
@pytest.mark.parametrize("arrival", ["own", "vllm"])
def test_arrivals_have_the_rate_and_gamma_shape_asked_for(arrival, burstiness):
    """Gaps of mean 1/rate whose coefficient of variation is 1/sqrt(shape), in order from 0 on."""
    count, rate = 20000, 20.0
    offsets = arrival_offsets(count, rate, seed=7, arrival=arrival, burstiness=burstiness)
    spread = gaps(offsets)
    assert len(offsets) == count and offsets[0] >= 0 and (spread >= 0).all()
    assert spread.mean() == pytest.approx(1 / rate, rel=0.03)
    assert spread.std() / spread.mean() == pytest.approx(burstiness ** -0.5, rel=0.05)
    if arrival == "vllm":  # scaled so that the last request goes out at count / rate exactly
        assert offsets[-1] == pytest.approx(count / rate, rel=1e-12)
    else:
        assert offsets[0] == 0.0
    assert arrival_offsets(5, float("inf"), 0, arrival, burstiness) == [0.0] * 5


def test_vllm_arrivals_replay_its_client_for_a_seed():
    """vLLM's `bench serve` seeds numpy's global generator with --seed and draws one gap per
    request, the first included, with np.random.gamma(burstiness, 1 / (rate * burstiness)); the
    running sums are scaled so that the last is count / rate."""
    count, rate, burstiness, seed = 50, 20.0, 0.7, 3
    np.random.seed(seed)
    sums = np.cumsum([np.random.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)) for _ in range(count)])
    expected = sums * (count / rate) / sums[-1]
    assert arrival_offsets(count, rate, seed, "vllm", burstiness) == pytest.approx(expected.tolist(), rel=1e-12)
    assert arrival_offsets(count, rate, seed, "vllm", burstiness)[0] > 0  # the first one waits too


def test_own_poisson_arrivals_are_the_ones_sent_before():
    """burstiness 1 keeps the seeded sequence of the earlier client (expovariate gaps from 0)."""
    rng, expected = random.Random(5), [0.0]
    for _ in range(9):
        expected.append(expected[-1] + rng.expovariate(8.0))
    assert arrival_offsets(10, 8.0, 5) == expected


@pytest.mark.timeout(300)
def test_client_processes_share_the_requests_and_keep_their_order():
    """Three client processes: every request answered once, results in request order, each as the
    one-process client gets it (the fake server answers by what the prompt says)."""
    kinds = ["ok"] * 9 + ["fail"] * 2 + ["short"] * 3
    random.Random(1).shuffle(kinds)
    requests = [SampledRequest(f"{kind} prompt {i}", [1, 2, 3], 3 + i) for i, kind in enumerate(kinds)]
    loop, started = asyncio.new_event_loop(), threading.Event()
    runner = web.AppRunner(fake_server_app())

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        serve.port = site._server.sockets[0].getsockname()[1]
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        url = f"http://127.0.0.1:{serve.port}"
        shared, duration, cpu = run_requests_in_processes(url, requests, True, processes=3, timeout_s=120)
        alone, _, _ = run_requests_in_processes(url, requests, True, processes=1, timeout_s=120)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
    assert [r.success for r in shared] == [kind == "ok" for kind in kinds]
    assert [(r.success, r.output_len, r.error is None) for r in shared] == \
        [(r.success, r.output_len, r.error is None) for r in alone]
    assert duration > 0 and cpu > 0


def test_connection_refused_is_a_failed_request():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        requests = [SampledRequest("hello there", [1, 2], 4)] * 3
        results, _ = asyncio.run(run_requests(f"http://127.0.0.1:{port}", requests, True, progress=False))
    assert not any(r.success for r in results)
    assert all("Connect" in r.error or "Connection" in r.error for r in results)


@pytest.mark.timeout(600)
def test_end_to_end_against_the_real_server_on_cpu(tmp_path):
    from lightllm.tools.bench_model import write_bench_model

    model = write_bench_model(tmp_path / "tiny", "tiny", seed=0)
    server_args = ["--model_dir", str(model), "--tp", "1", "--max_total_token_num", "8192", "--host", "127.0.0.1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = start_server(server_args, tmp_path / "server.log", own_session=True)
    try:
        url = server.url
        data_path = tmp_path / "short.json"
        rng = random.Random(2)
        data_path.write_text(json.dumps([conversation(rng.randint(4, 60), rng.randint(4, 40), rng) for _ in range(40)]))
        client_cmd = [sys.executable, str(BENCHMARK / "serving" / "benchmark_serving.py"), "--base-url", url]
        client_cmd += ["--model", str(model), "--dataset", str(data_path), "--num-prompts", "20", "--stream"]
        client_cmd += ["--result-json", str(tmp_path / "result.json"), "--no-progress"]
        client = subprocess.run(client_cmd, env=env, capture_output=True, text=True, timeout=400)
        # as vLLM's client: its arrival times and body (sampled: no temperature), counted from the usage
        as_vllm_cmd = [*client_cmd[:-3], "--num-prompts", "8", "--api", "completions", "--arrival", "vllm",
                       "--request-rate", "40", "--result-json", str(tmp_path / "as_vllm.json"), "--no-progress"]
        as_vllm = subprocess.run(as_vllm_cmd, env=env, capture_output=True, text=True, timeout=400)
        single_cmd = [sys.executable, str(BENCHMARK / "serving" / "single_request.py"), "--url", url]
        single = subprocess.run(single_cmd + ["--max-new-tokens", "8", "--repeat", "2"], env=env,
                                capture_output=True, text=True, timeout=400)
    finally:
        server.stop(timeout=30)
    assert client.returncode == 0, client.stdout + client.stderr
    for name in METRIC_LINES:
        assert name in client.stdout, name
    assert single.returncode == 0, single.stdout + single.stderr
    assert "| median |" in single.stdout and "answered with 8 tokens each" in single.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (20, 0)
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
    assert as_vllm.returncode == 0, as_vllm.stdout + as_vllm.stderr
    as_vllm_result = json.loads((tmp_path / "as_vllm.json").read_text())
    assert (as_vllm_result["completed"], as_vllm_result["failed"]) == (8, 0)
    assert as_vllm_result["total_output_tokens"] == sum(result["per_request"]["output_len"][:8])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from lightllm.tools.bench_model import write_bench_model

    return write_bench_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_bandwidth_floor_counts_the_weights_a_decode_step_reads(which, tiny_model):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightllm.models import read_config
    from lightllm.tools.default_model import ensure_default_model
    from benchmark.engine.static_benchmark import weight_bytes

    model_dir = tiny_model if which == "tiny" else ensure_default_model()
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    params = sum(p.numel() for p in model.parameters())  # a tied LM head is counted once
    if not hf_config.tie_word_embeddings:
        params -= hf_config.vocab_size * hf_config.hidden_size  # embedding: one row per token
    assert weight_bytes(read_config(model_dir), itemsize=2) == 2 * params


def test_static_benchmark_measures_the_grid_and_frees_every_token(tiny_model):
    from benchmark.engine import static_benchmark

    args = static_benchmark.build_parser().parse_args(
        ["--model", str(tiny_model), "--load-format", "auto", "--dtype", "float32", "--device", "cpu"]
        + ["--max-total-token-num", "500", "--prefill-batch", "1,2", "--prefill-len", "8,400"]
        + ["--decode-batch", "1,3", "--decode-context", "8,190", "--warmup", "1", "--iters", "2"]
    )
    runner = static_benchmark.make_runner(args)
    points, skipped = static_benchmark.run_grid(static_benchmark.Bench(runner, 0), args, bandwidth=1e10)
    measured = {(p.phase, p.batch, p.context) for p in points}
    assert measured == {("prefill", 1, 8), ("prefill", 2, 8), ("prefill", 1, 400)} | {
        ("decode", 1, 8), ("decode", 3, 8), ("decode", 1, 190)
    }
    assert len(skipped) == 2  # prefill 2 x 400 and decode 3 x 190 need more than 500 tokens
    assert all(p.ms > 0 and p.tokens_per_s > 0 for p in points)
    assert all(0 < p.floor_fraction for p in points if p.phase == "decode")
    assert runner.stats()["tokens_used"] == 0 and runner.stats()["running_requests"] == 0


@pytest.mark.timeout(300)
def test_frontend_bench_serves_every_request_through_simulated_gpus(tmp_path):
    """frontend_bench.py: the real server with simulated model workers (two routers) answers every
    request in full, and reports each server process's CPU."""
    from transformers import AutoTokenizer

    from benchmark.serving import frontend_bench
    from lightllm.tools.bench_model import write_bench_model

    model = write_bench_model(tmp_path / "tiny", "tiny", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [f"request {i}: " + "tell me about rivers " * (i % 7 + 1) for i in range(12)]
    sample = [SampledRequest(p, tokenizer(p)["input_ids"], 5 + 3 * i) for i, p in enumerate(prompts)]
    sharegpt.save_requests(tmp_path / "requests.json", sample)
    args = frontend_bench.build_parser().parse_args([
        "--model", str(model), "--requests", str(tmp_path / "requests.json"), "--num-prompts", "12", "--dp", "2",
        "--device-scale", "0", "--server-args=--max_total_token_num 4096", "--out-dir", str(tmp_path / "out")])
    row = frontend_bench.bench(args)
    assert row["failed"] == 0 and row["requests"] == 12
    assert row["tok_s"] * row["duration_s"] == pytest.approx(sum(r.output_len for r in sample))
    assert {"http", "detokenizer", "router 0", "router 1", "client"} <= set(row["cpu_us_per_token"])
