"""Per-request timings and the summary vLLM's serving benchmark prints.

Definitions (all per successful request unless said otherwise):
  TTFT  time from sending the request to receiving its first output token
  TPOT  (E2E latency - TTFT) / (output tokens - 1), for requests with more than one token
  ITL   every gap between two consecutive output tokens, over all requests together
  E2E   time from sending the request to receiving its last token
Throughputs divide successful requests' tokens by the wall time of the whole run.
Failed requests are counted and their errors kept; they add no tokens.

Goodput at an SLO (vLLM's --goodput): successful requests whose own TTFT and TPOT are both
within the bounds, per second of the whole run. A request of one token has a TPOT of 0 there,
and one that did not stream (no TTFT) cannot be shown to meet the TTFT bound, so it is not good.

Prefix cache (when the server's /metrics has the counters, read before and after the run):
  queried tokens  prompt tokens the server looked up in its cache during the run
  hit tokens      of those, the tokens it found cached; hit rate = hit / queried
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np
from benchmark.lib.server_process import metric_samples

PERCENTILE_RANKS = {"median": 50, "p90": 90, "p99": 99}
PERCENTILES = ("mean", *PERCENTILE_RANKS)
LATENCY_METRICS = (  # (key, printed name, section title)
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2E Latency", "End-to-end Latency"),
)
WIDTH = 50
PREFIX_CACHE_COUNTERS = {  # summary key: /metrics counter
    "prefix_cache_queries": "lightllm:prefix_cache_queries_total",
    "prefix_cache_hits": "lightllm:prefix_cache_hits_total",
}
NO_COUNTERS = "n/a (not on /metrics)"


@dataclass
class RequestResult:
    prompt_len: int
    expected_output_len: int
    success: bool = False
    output_len: int = 0
    latency: float = 0.0  # seconds
    ttft: float | None = None  # seconds; None when the tokens did not stream
    itl: list[float] = field(default_factory=list)  # seconds between consecutive tokens
    error: str = ""
    output_text: str = ""
    output_ids: list[int] = field(default_factory=list)  # streamed from /generate_stream: each token's id
    sent_at: float = 0.0  # time.time() when sent (the wall clock, comparable between client processes); 0: unknown


@dataclass(frozen=True)
class SLO:
    """Per-request latency bounds that a request must meet to count towards goodput."""

    ttft_ms: float = 500.0
    tpot_ms: float = 50.0


def fail_if_short(result: RequestResult) -> RequestResult:
    """A request that returned a different number of tokens than asked for has failed."""
    if result.success and result.output_len != result.expected_output_len:
        result.success = False
        result.error = f"expected {result.expected_output_len} output tokens, got {result.output_len}"
    return result


def stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(PERCENTILES)
    ms = np.asarray(values) * 1000.0
    ranked = np.percentile(ms, list(PERCENTILE_RANKS.values()))
    return {"mean": float(ms.mean()), **{stat: float(v) for stat, v in zip(PERCENTILE_RANKS, ranked)}}


def request_tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first; None without a TTFT or a second token."""
    if result.ttft is None or result.output_len < 2:
        return None
    return (result.latency - result.ttft) / (result.output_len - 1)


def latency_values(ok: list[RequestResult]) -> dict[str, list[float]]:
    streamed = [r for r in ok if r.ttft is not None]
    return {
        "ttft": [r.ttft for r in streamed],
        "tpot": [tpot for tpot in map(request_tpot, streamed) if tpot is not None],
        "itl": [gap for r in streamed for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    """The figures of a run, flat, with vLLM's key names (`mean_ttft_ms`, ...)."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "errors": error_counts(results),
    }
    for key, values in latency_values(ok).items():
        for stat, value in stats_ms(values).items():
            summary[f"{stat}_{key}_ms"] = value
    if any(r.sent_at for r in results):
        summary["per_request"] = per_request(results)
    return summary


def per_request(results: list[RequestResult]) -> dict[str, list]:
    """Each request's send time (seconds after the first), prompt and output length, TTFT and
    latency (seconds; None where it failed or did not stream), in the results' order: which
    requests make a latency tail, and when in the run they were sent."""
    first = min(r.sent_at for r in results if r.sent_at)
    return {"sent_s": [round(r.sent_at - first, 4) if r.sent_at else None for r in results],
            "prompt_len": [r.prompt_len for r in results],
            "output_len": [r.output_len for r in results],
            "ttft_s": [round(r.ttft, 4) if r.success and r.ttft is not None else None for r in results],
            "latency_s": [round(r.latency, 4) if r.success else None for r in results]}


def slowest_first_tokens(per_request_rows: dict[str, list], count: int = 5) -> str:
    """The `count` longest TTFTs of a summary's per_request rows, each with when it was sent and
    its prompt's length, as one line: '812 ms (sent at 0.02 s, prompt 920), ...'."""
    rows = [(ttft, sent, prompt) for ttft, sent, prompt in zip(per_request_rows["ttft_s"], per_request_rows["sent_s"],
                                                               per_request_rows["prompt_len"]) if ttft is not None]
    rows.sort(key=lambda row: -row[0])
    return ", ".join(f"{1000 * ttft:.0f} ms (sent at {sent:.2f} s, prompt {prompt})" for ttft, sent, prompt in rows[:count])


def meets_slo(result: RequestResult, slo: SLO) -> bool:
    if not result.success or result.ttft is None:
        return False
    tpot = request_tpot(result) or 0.0  # a single token has no gap to bound
    return result.ttft * 1000.0 <= slo.ttft_ms and tpot * 1000.0 <= slo.tpot_ms


def goodput(results: list[RequestResult], duration: float, slo: SLO) -> float:
    """Requests per second that succeeded within both of the SLO's bounds."""
    return sum(meets_slo(r, slo) for r in results) / duration


def error_counts(results: list[RequestResult]) -> dict[str, int]:
    return dict(collections.Counter(r.error for r in results if not r.success).most_common(10))


def unlabelled_samples(text: str, names) -> dict[str, float]:
    """The values of the named unlabelled samples in Prometheus text; absent names are left out."""
    samples = metric_samples(text)
    return {name: samples[name] for name in names if name in samples}


def prefix_cache_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The counters' growth over the run and the hit rate; None where a counter is absent."""
    figures = {}
    for key, name in PREFIX_CACHE_COUNTERS.items():
        present = name in before and name in after
        figures[key] = round(after[name] - before[name]) if present else None  # token counts
    queried, hits = figures["prefix_cache_queries"], figures["prefix_cache_hits"]
    figures["prefix_cache_hit_rate"] = None if None in (queried, hits) else hits / max(queried, 1)
    return figures


def line(name: str, value, missing: str = "n/a (needs --stream)") -> str:
    if value is None:
        text = missing
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{name:<40} {text}"


def format_summary(summary: dict, title: str = "Serving Benchmark Result") -> str:
    lines = [f" {title} ".center(WIDTH, "=")]
    if "workload" in summary:
        lines += [line(f"{key.replace('_', ' ').capitalize()}:", value) for key, value in summary["workload"].items()]
    lines += [
        line("Successful requests:", summary["completed"]),
        line("Failed requests:", summary["failed"]),
        line("Benchmark duration (s):", summary["duration"]),
        line("Total input tokens:", summary["total_input_tokens"]),
        line("Total generated tokens:", summary["total_output_tokens"]),
        line("Request throughput (req/s):", summary["request_throughput"]),
        line("Output token throughput (tok/s):", summary["output_throughput"]),
        line("Total Token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for key, name, section in LATENCY_METRICS:
        lines.append(section.center(WIDTH, "-"))
        for stat in PERCENTILES:
            lines.append(line(f"{stat.capitalize()} {name} (ms):", summary[f"{stat}_{key}_ms"]))
    if "prefix_cache_hit_rate" in summary:
        lines += prefix_cache_lines(summary)
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def prefix_cache_lines(summary: dict) -> list[str]:
    rate = summary["prefix_cache_hit_rate"]
    return [
        "Prefix Cache (server counters)".center(WIDTH, "-"),
        line("Queried prompt tokens:", summary["prefix_cache_queries"], NO_COUNTERS),
        line("Cache hit tokens:", summary["prefix_cache_hits"], NO_COUNTERS),
        line("Cache hit rate (%):", None if rate is None else 100.0 * rate, NO_COUNTERS),
    ]
