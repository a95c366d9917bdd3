"""Big bodies are parsed in another process: the same dict or the same 4xx as a parse on the event
loop, and the loop goes on running while they are parsed (a thread would hold the GIL throughout)."""

import asyncio
import json
import time

import psutil
import pytest

from lightllm.frontend.errors import RequestError
from lightllm.server.httpserver import json_body
from lightllm.server.httpserver.json_text import MAX_JSON_DEPTH, MAX_JSON_KEYS, parse_json

KNOWN = frozenset({"inputs", "parameters"})
PAD = "x" * (json_body.OFF_LOOP_BYTES + 1)  # makes any body big


def compact(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def unknown_keys(count: int) -> bytes:
    return compact({"inputs": "hi", **{f"k{i}": 1 for i in range(count)}})


def padded(rest: str) -> bytes:
    """A body that starts {"inputs": PAD and goes on with `rest`."""
    return ('{"inputs": "' + PAD + '"' + rest).encode()


NESTED = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
BIG_BODIES = {
    "valid": compact({"inputs": PAD, "parameters": {"logit_bias": {str(i): 1.5 for i in range(1024)}, "n": [1, None]}}),
    "unknown keys": unknown_keys(600_000),
    "too many keys": compact({"inputs": PAD, "parameters": {f"k{i}": 0 for i in range(MAX_JSON_KEYS + 1)}}),
    "too deep": padded(f', "parameters": {NESTED}}}'),
    "not JSON": padded(", "),
    "NaN": padded(', "parameters": NaN}'),
    "lone surrogate": padded(', "parameters": "\\ud800"}'),
    "an array": ('["' + PAD + '"]').encode(),
}


def outcome(parse):
    """(the dict, None) or (None, the error's type, status and message)."""
    try:
        return parse(), None
    except RequestError as exc:
        return None, (type(exc).__name__, exc.status_code, str(exc))


@pytest.fixture(scope="module")
def event_loop_runner():
    with asyncio.Runner() as runner:
        yield runner
        json_body.PARSERS.close()


@pytest.mark.parametrize("name", list(BIG_BODIES))
def test_a_big_body_gets_what_a_parse_on_the_loop_gives(event_loop_runner, name):
    body = BIG_BODIES[name]
    assert len(body) > json_body.OFF_LOOP_BYTES
    here = outcome(lambda: parse_json(body, KNOWN))
    there = outcome(lambda: event_loop_runner.run(json_body.read_json("application/json", body, KNOWN)))
    assert there == here
    assert (here[0] is None) == (name != "valid")
    assert parse_processes(), "no parse process: the body was parsed in this one"


def parse_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]


def test_a_killed_parse_process_is_replaced(event_loop_runner):
    body = BIG_BODIES["valid"]
    event_loop_runner.run(json_body.read_json("application/json", body, KNOWN))
    killed = parse_processes()
    for process in killed:
        process.kill()
    psutil.wait_procs(killed, timeout=10)
    answers = []
    for _ in range(2):  # the first may find the pool broken: a 503 that asks to send it again
        answers.append(outcome(lambda: event_loop_runner.run(json_body.read_json("application/json", body, KNOWN))))
    assert answers[-1] == outcome(lambda: parse_json(body, KNOWN))
    assert all(answer[1] is None or answer[1][1] == 503 for answer in answers), answers
    assert not set(killed) & set(parse_processes())


def test_a_big_form_that_is_not_json_is_415(event_loop_runner):
    body = b"a=" + PAD.encode()
    with pytest.raises(RequestError) as raised:
        event_loop_runner.run(json_body.read_json(json_body.CURL_FORM_TYPE, body, KNOWN))
    assert raised.value.status_code == 415


async def longest_tick_gap(work) -> float:
    """The longest time the event loop left a 1 ms ticker waiting while `work` ran."""
    gaps = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.001)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    gaps.clear()
    await work
    ticker.cancel()
    return max(gaps)


async def parse_all(bodies: list[bytes]) -> list:
    return await asyncio.gather(*(json_body.read_json("application/json", body, KNOWN) for body in bodies),
                                return_exceptions=True)


def test_the_loop_ticks_while_big_bodies_are_parsed(event_loop_runner):
    """Three 600k-key bodies (7.2 MB each) and one valid one of 65k keys, at once. On a thread, each
    json.loads holds the GIL, and the loop, for as long as it runs (about 0.3 s on a 2-core CPU);
    here the loop waits only for unpickling the answers: the errors, and the valid body's dict."""
    hostile = BIG_BODIES["unknown keys"]
    valid = compact({"inputs": "hi", "parameters": {f"k{i}": i for i in range(MAX_JSON_KEYS - 10)}})
    start = time.monotonic()
    json.loads(hostile)
    parse_s = time.monotonic() - start
    event_loop_runner.run(parse_all([valid]))  # the processes started, as a server's are after its first big body
    idle_gap = event_loop_runner.run(longest_tick_gap(asyncio.sleep(0.3)))
    busy_gap = event_loop_runner.run(longest_tick_gap(parse_all([hostile, hostile, valid, hostile])))
    assert busy_gap < parse_s / 3 + 5 * idle_gap, (busy_gap, parse_s, idle_gap)
