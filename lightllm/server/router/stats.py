"""The router's periodic throughput log. It only runs after activity, so an idle router sleeps."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class ThroughputLog:
    def __init__(self, interval: float):
        self._interval = interval
        self._window_start: float | None = None  # None: nothing happened since the last log
        self._prompt_tokens = 0
        self._generated_tokens = 0

    def count(self, prompt_tokens: int, generated_tokens: int) -> None:
        if self._window_start is None:
            self._window_start = time.monotonic()
        self._prompt_tokens += prompt_tokens
        self._generated_tokens += generated_tokens

    def seconds_until_due(self) -> float | None:
        if self._window_start is None:
            return None
        return max(0.0, self._window_start + self._interval - time.monotonic())

    def maybe_log(self, running: int, waiting: int, tokens_used: int, max_total_token_num: int) -> None:
        due = self.seconds_until_due()
        if due is None or due > 0:
            return
        elapsed = time.monotonic() - self._window_start
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV tokens %d/%d (%.1f%%)",
            self._prompt_tokens / elapsed,
            self._generated_tokens / elapsed,
            running,
            waiting,
            tokens_used,
            max_total_token_num,
            100.0 * tokens_used / max_total_token_num,
        )
        self._window_start, self._prompt_tokens, self._generated_tokens = None, 0, 0
