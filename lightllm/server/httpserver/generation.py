"""One request's life on the HTTP side, shared by every endpoint that generates text.

`Generation` submits the token ids, times the request for /metrics, and hands back either the
whole text or its outputs one by one. A client that disconnects aborts its request (the router
frees its KV tokens); a request that fails in the engine raises GenerationFailed (a 5xx).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Request

from lightllm.server.httpserver.metrics import RequestTimer
from lightllm.server.httpserver.params import check_lengths
from lightllm.server.io_struct import FinishReason, SamplingParams, TextOut


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class GenerationFailed(Exception):
    """The engine failed this request; the message says why."""


async def tokenize(fn, *args):
    """Tokenization (and chat templates) off the event loop: a long prompt must not stall
    other requests or /health. asyncio's default thread pool is sized for the machine."""
    return await asyncio.to_thread(fn, *args)


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


class Generation:
    """A submitted request: its output stream and its timer. `start` is the request's arrival."""

    def __init__(self, request: Request, prompt_ids: list[int], sampling: SamplingParams, start: float):
        state = request.app.state.server
        check_lengths(len(prompt_ids), sampling, state.limits)
        self.request = request
        self.prompt_len = len(prompt_ids)
        self.timer = RequestTimer(state.metrics, self.prompt_len, start)
        self.stream = state.manager.generate(prompt_ids, sampling)

    async def result(self) -> tuple[str, TextOut]:
        """The whole text and the last output."""
        text, last = await self._guarded(self._collect())
        if last.finish_reason is FinishReason.ERROR:
            raise GenerationFailed(last.error)
        return text, last

    async def first(self) -> TextOut:
        """Wait for the first output before answering, so that a failed prefill is still a clean 5xx."""
        first = await self._guarded(anext(self.stream))
        self.timer.observe(first)
        if first.finish_reason is FinishReason.ERROR:
            await self.stream.aclose()
            raise GenerationFailed(first.error)
        return first

    async def outputs(self, first: TextOut) -> AsyncIterator[TextOut]:
        """`first` and every later output up to the last. Cancelled or closed early: the client left."""
        out = first
        try:
            async with contextlib.aclosing(self.stream):
                while out.finish_reason is None:
                    yield out
                    out = await anext(self.stream)
                    self.timer.observe(out)
        finally:
            if out.finish_reason is None:
                self.timer.observe_abort()
        yield out

    async def _collect(self) -> tuple[str, TextOut]:
        pieces = []
        async with contextlib.aclosing(self.stream):
            async for out in self.stream:
                self.timer.observe(out)
                pieces.append(out.text)
        return "".join(pieces), out

    async def _guarded(self, coro):
        try:
            return await unless_disconnected(self.request, coro)
        except ClientGone:
            self.timer.observe_abort()
            raise
