"""The process that compiles grammars for the HTTP process, so that a compile can be stopped.

xgrammar's compile cannot be interrupted from Python, and a costly one holds gigabytes while it
runs (1000 forced tools: 11 GB). Here it runs in a child process (spawned at the first grammar,
one compile at a time, one xgrammar thread) that is killed when the compile runs past its deadline
or its RSS grows past COMPILE_MEMORY_BYTES, and then started again: the core and the memory come
back at once. The child sends back xgrammar's serialized form, packed (zlib), refused when longer than
MAX_COMPILED_BYTES, the bound that keeps the model runner's read of it short (engine/grammar.py).

The child parses each grammar too (engine.grammar.parse_grammar): a parse's cost grows faster than
its spec (a 59 KB chain of 1,700 $refs took 5.4 s of a 2-core CPU), so it runs under the same bounds
as the compile, not in this process, where it held a thread and a core, twice, outside them.

The child is kept small (about 100 MB, against 465 MB when it loaded the tokenizer and all of
xgrammar): this process turns the tokenizer into xgrammar's view of it once (TokenizerInfo, as
JSON), and the child imports only xgrammar's compiler and grammar, without the torch that
xgrammar's package imports.

`CompileWorker` is driven from one thread of the HTTP process (grammar_cache.py); its calls block.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from lightllm.frontend.errors import RequestError
from lightllm.utils.process import init_child_process, return_free_heap, start_signals_blocked

logger = logging.getLogger(__name__)

# Above its RSS when ready: a compile that needs more is killed (and its request gets 400). After each
# compile the child gives the allocator's free pages back (malloc_trim); one that still holds more than
# KEPT_MEMORY_BYTES (xgrammar's own caches, or pages the trim cannot reach) restarts the child after
# it. A 700-$ref chain left 68 MB behind without the trim.
# A compile takes about 15 MB a MiB of its serialized form (2026-12-02: a chain of 600 $refs, 7.6 MiB,
# +109 MB; of 800, 13.5 MiB, +213 MB), and a server process may grow by 200 MB at most: grammars
# near MAX_COMPILED_BYTES are refused for their memory first. Schemas a client means compile to
# well under 1 MiB (128 forced tools: 0.2 MiB, +1 MB).
COMPILE_MEMORY_BYTES = 180 << 20
KEPT_MEMORY_BYTES = 16 << 20
# The longest serialized grammar accepted: the model runner reads it back, off the step but on a core (engine/grammar.py)
MAX_COMPILED_BYTES = 16 << 20
# Below the engine's processes: on a machine of few cores a compile takes what the steps leave.
COMPILER_NICENESS = 10
# How often a compile's deadline and memory are checked: a compile's RSS may grow by 1.6 GB/s (a
# $ref chain on a 2-core CPU), so a check every 10 ms lets it pass COMPILE_MEMORY_BYTES by 16 MB or so.
POLL_S = 0.01
START_TIMEOUT_S = 300.0  # importing xgrammar and reading the tokenizer's view


class CompileStopped(Exception):
    """The compile was killed: past its deadline (`memory` False) or its memory bound."""

    def __init__(self, memory: bool):
        super().__init__("memory" if memory else "deadline")
        self.memory = memory


@dataclass(frozen=True)
class CompilerSpec:
    """What the child needs to build the compiler."""

    tokenizer_info: str  # xgrammar.TokenizerInfo.serialize_json() of the model's tokenizer (1.6 MB for SmolLM2)
    parent_pid: int
    log_level: str


def tokenizer_info_json(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> str:
    """xgrammar's view of `tokenizer` (the HTTP process's, loaded as the model runner loads its own),
    as JSON: `vocab_size` is the model's (the logits' width)."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    return info.serialize_json()


def import_compiler():
    """xgrammar's GrammarCompiler and TokenizerInfo, and its Grammar as the package's attribute (what
    engine.grammar.parse_grammar reads), without running the package's __init__: that imports torch
    (for its token-mask kernels and its tests), about 230 MB of this process's RSS, and the compiler
    needs none of it."""
    sys.modules["torch"] = None  # `import torch` raises ImportError: tvm_ffi and transformers go on without it
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # transformers would say so in the log
    sys.modules["xgrammar"] = importlib.util.module_from_spec(importlib.util.find_spec("xgrammar"))
    from xgrammar import exception, load_binding  # noqa: F401  (its error types, then its C++ library's)
    from xgrammar.compiler import GrammarCompiler
    from xgrammar.grammar import Grammar
    from xgrammar.tokenizer_info import TokenizerInfo

    sys.modules["xgrammar"].Grammar = Grammar  # what engine.grammar.parse_grammar reads
    return GrammarCompiler, TokenizerInfo


def serve(spec: CompilerSpec, conn) -> None:
    """The child's entry: build the compiler, say ready, then answer each (kind, grammar) with
    ("ok", serialized) or ("error", message) until the pipe closes."""
    init_child_process(spec.parent_pid, spec.log_level)
    os.setpriority(os.PRIO_PROCESS, 0, COMPILER_NICENESS)
    compiler_class, info_class = import_compiler()
    from lightllm.engine.grammar import pack, parse_grammar
    # our LRU is the cache (grammar_cache.py): xgrammar's own would keep a second copy of each grammar
    compiler = compiler_class(info_class.deserialize_json(spec.tokenizer_info), max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            kind, grammar = conn.recv()
        except EOFError:
            return
        try:
            serialized = checked_size(compiler.compile_grammar(parse_grammar(kind, grammar)).serialize_json())
            reply = ("ok", pack(serialized))
        except Exception as exc:  # the grammar refused (GrammarError), xgrammar's compile's error, or its size
            reply = ("error", str(exc))
        serialized = None
        return_free_heap()  # before the answer: the parent reads the RSS it leaves
        conn.send(reply)


def checked_size(serialized: str) -> str:
    if len(serialized) > MAX_COMPILED_BYTES:
        raise ValueError(f"compiled, it takes {len(serialized) / 2**20:.1f} MiB, more than the "
                         f"{MAX_COMPILED_BYTES / 2**20:g} MiB a grammar may (a smaller schema or fewer tools may fit)")
    return serialized


class CompileWorker:
    """The child process, started on first use and again after each kill."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], log_level: str):
        self._tokenizer = (tokenizer, vocab_size, stop_token_ids)
        self._log_level = log_level
        self.spec: CompilerSpec | None = None  # made at the first start, kept for the restarts
        self._process = None
        self._conn = None
        self._ps: psutil.Process | None = None
        self._ready_rss = 0

    def prepare(self) -> None:
        """Build what the child needs from this process (xgrammar's import, the tokenizer's view): a
        second or more of Python holding this process's GIL, which at a server's first grammar
        stalled the event loop, so the server does it as it starts (grammar_cache.py)."""
        if self.spec is None:
            self.spec = CompilerSpec(tokenizer_info_json(*self._tokenizer), os.getpid(), self._log_level)

    def start(self) -> None:
        if self._process is not None:
            return
        started = time.monotonic()
        self.prepare()
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

    def compile(self, kind: str, grammar: str, deadline: Callable[[], float]) -> bytes:
        """The compiled grammar, packed (engine/grammar.py's `pack`); CompileStopped when the compile was killed, past
        `deadline()` (a time.monotonic value, read as the compile goes) or its memory bound;
        RequestError when the grammar is refused (its parse, its compile or its size)."""
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
