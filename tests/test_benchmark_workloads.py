"""The prefix-cache workloads of the serving benchmark: shared-prefix prompts, multi-turn replay,
the prefix-cache counters in the summary; built without a server, then run against a fake
server and against the real one on the default model."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from aiohttp import web

from benchmark.serving import benchmark_serving
from benchmark.lib import prefix_workloads as pw
from benchmark.lib.serving_client import run_conversations
from benchmark.lib.serving_metrics import format_summary, prefix_cache_figures, summarize, unlabelled_samples

QUERIES = "lightllm:prefix_cache_queries_total"
HITS = "lightllm:prefix_cache_hits_total"
# Plain words and a few multi-byte ones, so that some cuts fall inside a UTF-8 character.
VOCABULARY = "the cache keeps every prompt prefix it has seen and serves naïve café 東京 über 🙂 tokens".split()


def words(count: int, rng: random.Random) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(count))


def record(messages: int, rng: random.Random) -> dict:
    turns = [{"from": "x", "value": words(rng.randint(20, 90), rng)} for _ in range(messages)]
    return {"id": str(rng.random()), "conversations": turns}


@pytest.fixture(scope="module")
def records():
    rng = random.Random(5)
    return [record(rng.choice([1, 2, 3, 4, 6, 8]), rng) for _ in range(120)]


@pytest.fixture(scope="module")
def dataset(records, tmp_path_factory):
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)


def shared_prefix(records, tokenizer, spec, seed):
    rng = random.Random(seed)
    return pw.shared_prefix_requests(pw.TokenStream(pw.message_texts(records), tokenizer, rng), tokenizer, spec, rng)


def group_of(prompt: str, systems: list[str]) -> int:
    (group,) = [i for i, system in enumerate(systems) if prompt.startswith(system + pw.SYSTEM_SEPARATOR)]
    return group


def test_shared_prefix_groups_share_their_system_prompt_tokens(records, tokenizer):
    spec = pw.SharedPrefixSpec(groups=4, group_size=6, prefix_len=64, question_len=16, output_len=8)
    systems, requests = shared_prefix(records, tokenizer, spec, seed=0)
    assert len(requests) == 24 and len(set(r.prompt for r in requests)) == 24
    assert all(r.output_len == 8 and r.prompt_ids == tokenizer(r.prompt).input_ids for r in requests)
    groups = [group_of(r.prompt, systems) for r in requests]
    assert sorted(groups) == sorted(list(range(4)) * 6)
    changes = sum(a != b for a, b in zip(groups, groups[1:]))
    assert changes > 3 * 4  # interleaved, not one group after another (3 changes)

    heads = []
    for group, system in enumerate(systems):
        system_ids = tokenizer(system).input_ids
        assert abs(len(system_ids) - spec.prefix_len) <= 1
        members = [r for r, g in zip(requests, groups) if g == group]
        # the system prompt's tokens, except perhaps the one at the seam with the question
        assert all(r.prompt_ids[: len(system_ids) - 1] == system_ids[:-1] for r in members)
        assert all(abs(r.prompt_len - (spec.prefix_len + 1 + spec.question_len)) <= 2 for r in members)
        heads.append(tuple(system_ids[: spec.prefix_len - 1]))
    assert len(set(heads)) == 4  # every group has its own prefix

    _, again = shared_prefix(records, tokenizer, spec, seed=0)
    _, other = shared_prefix(records, tokenizer, spec, seed=1)
    assert again == requests and [r.prompt for r in other] != [r.prompt for r in requests]


def test_multi_turn_conversations_cut_the_users_messages(records, tokenizer):
    spec = pw.MultiTurnSpec(conversations=10, turns=3, turn_len=24, output_len=8)
    conversations = pw.multi_turn_conversations(records, tokenizer, spec, random.Random(0))
    by_first = {pw.user_messages(r)[0][:40]: pw.user_messages(r) for r in records}
    assert len(conversations) == 10 and len({c[0] for c in conversations}) == 10
    for messages in conversations:
        originals = by_first[messages[0][:40]]
        assert len(messages) == 3 and len(originals) >= 3  # only conversations with 3 user turns
        for message, original in zip(messages, originals):
            length = len(tokenizer(message, add_special_tokens=False).input_ids)
            full = len(tokenizer(original, add_special_tokens=False).input_ids)
            assert min(full, 24) - 3 <= length <= 24  # a cut inside a character drops its bytes' tokens
    with pytest.raises(ValueError, match="conversations have 5 user messages"):
        pw.multi_turn_conversations(records, tokenizer, pw.MultiTurnSpec(200, 5, 24, 8), random.Random(0))


class FakeServer:
    """/generate, /generate_stream and /metrics; records every prompt and the answer it gave."""

    def __init__(self, with_counters: bool):
        self.answers: dict[str, str] = {}
        self.counters = {QUERIES: 1000.0, HITS: 200.0} if with_counters else {}
        self.app = web.Application()
        self.app.router.add_post("/generate", self.generate)
        self.app.router.add_post("/generate_stream", self.generate_stream)
        self.app.router.add_get("/metrics", self.metrics)

    def answer(self, body: dict) -> tuple[str, int]:
        prompt, count = body["inputs"], body["parameters"]["max_new_tokens"]
        text = f" answer{len(self.answers)}" + "x" * (count - 1)
        self.answers[prompt] = text
        if self.counters:
            self.counters[QUERIES] += 10
            self.counters[HITS] += 4
        return text, count

    async def generate(self, request):
        body = await request.json()
        if "fail" in body["inputs"]:
            return web.json_response({"error": "boom"}, status=500)
        text, count = self.answer(body)
        return web.json_response({"generated_text": [text], "count_output_tokens": count, "finish_reason": "length"})

    async def generate_stream(self, request):
        text, count = self.answer(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(count):
            last = i == count - 1
            event = {"token": {"id": i, "text": "?"}, "finished": last, "generated_text": text if last else None}
            await response.write(f"data:{json.dumps(event)}\n\n".encode())
        return response

    async def metrics(self, request):
        lines = ["# TYPE lightllm:request_success_total counter", 'lightllm:request_success_total{finished_reason="length"} 3']
        lines += [f"{name} {value}" for name, value in self.counters.items()]
        return web.Response(text="\n".join(lines) + "\n")


async def serve(fake: FakeServer, work):
    runner = web.AppRunner(fake.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        return await work(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])
def test_multi_turn_replay_resends_the_history_with_each_answer(stream):
    conversations = [[f"conversation {c} message {t}" for t in range(3)] for c in range(4)]
    fake = FakeServer(with_counters=False)

    async def work(url):
        return await run_conversations(url, conversations, 5, lambda p: list(range(len(p))), stream, progress=False)

    results, _ = asyncio.run(serve(fake, work))
    assert [r.success for r in results] == [True] * 12 and all(r.output_len == 5 for r in results)
    for c, messages in enumerate(conversations):
        prompts = [p for p in fake.answers if p.startswith(f"User: {messages[0]}\n")]
        prompts.sort(key=len)
        assert len(prompts) == 3 and prompts[0] == pw.turn_prompt("", messages[0])
        for turn in range(1, 3):
            assert prompts[turn].startswith(prompts[turn - 1] + fake.answers[prompts[turn - 1]])
            assert prompts[turn].endswith(pw.turn_prompt("", messages[turn]))
        turn_results = results[3 * c : 3 * c + 3]
        assert [r.prompt_len for r in turn_results] == [len(p) for p in prompts]
        assert [r.output_text for r in turn_results] == [fake.answers[p] for p in prompts]


def test_a_failed_turn_ends_its_conversation_and_counts_the_rest_as_failed():
    conversations = [["hello", "please fail", "never sent"], ["a", "b", "c"]]
    fake = FakeServer(with_counters=False)

    async def work(url):
        return await run_conversations(url, conversations, 3, lambda p: [0], False, progress=False)

    results, duration = asyncio.run(serve(fake, work))
    assert [r.success for r in results] == [True, False, False, True, True, True]
    assert not any("never sent" in prompt for prompt in fake.answers)
    summary = summarize(results, duration)
    assert (summary["completed"], summary["failed"]) == (4, 2)
    assert summary["errors"] == {"HTTP 500: boom": 1, "not sent: turn 2 failed": 1}


def test_prefix_cache_counters_are_read_from_prometheus_text_or_reported_absent():
    text = f"# HELP {QUERIES} x\n# TYPE {QUERIES} counter\n{QUERIES} 1500.0\n{HITS} 600\n{HITS}_created 1.7e9\n"
    assert unlabelled_samples(text, [QUERIES, HITS]) == {QUERIES: 1500.0, HITS: 600.0}
    figures = prefix_cache_figures({QUERIES: 1000.0, HITS: 200.0}, {QUERIES: 1500.0, HITS: 600.0})
    assert figures == {
        "prefix_cache_queries": 500, "prefix_cache_hits": 400, "prefix_cache_hit_rate": 0.8
    }
    summary = {**summarize([], 1.0), **figures}
    assert "Cache hit rate (%):                      80.00" in format_summary(summary)
    absent = prefix_cache_figures({}, {})
    assert set(absent.values()) == {None}
    assert format_summary({**summarize([], 1.0), **absent}).count("n/a (not on /metrics)") == 3


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
def test_the_script_reports_the_workload_and_the_counters_growth(workload, dataset, default_model_dir, tmp_path):
    fake = FakeServer(with_counters=True)
    sizes = ["--prefix-groups", "3", "--prefix-group-size", "2", "--prefix-len", "32", "--question-len", "8"]
    sizes += ["--conversations", "3", "--turns", "2", "--turn-len", "16", "--output-len", "4"]

    async def work(url):
        argv = ["--base-url", url, "--model", str(default_model_dir), "--dataset", str(dataset), "--workload", workload]
        argv += sizes + ["--warmup", "2", "--result-json", str(tmp_path / "result.json"), "--no-progress"]
        return await asyncio.to_thread(benchmark_serving.main, argv)

    assert asyncio.run(serve(fake, work)) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    sent = 6  # 3 groups x 2 requests, or 3 conversations x 2 turns; the 2 warm-ups come before
    assert (result["completed"], result["failed"]) == (sent, 0) and len(fake.answers) == sent + 2
    assert result["prefix_cache_queries"] == 10 * sent and result["prefix_cache_hits"] == 4 * sent
    assert result["prefix_cache_hit_rate"] == pytest.approx(0.4)
    expected = {"workload": workload, "output_len": 4}
    expected |= {"groups": 3, "group_size": 2, "prefix_len": 32} if workload == "shared-prefix" else {"turns": 2}
    assert expected.items() <= result["workload"].items()


def test_client_processes_send_every_request_once(dataset, default_model_dir, tmp_path):
    """--client-procs 2: the requests are shared between two client processes, each sent once."""
    fake = FakeServer(with_counters=True)
    sizes = ["--prefix-groups", "3", "--prefix-group-size", "3", "--prefix-len", "32", "--question-len", "8"]

    async def work(url):
        argv = ["--base-url", url, "--model", str(default_model_dir), "--dataset", str(dataset), "--stream",
                "--workload", "shared-prefix", "--output-len", "4", "--client-procs", "2", "--no-progress",
                "--result-json", str(tmp_path / "result.json")]
        return await asyncio.to_thread(benchmark_serving.main, argv + sizes)

    assert asyncio.run(serve(fake, work)) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (9, 0) and len(fake.answers) == 9
    assert result["total_output_tokens"] == 9 * 4
    with pytest.raises(SystemExit):
        benchmark_serving.parse_args(["--workload", "multi-turn", "--client-procs", "2"])


def test_both_workloads_against_the_real_server(default_server, dataset, default_model_dir, tmp_path, capsys):
    common = ["--base-url", default_server.url, "--model", str(default_model_dir), "--dataset", str(dataset)]
    common += ["--stream", "--output-len", "8", "--no-progress"]
    runs = {
        "shared-prefix": ["--prefix-groups", "2", "--prefix-group-size", "2"]
        + ["--prefix-len", "32", "--question-len", "8"],
        "multi-turn": ["--conversations", "2", "--turns", "2", "--turn-len", "16"],
    }
    for workload, sizes in runs.items():
        out = tmp_path / f"{workload}.json"
        assert benchmark_serving.main(common + sizes + ["--workload", workload, "--result-json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert (result["completed"], result["failed"]) == (4, 0)
        assert result["total_output_tokens"] == 4 * 8 and result["median_ttft_ms"] > 0
        if result["prefix_cache_hits"] is not None and workload == "multi-turn":
            assert result["prefix_cache_hits"] >= 2 * 16  # turn 2 resends turn 1's prompt
    assert "Median TTFT (ms):" in capsys.readouterr().out
