"""Grammars compile on the HTTP side, off the engine step, within --grammar_compile_timeout: a
schema that takes longer gets 400 while a running stream keeps its pace, and structured output
still follows its schema."""

import json
import statistics
import time

import pytest

from lightllm.tools.bench_model import write_bench_model
from server_utils import StreamArrivals, ref_chain, slow_schema, start_server

# --grammar_compile_timeout of the test's server. The compiler runs at a lower priority (niceness
# 10): beside another test process on two busy cores, the 0.17 s of the first test's grammar took
# over 1 s.
BOUND = 4.0
# The running stream's length: long enough to outlast a request answered at BOUND and 2 s more on an
# idle machine, where the tiny model makes 300+ tokens a second (2,500 ran out before then); the
# server takes requests that long.
STREAM_TOKENS = 6000
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "word"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "word": {"type": "string", "maxLength": 6}}}


def follows_schema(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"ok", "n", "word"} and isinstance(value["ok"], bool)
            and type(value["n"]) is int and 0 <= value["n"] <= 99
            and isinstance(value["word"], str) and len(value["word"]) <= 6)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("grammar")
    server = start_server(["--model_dir", str(write_bench_model(out, "tiny")), "--grammar_compile_timeout",
                           str(BOUND), "--max_req_total_len", str(STREAM_TOKENS + 64)], out / "server.log")
    yield server
    code = server.stop()
    assert code == 0, (code, server.log_text()[-3000:])


def test_a_first_grammar_loads_while_a_stream_keeps_its_pace(server):
    """First in the module: the server's first grammar, a $ref chain of 1.4 MiB compiled. Each of the
    HTTP process and the model runner builds its structured output (xgrammar's import, its view of
    the tokenizer: a second or more of Python holding the GIL) as the server starts, not at this
    request, where it stalled every running stream; the compile runs in a child process and the
    runner's read in C++ without the GIL, both at a lower priority."""
    server.wait_for_structured_output()
    stream = StreamArrivals(server, {"inputs": "keep going", "parameters": {"max_new_tokens": STREAM_TOKENS, "ignore_eos": True}})
    arrivals = stream.arrivals
    server.wait_for(lambda: len(arrivals) >= 40, timeout=120, what="40 streamed tokens")
    sent = time.monotonic()
    body = {"inputs": "x", "parameters": {"max_new_tokens": 4, "grammar": {"type": "json", "value": ref_chain(250)}}}
    reply = server.post("/generate", body)
    answered = time.monotonic()
    assert reply.status_code == 200, reply.text
    stream.close()
    before = [gap for gap, b in stream.gaps()[1:] if b <= sent]  # the first gap is the prompt's
    during = [gap for gap, b in stream.gaps() if b > sent]
    # Built at this request, as it was, the stream lost 0.6-1.3 s in gaps over 0.1 s here (2-core CPU;
    # the tiny model's tokens come every 5-10 ms), the longest 0.3-0.4 s; now none of 0.05 s. A stall
    # is a gap over 0.2 s and over 4x the stream's pace, before the request and while it runs: the
    # compile takes a core, and with the suite's other worker on the other one every token slowed
    # alike to 0.13-0.18 s for the request's 8 s, a slower pace but no stall; in another full run
    # (2026-12-06) a few gaps of 0.10-0.12 s among fast ones summed to 0.55 s over a 0.1 s bound.
    # The bound leaves it a few stalls of its own.
    threshold = max(0.2, 4 * statistics.median(before), 4 * statistics.median(during))
    stalled = sum(gap for gap in during if gap > threshold)
    assert stalled < 0.3, (stalled, threshold, sorted(during)[-5:], answered - sent)


def test_structured_output_follows_its_schema(server):
    """Also the warm-up: each process builds its tokenizer view of xgrammar once, at its first grammar."""
    for _ in range(2):  # the second is served from the HTTP process's cache
        answer = server.generate("answer:", max_new_tokens=64, grammar={"type": "json", "value": SCHEMA})
        assert follows_schema(json.loads(answer["generated_text"][0])), answer


def test_a_grammar_over_the_bound_gets_400_while_a_stream_keeps_its_pace(server):
    server.generate("warm", max_new_tokens=4, grammar={"type": "json", "value": SCHEMA})
    stream = StreamArrivals(server, {"inputs": "keep going", "parameters": {"max_new_tokens": STREAM_TOKENS, "ignore_eos": True}})
    arrivals = stream.arrivals
    server.wait_for(lambda: len(arrivals) >= 40, timeout=120, what="40 streamed tokens")
    sent = time.monotonic()
    grammar = {"type": "json", "value": slow_schema(80)}
    reply = server.post("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 8, "grammar": grammar}})
    answered = time.monotonic()
    assert reply.status_code == 400, reply.text
    assert reply.json()["error_type"] == "validation"
    assert f"did not compile within {BOUND:g} s (--grammar_compile_timeout)" in reply.json()["error"]
    # The 400 comes at BOUND by the server's clock; the upper bound leaves a loaded machine 5 s. The
    # compile alone takes several seconds more here, so a server that waited for it before answering
    # would most often, not always, pass that: the stream's pace below is the sharper check.
    assert BOUND <= answered - sent < BOUND + 5
    # the compile is killed at the 400 and its process started again: watch the stream for 2 s more
    server.wait_for(lambda: arrivals[-1] > answered + 2.0, timeout=60, what="tokens 2 s after the 400")
    stream.close()
    before = [gap for gap, b in stream.gaps() if b <= sent]
    during = [gap for gap, b in stream.gaps() if b > sent and b - gap < answered + 2.0]
    # Compiled in the step, as it was, the stream stopped for the whole compile: longer than BOUND,
    # since the request got its 400. Here a gap may grow with the core the compile takes (this
    # 2-core machine is shared) and the compiler's restart.
    largest_before, largest_during = max(before), max(during)
    assert largest_during < min(BOUND, 10 * largest_before + 0.5), (largest_during, largest_before)
    assert len(during) >= (answered + 2.0 - sent) / BOUND
