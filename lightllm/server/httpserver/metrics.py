"""/metrics through prometheus_client, under vLLM's family names with `lightllm:` in place of
`vllm:` and no `model_name` label (a vLLM dashboard needs relabelling: docs/api.md, which lists
every family).

Each app has a registry of its own (tests run several apps in one process). The HTTP process
counts requests and times them (RequestTimer); the router's figures arrive as RouterStats
messages, kept as they come and turned into samples only when /metrics is read.
"""

from __future__ import annotations

import functools
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from lightllm.engine.request import FinishReason
from lightllm.frontend.lora import LoraNames
from lightllm.server.io_struct import RouterStats, TextOut

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the format generate_latest writes
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# A decode step: about 10 ms on a GPU, up to seconds on a CPU or behind a long prefill chunk.
TOKEN_INTERVAL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                          0.75, 1.0, 2.5, 5.0, 10.0)


def length_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's buckets for per-request token counts)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_len:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class Metrics:
    """The families the HTTP process writes itself; `routers` holds each replica's (--dp) last
    report, sized by the KV budget each reported at start (`capacities`), and `reported` when the
    last came (Unix time). `loras`: the adapters' names, where the server serves LoRA adapters;
    `max_len`: the longest request (prompt and output), for the token counts' buckets."""

    def __init__(self, capacities: list[int], loras: LoraNames | None = None, max_len: int = 1 << 20):
        self.registry = registry = CollectorRegistry()
        self.routers = [RouterStats(0, 0, 0, capacity, replica=d) for d, capacity in enumerate(capacities)]
        self.reported = time.time()
        self.loras = loras if loras is not None and loras.slots else None
        self.routed = Counter("lightllm:replica_requests_routed", "Requests sent to each engine replica (--dp).",
                              ["replica"], registry=registry)
        for d in range(len(capacities)):
            self.routed.labels(str(d))
        self.request_success = Counter("lightllm:request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"], registry=registry)
        for reason in FinishReason:  # every reason from the start, at 0
            self.request_success.labels(reason.value)
        self.rejected = Counter("lightllm:requests_rejected", "Requests refused as invalid (4xx).", registry=registry)
        self.queue_full = Counter("lightllm:requests_queue_full",
                                  "Requests refused with 429 because --max_queued_requests were queued.", registry=registry)
        self.health_probes_waiting = Gauge(
            "lightllm:health_probes_waiting",
            "GET /health?generate=1 probes waiting for the one probe generation (one runs at a time; they share it).",
            registry=registry)
        self.queued = Gauge("lightllm:num_requests_queued",
                            "Open requests without their first token yet (the count --max_queued_requests bounds).",
                            registry=registry)
        self.prompt_tokens = Counter("lightllm:prompt_tokens", "Prompt tokens, counted at each request's first token.",
                                     registry=registry)
        self.generation_tokens = Counter("lightllm:generation_tokens", "Generated tokens, counted as they arrive.",
                                         registry=registry)
        latency = functools.partial(Histogram, buckets=LATENCY_BUCKETS, registry=registry)
        lengths = functools.partial(Histogram, buckets=length_buckets(max_len), registry=registry)
        self.time_to_first_token = latency("lightllm:time_to_first_token_seconds",
                                           "Time from arrival at the HTTP server to the first token.")
        self.time_per_output_token = Histogram("lightllm:time_per_output_token_seconds",
                                               "Time between two consecutive tokens of a request.",
                                               buckets=TOKEN_INTERVAL_BUCKETS, registry=registry)
        self.e2e_latency = latency("lightllm:e2e_request_latency_seconds",
                                   "Time from arrival at the HTTP server to the last token (not for aborted requests).")
        self.queue_time = latency("lightllm:request_queue_time_seconds",
                                  "Time from the hand-off to the router to the scheduling of the prompt's first chunk.")
        # Per finished request (not aborted ones), as vLLM's families of these names.
        self.request_prompt_tokens = lengths("lightllm:request_prompt_tokens", "Prompt tokens of a finished request.")
        self.request_generation_tokens = lengths("lightllm:request_generation_tokens",
                                                 "Generated tokens of a finished request.")
        self.prefill_time = latency("lightllm:request_prefill_time_seconds",
                                    "Time from the scheduling of a finished request's first chunk to its first token.")
        self.decode_time = latency("lightllm:request_decode_time_seconds",
                                   "Time from a finished request's first token to its last.")
        self.inference_time = latency("lightllm:request_inference_time_seconds",
                                      "Time from the scheduling of a finished request's first chunk to its last token.")
        registry.register(RouterCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def report(self, stats: RouterStats) -> None:
        """A router's report: its replica's figures from now on."""
        self.routers[stats.replica] = stats
        self.reported = time.time()


class RouterCollector:
    """The routers' last RouterStats as samples, made when /metrics is read: the families below
    total every replica (--dp); lightllm:replica_* give each one's share."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self):
        routers = self._metrics.routers
        stats = RouterStats(*(sum(getattr(r, name) for r in routers)
                              for name in ("waiting_reqs", "running_reqs", "tokens_used", "max_total_token_num",
                                           "prefix_cached_tokens", "prefix_queried_tokens", "prefix_hit_tokens")))
        yield from self._replicas(routers)
        yield GaugeMetricFamily("lightllm:num_requests_running", "Requests in the running batch.",
                                value=stats.running_reqs)
        yield GaugeMetricFamily("lightllm:num_requests_waiting", "Requests in the router waiting for admission.",
                                value=stats.waiting_reqs)
        yield GaugeMetricFamily("lightllm:kv_cache_usage_perc",
                                "KV cache tokens running requests use / the budget (0..1; prefix-cached tokens no "
                                "request uses count as free).", value=stats.tokens_used / stats.max_total_token_num)
        yield GaugeMetricFamily("lightllm:kv_cache_used_tokens",
                                "KV cache tokens running requests use (their own and the cached ones they share).",
                                value=stats.tokens_used)
        yield GaugeMetricFamily("lightllm:kv_cache_capacity_tokens", "KV cache budget in tokens (max_total_token_num).",
                                value=stats.max_total_token_num)
        yield GaugeMetricFamily("lightllm:prefix_cache_tokens",
                                "KV cache tokens the prefix cache holds (evicted when room is needed).",
                                value=stats.prefix_cached_tokens)
        yield CounterMetricFamily("lightllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=stats.prefix_queried_tokens)
        yield CounterMetricFamily("lightllm:prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache (not computed).", value=stats.prefix_hit_tokens)
        yield CounterMetricFamily("lightllm:num_preemptions", "Running requests preempted for more urgent ones "
                                  "(--schedule_policy priority): each starts again from its outputs so far.",
                                  value=sum(r.num_preemptions for r in routers))
        yield from self._prefix_tiers(routers, stats.prefix_hit_tokens)
        yield from self._speculation(routers)
        yield from self._loras()

    def _loras(self):
        """vLLM's lora_requests_info (where adapters are served): the adapters of running and of
        waiting requests as labels (names, comma-separated), --max_loras, and as its value the time
        of the routers' last report."""
        names = self._metrics.loras
        if names is None:
            return
        routers = self._metrics.routers

        def listed(field: str) -> str:
            return ",".join(sorted({names.name_of(i) for r in routers for i in getattr(r, field)}))

        info = GaugeMetricFamily("lightllm:lora_requests_info",
                                 "LoRA adapters in use: the running and the waiting requests' (labels); the value "
                                 "is when the router last reported (Unix time).",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        info.add_metric([str(names.slots), listed("lora_waiting"), listed("lora_running")], self._metrics.reported)
        yield info

    @staticmethod
    def _speculation(routers: list[RouterStats]):
        """vLLM's spec_decode_* counters, under our prefix (absent without speculative decoding)."""
        if not any(r.spec_accepted_per_pos for r in routers):
            return
        for name, what, field in (("num_drafts", "Draft runs verified.", "spec_drafts"),
                                  ("num_draft_tokens", "Draft tokens verified.", "spec_draft_tokens"),
                                  ("num_accepted_tokens", "Draft tokens accepted.", "spec_accepted_tokens")):
            yield CounterMetricFamily(f"lightllm:spec_decode_{name}", what, value=sum(getattr(r, field) for r in routers))
        per_pos = CounterMetricFamily("lightllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in their run (0: the first).",
                                      labels=["position"])
        for pos in range(max(len(r.spec_accepted_per_pos) for r in routers)):
            per_pos.add_metric([str(pos)], sum(r.spec_accepted_per_pos[pos] for r in routers
                                               if pos < len(r.spec_accepted_per_pos)))
        yield per_pos

    @staticmethod
    def _prefix_tiers(routers: list[RouterStats], hits: int):
        """The prefix cache's hits by the tier they came from, and what its host tier holds."""
        host = sum(r.prefix_host_hit_tokens for r in routers)
        disk = sum(r.prefix_disk_hit_tokens for r in routers)
        by_tier = CounterMetricFamily("lightllm:prefix_cache_hits_by_tier",
                                      "Prompt tokens found in the prefix cache, by the tier that held them "
                                      "(device; host or disk: loaded back from there).", labels=["tier"])
        by_tier.add_metric(["device"], hits - host)
        by_tier.add_metric(["host"], host - disk)
        by_tier.add_metric(["disk"], disk)
        yield by_tier
        yield GaugeMetricFamily("lightllm:prefix_cache_host_tokens", "Tokens the prefix cache's host tier holds.",
                                value=sum(r.prefix_host_tokens for r in routers))

    @staticmethod
    def _replicas(routers: list[RouterStats]):
        families = (("lightllm:replica_num_requests_running", "Requests in each replica's running batch.",
                     lambda r: r.running_reqs),
                    ("lightllm:replica_num_requests_waiting", "Requests waiting in each replica's router.",
                     lambda r: r.waiting_reqs),
                    ("lightllm:replica_kv_cache_usage_perc", "Each replica's KV cache tokens in use / its budget.",
                     lambda r: r.tokens_used / r.max_total_token_num))
        for name, help_text, value in families:
            family = GaugeMetricFamily(name, help_text, labels=["replica"])
            for r in routers:
                family.add_metric([str(r.replica)], value(r))
            yield family


class RequestTimer:
    """One request's counts and times, from its arrival at the HTTP server (`start`, monotonic).
    `observe` takes every output in order; `observe_abort` marks a request ended early."""

    def __init__(self, metrics: Metrics, prompt_len: int, start: float):
        self.metrics, self.prompt_len, self.start = metrics, prompt_len, start
        self.handed_off = time.monotonic()  # made as the request goes to the router
        self.scheduled = self._first_time = start  # known at the first token
        self.first_token_seen = False
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied (told with the first token)
        self._last_time = start  # of the last output that carried tokens
        self._tokens_seen = 0

    def observe(self, out: TextOut) -> None:
        now = time.monotonic()
        new_tokens = out.count_output_tokens - self._tokens_seen  # <= 0 in an error output (fail_all's count is 0)
        if new_tokens > 0:
            if self.first_token_seen:
                self.metrics.time_per_output_token.observe((now - self._last_time) / new_tokens)
            else:
                self._observe_first(out, now)
            self.metrics.generation_tokens.inc(new_tokens)
            self._tokens_seen, self._last_time = out.count_output_tokens, now
        if out.finish_reason is not None:
            self.metrics.request_success.labels(out.finish_reason.value).inc()
            self._observe_finished(now)

    def _observe_first(self, out: TextOut, now: float) -> None:
        self.first_token_seen = True
        self.cached_tokens = out.cached_tokens
        self.metrics.prompt_tokens.inc(self.prompt_len)
        self.metrics.time_to_first_token.observe(now - self.start)
        self.metrics.queue_time.observe(out.queue_time)
        self._first_time = now
        # the router's queue time on this process's clock; never before the hand-off nor after now
        self.scheduled = min(max(self.handed_off + out.queue_time, self.handed_off), now)

    def _observe_finished(self, now: float) -> None:
        metrics = self.metrics
        metrics.e2e_latency.observe(now - self.start)
        metrics.request_prompt_tokens.observe(self.prompt_len)
        metrics.request_generation_tokens.observe(self._tokens_seen)
        if self.first_token_seen:  # an error before any token has no phases
            metrics.prefill_time.observe(self._first_time - self.scheduled)
            metrics.decode_time.observe(now - self._first_time)
            metrics.inference_time.observe(now - self.scheduled)

    def observe_abort(self) -> None:
        self.metrics.request_success.labels(FinishReason.ABORT.value).inc()
