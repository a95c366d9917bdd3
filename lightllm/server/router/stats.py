"""The router's periodic throughput log. It only runs after activity, so an idle router sleeps."""

from __future__ import annotations

import logging
import time

from lightllm.server.io_struct import RouterStats

logger = logging.getLogger(__name__)


class ThroughputLog:
    def __init__(self, interval: float):
        self._interval = interval
        self._window_start: float | None = None  # None: nothing happened since the last log
        self._generated_tokens = 0
        # Counters at the last log: prompt tokens computed, and those looked up in and found in the
        # prefix cache. The prompt rate is what the steps computed, not what arrived.
        self._prompt = 0
        self._prefix = (0, 0)

    def count(self, generated_tokens: int) -> None:
        """Activity (a request arrived, or a step gave tokens): it opens a window if none is open."""
        if self._window_start is None:
            self._window_start = time.monotonic()
        self._generated_tokens += generated_tokens

    def seconds_until_due(self) -> float | None:
        if self._window_start is None:
            return None
        return max(0.0, self._window_start + self._interval - time.monotonic())

    def maybe_log(self, stats: RouterStats) -> None:
        due = self.seconds_until_due()
        if due is None or due > 0:
            return
        elapsed = time.monotonic() - self._window_start
        queried = stats.prefix_queried_tokens - self._prefix[0]
        hits = stats.prefix_hit_tokens - self._prefix[1]
        computed = stats.prompt_computed_tokens - self._prompt
        self._prefix = (stats.prefix_queried_tokens, stats.prefix_hit_tokens)
        self._prompt = stats.prompt_computed_tokens
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV tokens %d/%d (%.1f%%), "
            "prefix cache %d tokens, hit rate %.1f%%",
            computed / elapsed,
            self._generated_tokens / elapsed,
            stats.running_reqs,
            stats.waiting_reqs,
            stats.tokens_used,
            stats.max_total_token_num,
            100.0 * stats.tokens_used / stats.max_total_token_num,
            stats.prefix_cached_tokens,
            100.0 * hits / queried if queried else 0.0,
        )
        self._window_start, self._generated_tokens = None, 0
