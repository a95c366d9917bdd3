"""The process that compiles grammars for the HTTP process, so that a compile can be stopped.

xgrammar's compile cannot be interrupted from Python, and a costly one holds gigabytes while it
runs (1000 forced tools: 11 GB). Here it runs in a child process (spawned, one compile at a time,
one xgrammar thread) that is killed when the compile runs past its deadline or its RSS grows past
COMPILE_MEMORY_BYTES, and then started again: the core and the memory come back at once. The child
sends back xgrammar's serialized form (a string), refused when longer than MAX_COMPILED_BYTES, the
bound that keeps reading it back in the model runner cheap (engine/grammar.py).

`CompileWorker` is driven from one thread of the HTTP process (grammar_cache.py); its calls block.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from lightllm.frontend.errors import RequestError
from lightllm.utils.process import init_child_process, start_signals_blocked

logger = logging.getLogger(__name__)

# Above its RSS when ready: a compile that needs more is killed (and its request gets 400); one that
# left more behind (the allocator keeps freed pages) restarts the child after it, to give them back.
COMPILE_MEMORY_BYTES = 1 << 30
KEPT_MEMORY_BYTES = 128 << 20
# The longest serialized grammar accepted: the model runner reads it back inside a step (engine/grammar.py)
MAX_COMPILED_BYTES = 16 << 20
# Below the engine's processes: on a machine of few cores a compile takes what the steps leave.
COMPILER_NICENESS = 10
POLL_S = 0.05  # how often a compile's deadline and memory are checked
START_TIMEOUT_S = 300.0  # loading the tokenizer and xgrammar's view of it


class CompileStopped(Exception):
    """The compile was killed: past its deadline (`memory` False) or its memory bound."""

    def __init__(self, memory: bool):
        super().__init__("memory" if memory else "deadline")
        self.memory = memory


@dataclass(frozen=True)
class CompilerSpec:
    """What the child needs to build the compiler: the model's tokenizer and vocabulary."""

    model_dir: str
    vocab_size: int
    stop_token_ids: list[int]
    parent_pid: int
    log_level: str


def serve(spec: CompilerSpec, conn) -> None:
    """The child's entry: build the compiler, say ready, then answer (kind, grammar) with
    ("ok", serialized) or ("error", message) until the pipe closes."""
    init_child_process(spec.parent_pid, spec.log_level)
    os.setpriority(os.PRIO_PROCESS, 0, COMPILER_NICENESS)
    from lightllm.engine.grammar import Grammars

    grammars = Grammars(spec.model_dir, spec.vocab_size, stop_token_ids=spec.stop_token_ids, max_threads=1)
    grammars.compiler
    conn.send(("ready", ""))
    while True:
        try:
            kind, grammar = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", checked_size(grammars.serialize(kind, grammar))))
        except Exception as exc:  # GrammarError, or xgrammar's compile refusing the grammar (RuntimeError)
            conn.send(("error", str(exc)))


def checked_size(serialized: str) -> str:
    from lightllm.engine.grammar import GrammarError

    if len(serialized) > MAX_COMPILED_BYTES:
        raise GrammarError(f"compiled, it takes {len(serialized) / 2**20:.1f} MiB, more than the "
                           f"{MAX_COMPILED_BYTES / 2**20:g} MiB a grammar may (a smaller schema or fewer tools may fit)")
    return serialized


class CompileWorker:
    """The child process, started on first use and again after each kill."""

    def __init__(self, spec: CompilerSpec):
        self.spec = spec
        self._process = None
        self._conn = None
        self._ps: psutil.Process | None = None
        self._ready_rss = 0

    def start(self) -> None:
        if self._process is not None:
            return
        started = time.monotonic()
        # Linux keeps a priority per thread, and a child inherits its starter's: so lowered, the
        # child's imports at start take what the engine leaves, as its compiles do.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILER_NICENESS)
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(target=serve, args=(self.spec, theirs), name="grammar compiler", daemon=True)
        with start_signals_blocked():
            self._process.start()
        theirs.close()
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise EOFError
            self._conn.recv()
        except EOFError:
            self.stop()
            raise RuntimeError(f"the grammar compiler did not start within {START_TIMEOUT_S:g} s; see the log") from None
        self._ps = psutil.Process(self._process.pid)
        self._ready_rss = self._rss()
        logger.info("grammar compiler (pid %d) ready in %.1f s, RSS %.0f MB", self._process.pid,
                    time.monotonic() - started, self._ready_rss / 1e6)

    def compile(self, kind: str, grammar: str, deadline: Callable[[], float]) -> str:
        """The serialized compiled grammar; CompileStopped when the compile was killed, past
        `deadline()` (a time.monotonic value, read as the compile goes) or its memory bound;
        RequestError when xgrammar refuses the grammar."""
        self.start()
        self._conn.send((kind, grammar))
        while not self._conn.poll(POLL_S):
            over_memory = self._rss() > self._ready_rss + COMPILE_MEMORY_BYTES
            if over_memory or time.monotonic() > deadline():
                self.stop()
                raise CompileStopped(over_memory)
        try:
            status, value = self._conn.recv()
        except EOFError:  # the child died (the kernel's OOM killer, for one)
            self.stop()
            raise CompileStopped(True) from None
        if self._rss() > self._ready_rss + KEPT_MEMORY_BYTES:
            self.stop()
        if status == "error":
            raise RequestError(f"the {kind.replace('_', ' ')} cannot be used for structured output: {value}")
        return value

    def _rss(self) -> int:
        try:
            return self._ps.memory_info().rss
        except psutil.Error:
            return 0

    def stop(self) -> None:
        """Kill the child (its compile, if one runs, with it); the next compile starts another."""
        if self._process is None:
            return
        self._conn.close()
        self._process.kill()
        self._process.join()
        self._process = self._conn = None

    def kill(self) -> None:
        """Kill the child from any thread (as the server stops); the driving thread then finds it gone."""
        process = self._process
        if process is not None:
            process.kill()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid
