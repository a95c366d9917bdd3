"""Prompt text -> token ids for the HTTP process: one thread that encodes, a batch at a time,
every prompt waiting when it starts.

Why not one thread-pool hop per prompt: a fast (Rust) tokenizer lets go of the GIL while it
encodes and must take it back after, and a busy event loop holds it for up to the interpreter's
switch interval (5 ms) at a time. With a thread a prompt, a burst of requests made each encode
cost that wait: 2000 ShareGPT prompts (0.65 ms each alone) took seconds to reach the router,
with the GPUs idle meanwhile (docs/architecture.md, "A burst's first second", under Processes).
Encoding the prompts waiting together pays the wait once a batch, and the tokenizer's batch
call (Rust, parallel where TOKENIZERS_PARALLELISM allows) encodes them faster than one by one.
One thread also means the tokenizer is never used by two threads at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

# Most prompts in one batch call: the first of a burst reach the router after one batch's time,
# not after the whole burst's (2000 ShareGPT prompts encode in about 0.6 s on a 2-core CPU).
MAX_BATCH = 64


class PromptEncoder:
    """`await encode(text, add_special_tokens)` gives `tokenizer.encode(text, add_special_tokens=...)`,
    computed on the encoder's thread (started at the first call)."""

    def __init__(self, tokenizer, max_batch: int = MAX_BATCH):
        self._tokenizer = tokenizer
        self._max_batch = max_batch
        # A fast tokenizer encodes a list in one call; any other is called once a prompt (same thread).
        self._batched = bool(getattr(tokenizer, "is_fast", False))
        self._waiting: deque[tuple[str, bool, asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._wake:
            self._waiting.append((text, add_special_tokens, future, loop))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prompt-encoder", daemon=True)
                self._thread.start()
            self._wake.notify()
        return await future

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._waiting:
                    self._wake.wait()
                batch = [self._waiting.popleft() for _ in range(min(self._max_batch, len(self._waiting)))]
            for flag in (True, False):
                same = [item for item in batch if item[1] is flag]
                if same:
                    self._encode(same, flag)

    def _encode(self, items: list, add_special_tokens: bool) -> None:
        texts = [text for text, _, _, _ in items]
        results: list = []
        if self._batched and len(texts) > 1:
            try:
                results = self._tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
            except Exception:  # one bad prompt: each gets its own answer below
                results = []
        if len(results) != len(texts):
            results = [self._one(text, add_special_tokens) for text in texts]
        for (_, _, future, loop), result in zip(items, results):
            try:
                loop.call_soon_threadsafe(_settle, future, result)
            except RuntimeError:  # that event loop has closed: nobody waits for the answer
                pass

    def _one(self, text: str, add_special_tokens: bool):
        try:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:
            return exc


def _settle(future: asyncio.Future, result) -> None:
    if future.done():  # cancelled: its request has gone
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(list(result))
