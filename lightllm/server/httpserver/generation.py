"""One request's life on the HTTP side, shared by every endpoint that generates text.

`Generation` submits the token ids (n times for n choices; each prompt of a batch n times, for
/v1/completions' lists of prompts), times the request for /metrics, and hands back either the
whole choices or their outputs one by one. A client that disconnects aborts its request (the router
frees its KV tokens); a request that fails in the engine raises GenerationFailed (a 500), one that the
server ended as it stopped raises ServerUnavailable (a 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from lightllm.engine.request import FinishReason, SamplingParams
from lightllm.frontend.errors import RequestError
from lightllm.frontend.tokenizer import bad_word_forms, bad_words_ids
from lightllm.frontend.limits import check_lengths
from lightllm.server.httpserver.manager import ServerUnavailable
from lightllm.server.httpserver.metrics import RequestTimer
from lightllm.server.io_struct import TextOut


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class GenerationFailed(Exception):
    """The engine failed this request; the message says why."""

    status_code, error_type = 500, "internal"

    def __init__(self, reason: str):
        super().__init__(f"generation failed: {reason}")


def failure(out: TextOut) -> GenerationFailed | ServerUnavailable:
    """Why `out` (FinishReason.ERROR) ended its request, as the error its client gets."""
    if out.retry_after is not None:
        return ServerUnavailable(out.error, out.retry_after)
    return GenerationFailed(out.error)


async def off_loop(fn, *args):
    """Work that can take a while off the event loop, so that it does not stall other requests
    or /health: tokenization and chat templates (a long prompt), reading a grammar (xgrammar's
    first import takes about 1.5 s). asyncio's default thread pool is sized for the machine."""
    return await asyncio.to_thread(fn, *args)


async def sampling_of(state, body, *defaults: dict) -> SamplingParams:
    """body.sampling(*defaults) (an OpenAI body takes the model's sampling defaults): off the event
    loop where it reads a grammar (its JSON parsed and its structure walked), inline otherwise: a hop to
    a thread costs more than the rest, and under a burst the thread waits for the busy event
    loop's GIL (prompt_encoder.py). Bad words are tokenized on the encoder's thread (256 words of
    256 characters: 70 ms of a 2-core CPU, which the loop would not serve other requests for)."""
    sampling = await off_loop(body.sampling, *defaults) if body.reads_grammar else body.sampling(*defaults)
    if sampling.bad_words:
        forms = bad_word_forms(sampling.bad_words)
        encoded = await asyncio.gather(*(state.encoder.encode(form, add_special_tokens=False) for form in forms))
        sampling.bad_words_ids = bad_words_ids(state.tokenizer, list(encoded))
    return sampling


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, coro):
    """Await `coro`, cancelling it (and so aborting its request) if the client goes away first."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            raise ClientGone()
    return work.result()


@contextlib.contextmanager
def batch_member(index: int, size: int):
    """A RequestError about one prompt of a batch of `size` names it ('prompt[3]: ...')."""
    try:
        yield
    except RequestError as exc:
        if size == 1:
            raise
        raise RequestError(f"'prompt[{index}]': {exc}", exc.status_code) from None


@dataclass
class Choice:
    """One finished sequence of a request: its text and every output (for logprobs)."""

    index: int
    text: str
    outputs: list[TextOut]

    @property
    def last(self) -> TextOut:
        return self.outputs[-1]


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of n draws with seed + index, so that the choices differ and a seed gives them again."""
    return sampling if index == 0 else dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**63)


class Generation:
    """A submitted request with n choices (n requests in the engine; the prefix cache shares the
    prompt's KV between them, computed once): their output streams and timers. `prompts` holds
    one prompt's token ids, or a batch's (/v1/completions): choice c of prompt p is then choice
    p * n + c, as vLLM numbers them. `start` is the request's arrival; `max_tokens_field` the name
    of max_new_tokens in the route's API, for its errors."""

    def __init__(self, request: Request, prompts: list[list[int]], sampling: SamplingParams, start: float,
                 max_tokens_field: str, n: int = 1, lora_id: int = 0, cache_salt: str = "", priority: int = 0):
        state = request.app.state.server
        for i, prompt_ids in enumerate(prompts):
            with batch_member(i, len(prompts)):
                check_lengths(len(prompt_ids), sampling, state.limits, max_tokens_field)
        nothing = sampling.nothing_allowed(state.model_info["eos_token_ids"])
        if nothing is not None:
            raise RequestError(nothing)
        count = len(prompts) * n
        if count > 1:  # all choices or none: refused together, here, when the queue has no room for them
            state.manager.check_queue(count)
        self.request = request
        self.prompts, self.n = prompts, n
        self.prompt_len = sum(len(prompt_ids) for prompt_ids in prompts)  # each prompt once, as usage counts it
        self.timers = [RequestTimer(state.metrics, len(prompt_ids), start) for prompt_ids in prompts for _ in range(n)]
        self.streams = [state.manager.generate(prompt_ids, choice_sampling(sampling, i), bounded=count == 1,
                                               lora_id=lora_id, cache_salt=cache_salt, priority=priority)
                        for prompt_ids in prompts for i in range(n)]
        self._manager = state.manager
        self._req_ids: list[int] = []  # the engine's ids of the choices, known from their first outputs
        self._merged: asyncio.Queue | None = None  # outputs() with several choices: their outputs, merged

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache supplied, each prompt's once (its first choice's)."""
        return sum(timer.cached_tokens for timer in self.timers[:: self.n])

    async def result(self) -> list[Choice]:
        """Every choice, whole."""
        choices = await self._guarded(asyncio.gather(*(self._collect(i) for i in range(len(self.streams)))))
        for choice in choices:
            if choice.last.finish_reason is FinishReason.ERROR:
                raise failure(choice.last)
        return choices

    async def first(self) -> list[TextOut]:
        """Wait for every choice's first output before answering, so that a failed prefill is still a clean 5xx."""
        firsts = await self._guarded(asyncio.gather(*(anext(stream) for stream in self.streams)))
        for timer, out in zip(self.timers, firsts):
            timer.observe(out)
        self._req_ids = [out.req_id for out in firsts]
        failed = [out for out in firsts if out.finish_reason is FinishReason.ERROR]
        if failed:
            for stream in self.streams:
                await stream.aclose()
            raise failure(failed[0])
        return firsts

    async def outputs(self, firsts: list[TextOut]) -> AsyncIterator[tuple[int, TextOut]]:
        """(choice index, output) from `firsts` on, up to every choice's last, in the order they
        come. Cancelled or closed early: the client left, and every choice is aborted."""
        if len(self.streams) == 1:
            async for out in self._choice_outputs(0, firsts[0]):
                yield 0, out
            return
        merged: asyncio.Queue = asyncio.Queue()
        self._merged = merged

        async def pump(i: int) -> None:
            async for out in self._choice_outputs(i, firsts[i]):
                await merged.put((i, out))

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(self.streams))]
        try:
            for _ in pumps:  # until one last output per choice
                while True:
                    i, out = await merged.get()
                    yield i, out
                    if out.finish_reason is not None:
                        break
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def backlog(self) -> int:
        """Outputs of this request that have come and are not yet taken: while there are some, the
        next event of its stream is already here."""
        merged = self._merged.qsize() if self._merged is not None else 0
        return merged + sum(self._manager.backlog(req_id) for req_id in self._req_ids)

    def event_stream(self, events: AsyncIterator[str]) -> StreamingResponse:
        """The streamed answer: `events` (SSE text), those that are ready together in one write."""
        return StreamingResponse(self._coalesced(events), media_type="text/event-stream")

    async def _coalesced(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Each event as it comes, except while more outputs have already come (a server behind
        its streams: the detokenizer sent several steps' tokens before this stream ran): those
        events go out in one write, one pass through the ASGI stack and one socket write (and
        one read for the client) for the backlog instead of one a token. The bytes are the same."""
        held: list[str] = []
        async with contextlib.aclosing(events):
            async for event in events:
                held.append(event)
                if not self.backlog():
                    yield "".join(held)
                    held.clear()
        if held:
            yield "".join(held)

    async def _choice_outputs(self, i: int, first: TextOut) -> AsyncIterator[TextOut]:
        out, stream, timer = first, self.streams[i], self.timers[i]
        try:
            async with contextlib.aclosing(stream):
                while out.finish_reason is None:
                    yield out
                    out = await anext(stream)
                    timer.observe(out)
        finally:
            if out.finish_reason is None:
                timer.observe_abort()
        yield out

    async def _collect(self, i: int) -> Choice:
        outputs = []
        async with contextlib.aclosing(self.streams[i]):
            async for out in self.streams[i]:
                self.timers[i].observe(out)
                outputs.append(out)
        return Choice(i, "".join(out.text for out in outputs), outputs)

    async def _guarded(self, coro):
        try:
            return await unless_disconnected(self.request, coro)
        except ClientGone:
            for timer in self.timers:
                timer.observe_abort()
            raise
