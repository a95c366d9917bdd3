"""Prometheus text exposition (format 0.0.4), written by hand: counters, histograms, gauges."""

from __future__ import annotations

import bisect
import time
from collections import Counter

from lightllm.server.io_struct import FinishReason, RouterStats, TextOut

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets=LATENCY_BUCKETS):
        self.name, self.help_text, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.total}", f"{self.name}_count {cumulative}"]
        return lines


def _metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    return lines + [f"{name}{labels} {value}" for labels, value in samples]


class Metrics:
    def __init__(self, max_total_token_num: int):
        self.finished = Counter({reason: 0 for reason in FinishReason})
        self.rejected = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.time_to_first_token = Histogram(
            "lightllm_time_to_first_token_seconds", "Time from request arrival to its first token."
        )
        self.e2e_latency = Histogram(
            "lightllm_e2e_request_latency_seconds", "Time from request arrival to its last token."
        )
        self.router = RouterStats(0, 0, 0, max_total_token_num)

    def observe_finished(self, reason: FinishReason, prompt_tokens: int, output_tokens: int, latency: float) -> None:
        self.finished[reason] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += output_tokens
        self.e2e_latency.observe(latency)

    def render(self) -> str:
        stats = self.router
        by_reason = [(f'{{finish_reason="{reason.value}"}}', count) for reason, count in self.finished.items()]
        lines = _metric("lightllm_requests_total", "counter", "Finished requests by finish reason.", by_reason)
        lines += _metric("lightllm_requests_rejected_total", "counter", "Requests refused as invalid (4xx).", [("", self.rejected)])
        lines += _metric("lightllm_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", self.prompt_tokens)])
        lines += _metric("lightllm_generation_tokens_total", "counter", "Generated tokens of finished requests.", [("", self.generation_tokens)])
        lines += self.time_to_first_token.render() + self.e2e_latency.render()
        lines += _metric("lightllm_queue_size", "gauge", "Requests waiting for admission.", [("", stats.waiting_reqs)])
        lines += _metric("lightllm_running_requests", "gauge", "Requests in the running batch.", [("", stats.running_reqs)])
        lines += _metric("lightllm_kv_tokens_used", "gauge", "KV cache tokens running requests use (their own and cached ones they share).",
                         [("", stats.tokens_used)])
        lines += _metric("lightllm_kv_tokens_total", "gauge", "KV cache budget (max_total_token_num).", [("", stats.max_total_token_num)])
        ratio = stats.tokens_used / stats.max_total_token_num
        lines += _metric("lightllm_kv_tokens_used_ratio", "gauge", "KV cache tokens in use / budget.", [("", ratio)])
        lines += _metric("lightllm_prefix_cache_tokens", "gauge",
                         "KV cache tokens the prefix cache holds (not in use: evicted when room is needed).",
                         [("", stats.prefix_cached_tokens)])
        lines += _metric("lightllm_prefix_cache_queries_tokens_total", "counter",
                         "Prompt tokens looked up in the prefix cache.", [("", stats.prefix_queried_tokens)])
        lines += _metric("lightllm_prefix_cache_hits_tokens_total", "counter",
                         "Prompt tokens found in the prefix cache (not computed).", [("", stats.prefix_hit_tokens)])
        return "\n".join(lines) + "\n"


class RequestTimer:
    """Time to first token and end-to-end latency, from arrival at the HTTP server."""

    def __init__(self, metrics: Metrics, prompt_len: int, start: float):
        self.metrics, self.prompt_len, self.start = metrics, prompt_len, start
        self.first_token_seen = False
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied (told with the first token)

    def observe(self, out: TextOut) -> None:
        now = time.monotonic()
        if not self.first_token_seen:
            self.first_token_seen = True
            self.cached_tokens = out.cached_tokens
            self.metrics.time_to_first_token.observe(now - self.start)
        if out.finish_reason is not None:
            self.metrics.observe_finished(out.finish_reason, self.prompt_len, out.count_output_tokens, now - self.start)

    def observe_abort(self) -> None:
        self.metrics.finished[FinishReason.ABORT] += 1
