"""The cost of a streamed token in the HTTP process, and that cutting it changes no byte.

A streamed answer writes the events that are ready together (Generation._coalesced): while
outputs of the request have come and are not yet taken, its events are held and go out in one
write with the next; the bytes the client reads are the same, and each write ends where the
backlog ran dry (or at the stream's end). The receiver routes every waiting message before a
stream runs; a step's per-token messages pickle as columns; a plain /generate_stream event is written
without building its dict."""

import asyncio
import dataclasses
import pickle
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.engine.request import FinishReason, TokenOut
from lightllm.server.httpserver.generation import Generation
from lightllm.server.io_struct import BatchTextOut, BatchTokenOut, TextOut


class Backlogs:
    """Stands in for HttpServerManager.backlog: the outputs queued for each request id."""

    def __init__(self):
        self.queued = {}

    def backlog(self, req_id: int) -> int:
        return self.queued.get(req_id, 0)


def generation_over(backlogs: Backlogs, req_ids: list[int]) -> Generation:
    generation = object.__new__(Generation)  # only what _coalesced reads
    generation._manager, generation._req_ids, generation._merged = backlogs, req_ids, None
    return generation


def run(generation: Generation, events) -> list[str]:
    async def collect():
        return [chunk async for chunk in generation._coalesced(events)]
    return asyncio.run(collect())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40))
def test_writes_join_to_the_events_and_end_where_the_backlog_is_empty(backlog_after):
    """Event k is yielded while backlog_after[k] outputs are queued behind it."""
    backlogs = Backlogs()
    events = [f"data: {{\"n\": {k}}}\n\n" for k in range(len(backlog_after))]

    async def produce():
        for event, left in zip(events, backlog_after):
            backlogs.queued[7] = left
            yield event

    writes = run(generation_over(backlogs, [7]), produce())
    assert "".join(writes) == "".join(events)
    # A write closes after each event with an empty backlog, and after the last event.
    cuts = [k for k, left in enumerate(backlog_after) if left == 0 or k == len(events) - 1]
    expected, start = [], 0
    for k in cuts:
        expected.append("".join(events[start:k + 1]))
        start = k + 1
    assert writes == expected


def test_one_write_per_event_without_a_backlog():
    backlogs = Backlogs()

    async def produce():
        for k in range(5):
            yield f"data: {k}\n\n"

    assert run(generation_over(backlogs, [1]), produce()) == [f"data: {k}\n\n" for k in range(5)]


def test_every_choice_counts():
    """n choices: held while any of them has outputs queued (or the merged queue holds some)."""
    backlogs = Backlogs()
    generation = generation_over(backlogs, [1, 2])

    async def produce():
        backlogs.queued = {1: 0, 2: 3}
        yield "a"
        backlogs.queued = {1: 0, 2: 0}
        generation._merged = asyncio.Queue()
        generation._merged.put_nowait(object())
        yield "b"
        generation._merged.get_nowait()
        yield "c"

    assert run(generation, produce()) == ["abc"]


def test_leaving_early_closes_the_events():
    """A client that goes away: closing the written stream closes the events' generator at once
    (its finally aborts the request in the router)."""
    closed = []

    async def produce():
        try:
            for k in range(100):
                yield f"{k}"
        finally:
            closed.append(True)

    async def take_two():
        stream = generation_over(Backlogs(), [1])._coalesced(produce())
        got = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return got

    assert asyncio.run(take_two()) == ["0", "1"]
    assert closed == [True]


def test_the_manager_routes_every_step_that_has_come_before_a_stream_runs():
    """Three steps' outputs wait in the HTTP process's socket: the manager puts all of them in the
    request's queue in one pass, so its stream finds a backlog of two behind the first (and writes
    the three at once) instead of getting one step a pass of the event loop."""
    from lightllm.server.config import ServerConfig
    from lightllm.engine.request import FinishReason, SamplingParams
    from lightllm.server.io_struct import BatchTextOut, TextOut
    from server_utils import wired_manager

    async def scenario():
        async with wired_manager(ServerConfig()) as (manager, router, to_http):
            stream = manager.generate([1, 2], SamplingParams())
            first = asyncio.ensure_future(anext(stream))
            req_id = (await router.recv_pyobj()).req_id

            async def consume():  # as a streamed answer does: each output, and what waits behind it
                seen = [(await first).count_output_tokens, manager.backlog(req_id)]
                async for out in stream:
                    seen.append((out.count_output_tokens, manager.backlog(req_id)))
                return seen

            consumer = asyncio.ensure_future(consume())
            await asyncio.sleep(0.1)
            for n in (1, 2, 3):  # three steps, in the socket before the receiver runs
                finish = FinishReason.LENGTH if n == 3 else None
                to_http.send_pyobj(BatchTextOut([TextOut(req_id, 10 + n, "x", 0.0, False, n, finish)]))
            # ZeroMQ's I/O threads deliver them while this loop is held (a blocking sleep: the
            # receiver cannot run); without it, a loaded CI machine let the receiver take step 1
            # before steps 2 and 3 had arrived (backlog 0 instead of 2).
            time.sleep(0.5)
            seen = await asyncio.wait_for(consumer, 10)
            assert seen == [1, 2, (2, 1), (3, 0)]

    asyncio.run(scenario())


finishes = st.none() | st.sampled_from(list(FinishReason))
floats = st.floats(allow_nan=False)
token_outs = st.builds(TokenOut, st.integers(0, 2**62), st.integers(0, 2**31 - 1), floats, finishes,
                       st.none() | st.text(max_size=5), st.integers(0, 10**6), floats,
                       st.none() | st.lists(st.tuples(st.integers(0, 99), floats), max_size=2),
                       st.none() | st.lists(st.tuples(floats, st.lists(st.tuples(st.integers(0, 99), floats))), max_size=2))
text_outs = st.builds(TextOut, st.integers(0, 2**62), st.integers(0, 2**31 - 1), st.text(max_size=5), floats,
                      st.booleans(), st.integers(0, 10**6), finishes, st.none() | st.text(max_size=5),
                      st.none() | st.integers(0, 60), st.integers(0, 10**6), floats,
                      st.none() | st.lists(st.tuples(st.integers(0, 99), st.text(max_size=3), floats), max_size=2))


def plain_or(items):
    """Mostly items of their leading fields only (as most tokens are), some with others set too."""
    return st.lists(st.one_of(items, items.map(lambda out: type(out)(*dataclasses.astuple(out)[:6 if isinstance(
        out, TextOut) else 3]))), max_size=30)


@settings(max_examples=300, deadline=None)
@given(plain_or(token_outs), plain_or(text_outs))
def test_a_batch_of_per_token_messages_loads_as_sent(tokens, texts):
    """BatchTokenOut and BatchTextOut cross a socket for every step, pickled as columns: they load
    equal to what was sent, whatever fields each item sets."""
    for batch in (BatchTokenOut(tokens), BatchTextOut(texts)):
        loaded = pickle.loads(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
        assert loaded == batch and all(type(a) is type(b) for a, b in zip(loaded.items, batch.items))


def test_a_batch_of_plain_tokens_pickles_in_under_half_the_bytes_of_its_items():
    """Columns, not an object a token: a step's 256 plain tokens in under half the bytes of a list of
    their fields (what pickling each as its constructor's arguments would at least take)."""
    tokens = [TokenOut(i // 4, 1000 + i, -0.5 - i / 1e3) for i in range(256)]
    items = pickle.dumps([dataclasses.astuple(t) for t in tokens], protocol=pickle.HIGHEST_PROTOCOL)
    assert len(pickle.dumps(BatchTokenOut(tokens), protocol=pickle.HIGHEST_PROTOCOL)) < len(items) / 2


@settings(max_examples=300, deadline=None)
@given(token_id=st.integers(0, 2**31 - 1), text=st.text(), logprob=st.floats(allow_nan=True, allow_infinity=True),
       special=st.booleans(), finish=st.sampled_from([None, "length", "stop", "eos"]), detailed=st.booleans(),
       top=st.booleans(), full_text=st.one_of(st.none(), st.text()))
def test_a_generate_stream_event_is_the_json_of_its_body(token_id, text, logprob, special, finish, detailed, top,
                                                         full_text):
    """Whichever way it is written, an event is exactly json.dumps of its body (ensure_ascii off)."""
    import json

    from lightllm.server.httpserver.generate_api import event_body, sse_event
    from lightllm.engine.request import FinishReason
    from lightllm.server.io_struct import TextOut

    reason = None if finish is None else FinishReason(finish)
    out = TextOut(7, token_id, text, logprob, special, 3, reason, top_logprobs=[(token_id, text, -1.5)] if top else None)
    expected = f"data:{json.dumps(event_body(out, full_text, detailed, 11), ensure_ascii=False)}\n\n"
    assert sse_event(out, full_text, detailed, 11) == expected
