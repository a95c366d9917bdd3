"""Structured output's grammars compile here, on the HTTP side, before their request reaches the
engine: a costly JSON schema or regex then holds only its own request, never the engine step that
serves every running one.

One grammar compiles at a time, in a child process with one xgrammar thread (grammar_worker.py), so
that a burst of costly schemas takes one core from the engine at most; a thread of this process
drives it (the event loop goes on). A request waits --grammar_compile_timeout seconds for its
grammar, then gets 400, and the compile is killed when no request waits for it any longer: its core
and its memory come back. A compile that needs more than COMPILE_MEMORY_BYTES is killed too, and a
compiled grammar longer than MAX_COMPILED_BYTES is refused (both 400). The child starts at the first
grammar (not counted in the time bound) and again after each kill. Compiled grammars are kept by
(kind, spec) as xgrammar's serialized form, which the request carries to the model runner: the most
recent CACHE_SIZE, and CACHE_BYTES at most.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from lightllm.engine.request import SamplingParams
from lightllm.frontend.errors import RequestError
from lightllm.server.httpserver.grammar_worker import COMPILE_MEMORY_BYTES, CompileStopped, CompileWorker

logger = logging.getLogger(__name__)

CACHE_SIZE = 64
CACHE_BYTES = 64 << 20  # specs and packed grammars together


@dataclass
class Job:
    kind: str
    grammar: str
    deadline: float  # time.monotonic(): the last of its waiting requests' (a later one extends it)
    future: Future = field(default_factory=Future)


class GrammarCache:
    def __init__(self, tokenizer, model_info: dict, timeout: float, log_level: str = "info"):
        self.timeout = timeout
        self._worker = CompileWorker(tokenizer, model_info["vocab_size"], list(model_info["eos_token_ids"]), log_level)
        self._work: queue.SimpleQueue | None = None  # Jobs for the driving thread; None stops it
        self._ready: Future | None = None  # the child's first start
        self._closing = False
        self._done: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._done_bytes = 0
        self._running: dict[tuple[str, str], Job] = {}

    async def attach(self, sampling: SamplingParams) -> None:
        """Give `sampling` its compiled grammar, if it has a grammar; RequestError (400) if it does
        not compile, or not within the time bound."""
        if sampling.grammar_kind:
            sampling.compiled_grammar = await self.compiled(sampling.grammar_kind, sampling.grammar)

    async def compiled(self, kind: str, spec: str) -> bytes:
        key = (kind, spec)
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key]
        if self._ready is None:
            self._ready = self._submit(Job("", "", 0.0)).future
        await asyncio.wrap_future(self._ready)  # once per process, not counted in the bound
        deadline = time.monotonic() + self.timeout
        job = self._running.get(key)
        if job is None:
            job = self._running[key] = self._submit(Job(kind, spec, deadline))
            loop = asyncio.get_running_loop()
            job.future.add_done_callback(lambda done: loop.call_soon_threadsafe(self._finished, key, done))
        job.deadline = max(job.deadline, deadline)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.future)), self.timeout)
        except TimeoutError:
            raise self._late(kind) from None

    def _late(self, kind: str) -> RequestError:
        return RequestError(f"the {kind.replace('_', ' ')} did not compile within {self.timeout:g} s "
                            "(--grammar_compile_timeout); a simpler one may")

    def prepare(self) -> None:
        """Start the driving thread, which first builds what compiles need in this process (a server
        calls it as it starts; the compiler child itself starts at the first grammar)."""
        self._queue()

    def _submit(self, job: Job) -> Job:
        self._queue().put(job)
        return job

    def _queue(self) -> queue.SimpleQueue:
        if self._work is None:
            self._work = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._work,), name="grammar", daemon=True).start()
        return self._work

    def _serve(self, work: queue.SimpleQueue) -> None:
        started = time.monotonic()
        try:
            self._worker.prepare()
            logger.info("structured output ready in %.1f s", time.monotonic() - started)
        except Exception as exc:  # the first grammar tries again, and its request gets the error
            logger.warning("structured output not prepared (%s); the first grammar tries again", exc)
        while (job := work.get()) is not None:
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(self._run(job))
                except BaseException as exc:  # handed to the awaiting requests
                    job.future.set_exception(exc)
            if self._worker.pid is None and not self._closing:  # killed: ready again before the next job
                self._start_worker()

    def _run(self, job: Job) -> bytes | None:
        if not job.kind:
            self._worker.start()
            return None
        if time.monotonic() > job.deadline:  # its requests gave up while it queued
            raise self._late(job.kind)
        try:
            return self._worker.compile(job.kind, job.grammar, lambda: job.deadline)
        except CompileStopped as stopped:
            if not stopped.memory:
                raise self._late(job.kind) from None
            raise RequestError(f"the {job.kind.replace('_', ' ')} needed more than "
                               f"{COMPILE_MEMORY_BYTES / 2**20:g} MiB to compile; a simpler one may") from None

    def _start_worker(self) -> None:
        try:
            self._worker.start()
        except Exception:  # the next job tries again, and its request gets the error
            logger.exception("the grammar compiler did not start again")

    def _finished(self, key: tuple[str, str], future: Future) -> None:
        del self._running[key]
        if future.exception() is None:
            self._done[key] = future.result()
            self._done_bytes += entry_bytes(key, self._done[key])
            while len(self._done) > CACHE_SIZE or self._done_bytes > CACHE_BYTES:
                self._done_bytes -= entry_bytes(*self._done.popitem(last=False))

    @property
    def cached_bytes(self) -> int:
        return self._done_bytes

    def close(self) -> None:
        self._closing = True
        if self._work is not None:
            self._work.put(None)
        self._worker.kill()


def entry_bytes(key: tuple[str, str], serialized: bytes) -> int:
    return len(key[1]) + len(serialized)
