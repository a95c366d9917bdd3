"""Structured output's grammars compile here, in the HTTP process, before their request reaches the
engine: a costly JSON schema or regex then holds only its own request, never the engine step that
serves every running one.

One grammar compiles at a time, on a thread of its own (xgrammar releases the GIL, so the event loop
goes on) with one xgrammar thread, so that a burst of costly schemas takes one core from the engine
at most. The thread is a daemon: a compile under way does not hold up the server's exit. A request waits --grammar_compile_timeout seconds for its grammar, then gets 400; the
compile goes on, and its result is kept. Compiled grammars are kept by (kind, spec), the most recent
CACHE_SIZE, as xgrammar's serialized form, which the request carries to the model runner.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future

from lightllm.frontend.errors import RequestError
from lightllm.engine.request import SamplingParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 64


class GrammarCache:
    def __init__(self, model_dir: str, model_info: dict, timeout: float):
        self.model_dir, self.model_info, self.timeout = model_dir, model_info, timeout
        self._grammars = None  # engine.grammar.Grammars, used on the compile thread alone
        self._work: queue.SimpleQueue | None = None  # (future, function, args) for the compile thread
        self._ready: Future | None = None  # the compiler's making, once
        self._done: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._running: dict[tuple[str, str], Future] = {}

    async def attach(self, sampling: SamplingParams) -> None:
        """Give `sampling` its compiled grammar, if it has a grammar; RequestError (400) if it does
        not compile, or not within the time bound."""
        if sampling.grammar_kind:
            sampling.compiled_grammar = await self.compiled(sampling.grammar_kind, sampling.grammar)

    async def compiled(self, kind: str, spec: str) -> str:
        key = (kind, spec)
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key]
        loop = asyncio.get_running_loop()
        if self._ready is None:
            self._ready = self._submit(self._compiler)
        await asyncio.wrap_future(self._ready)  # once per process (the tokenizer's view), not counted in the bound
        future = self._running.get(key)
        if future is None:
            future = self._running[key] = self._submit(self._serialize, kind, spec)
            future.add_done_callback(lambda done: loop.call_soon_threadsafe(self._finished, key, done))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout)
        except TimeoutError:
            raise RequestError(f"the {kind.replace('_', ' ')} did not compile within {self.timeout:g} s "
                               "(--grammar_compile_timeout); a simpler one may") from None

    def _submit(self, fn, *args) -> Future:
        if self._work is None:
            self._work = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._work,), name="grammar", daemon=True).start()
        future = Future()
        self._work.put((future, fn, args))
        return future

    @staticmethod
    def _serve(work: queue.SimpleQueue) -> None:
        while (item := work.get()) is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the awaiting request
                    future.set_exception(exc)

    def _compiler(self) -> None:
        from lightllm.engine.grammar import Grammars  # xgrammar: only once a request needs it

        self._grammars = Grammars(self.model_dir, self.model_info["vocab_size"],
                                  stop_token_ids=list(self.model_info["eos_token_ids"]), max_threads=1)
        self._grammars.compiler

    def _serialize(self, kind: str, spec: str) -> str:
        from lightllm.engine.grammar import GrammarError

        try:
            return self._grammars.serialize(kind, spec)
        except (GrammarError, RuntimeError) as exc:  # RuntimeError: xgrammar's compile refusing the grammar
            raise RequestError(f"the {kind.replace('_', ' ')} cannot be used for structured output: {exc}") from None

    def _finished(self, key: tuple[str, str], future: Future) -> None:
        del self._running[key]
        if future.exception() is None:
            self._done[key] = future.result()
            while len(self._done) > CACHE_SIZE:
                self._done.popitem(last=False)

    def close(self) -> None:
        if self._work is not None:
            self._work.put(None)
