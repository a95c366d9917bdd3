"""multi_turn_tiers.py's run against a fake server whose later turns never answer: the run ends at
its time bound with the turns that ended, instead of waiting on the open ones."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web
from helpers import BENCHMARK  # noqa: F401  (makes the benchmark package importable)

from benchmark.serving import multi_turn_tiers


class Tokenizer:
    class Encoding:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text):
        return self.Encoding([1] * len(text.split()))


def stalling_app(stop: asyncio.Event) -> web.Application:
    """First turns are answered at once (two tokens); a returning turn (it carries a history) not
    before `stop` is set."""

    async def generate_stream(request):
        body = await request.json()
        if body["inputs"].count("User:") > 1:
            await stop.wait()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(2):
            event = {"token": {"id": i, "text": "x", "logprob": 0.0, "special": False}, "finished": i == 1,
                     "generated_text": "x x"}
            await response.write(f"data:{json.dumps(event)}\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/generate_stream", generate_stream)
    return app


async def run_for(limit_s: float):
    stop = asyncio.Event()
    runner = web.AppRunner(stalling_app(stop))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    args = argparse.Namespace(think=0.0, output_len=2, max_concurrency=None, progress_s=0.2)
    conversations = [["hello there", "and again"], ["other words", "more"], ["a b c", "d e"]]
    try:
        return await asyncio.wait_for(multi_turn_tiers.run_all(url, conversations, args, Tokenizer(), limit_s), 30)
    finally:
        stop.set()
        await runner.cleanup()


def test_a_run_past_its_bound_reports_the_turns_that_ended():
    start = time.monotonic()
    pairs, duration, cut = asyncio.run(run_for(1.5))
    assert cut and 1.5 <= duration < 3 and time.monotonic() - start < 10
    assert sorted(turn for turn, _ in pairs) == [0, 0, 0] and all(r.success for _, r in pairs)
    row = multi_turn_tiers.summarize(pairs, duration, {}, {})
    assert row["requests"] == 3 and row["returning_ttft_median_ms"] is None


def test_a_variant_whose_server_fails_has_a_row_that_says_why():
    log = ("server exited with 1:\n2026-12-02 INFO [router] ok\n2026-12-02 ERROR [router] lightllm.server.router.manager: "
           "cannot load the model: RuntimeError: can't allocate memory")
    reason = multi_turn_tiers.failure(RuntimeError(log))
    assert reason == "[router] lightllm.server.router.manager: cannot load the model: RuntimeError: can't allocate memory"
    table = multi_turn_tiers.markdown([dict(variant="host", working_set=4.0, conversations=114, error=reason)])
    assert "| 4 | host | 114 | failed: " in table and table.count("\n") == 2
