"""How long one engine step of bench-8b takes on one H100: a cost model fitted to measurements.

    python test/benchmark/sim_cost.py          # fit, print the coefficients and the residuals

The points are the static benchmark's H100 tables in docs/benchmarks.md (engine alone, CUDA graphs
on, bench-8b in bf16) and two eager steps profiled on the H100. Two kinds of step, two formulas:

- decode only (replayed from a CUDA graph, padded to its batch bucket):
      fixed + per_req * bucket(B) + kv_read * (context tokens of the batch)
  fixed is streaming the 16 GB of weights once (5.4 ms at copy speed) plus graph launch;
  per_req the GEMM rows and sampling of one more request; kv_read one context token's K and V
  (128 KiB over 32 layers: 44 ns at 3 TB/s).
- with prefill (eager, not captured), two times that overlap:
      device  prefill_fixed + per_token * tokens + attention * pairs + kv_read * decode context
      host    eager_host + (eager_decode_host if the step also carries decodes)
  pairs = sum over chunks of (query token, key token) pairs under the causal mask; decodes that
  ride in such a step count as tokens of its GEMMs. An eager forward is launched kernel by kernel
  from Python, and the worker's call returns only when the last kernel is launched: that host
  time blocks the caller, and a step alone takes max(host, device). A mixed step launches the
  decode attention (and a cat) in every layer on top of the extend path, hence the second term.

On top, `call_overhead_ms`: host time of one router <-> worker call (see its comment).

The host terms solve the two eager rows that test/benchmark/profile_step.py measured on the H100
on 2026-11-23 (H100_EAGER_POINTS: wall time of one synchronous step alone). The device terms are
fitted to the static points whose fitted device time exceeds the eager host time (the others are
host-bound and say nothing about the device), repeated until that set stops changing.
Fits are least squares on relative error (numpy.linalg.lstsq, rows scaled by 1 / measured time),
so that 7 ms and 200 ms points weigh alike.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, replace

import numpy as np


# The runner's decode buckets as they were in the H100 run (27 graphs for running_max_req_size
# 1000): dense to 256, then every 64, then the largest batch itself.
SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
LARGE_BUCKET_STEP = 64
MAX_BATCH = 1000


def decode_buckets(max_batch: int = MAX_BATCH) -> list[int]:
    small = [b for b in SMALL_BUCKETS if b < max_batch]
    large = range(SMALL_BUCKETS[-1] + LARGE_BUCKET_STEP, max_batch, LARGE_BUCKET_STEP)
    return small + list(large) + [max_batch]


_BUCKETS = decode_buckets()


def decode_bucket(n: int) -> int:
    """The padded batch a decode of n requests runs at (n itself past the largest bucket)."""
    i = bisect.bisect_left(_BUCKETS, n)
    return _BUCKETS[i] if i < len(_BUCKETS) else n


def causal_pairs(start: int, length: int) -> int:
    """(query, key) pairs of `length` new tokens after `start` cached ones, causal mask."""
    return length * start + length * (length + 1) // 2


@dataclass(frozen=True)
class StepWork:
    """What one step computes, in the terms the cost model prices."""

    decode_reqs: int = 0
    decode_context: int = 0  # context tokens the decodes attend to, summed over requests
    prefill_tokens: int = 0  # prompt tokens (chunks) computed in this step
    attention_pairs: int = 0  # causal (query, key) pairs of those tokens


@dataclass(frozen=True)
class StaticPoint:
    """One row of the static benchmark: a prefill of `batch` x `length` or a decode at `context`."""

    phase: str  # "prefill" or "decode"
    batch: int
    length: int  # prompt length (prefill) or context per request (decode)
    ms: float
    source: str  # the commit (and date) of the measurement

    @property
    def work(self) -> StepWork:
        if self.phase == "prefill":
            return StepWork(prefill_tokens=self.batch * self.length, attention_pairs=self.batch * causal_pairs(0, self.length))
        return StepWork(decode_reqs=self.batch, decode_context=self.batch * self.length)


_MAIN, _AGAIN = "720458a", "94a5e24 (2026-11-22)"
H100_STATIC_POINTS = (  # docs/benchmarks.md, "Static benchmark (engine alone, CUDA graphs on)"
    StaticPoint("prefill", 1, 128, 22.669, _MAIN),
    StaticPoint("prefill", 1, 1024, 26.153, _MAIN),
    StaticPoint("prefill", 8, 128, 24.919, _MAIN),
    StaticPoint("prefill", 8, 1024, 197.145, _MAIN),
    StaticPoint("decode", 1, 128, 6.842, _MAIN),
    StaticPoint("decode", 1, 1024, 6.831, _MAIN),
    StaticPoint("decode", 1, 4096, 6.971, _MAIN),
    StaticPoint("decode", 8, 1024, 7.503, _MAIN),
    StaticPoint("decode", 32, 1024, 8.835, _MAIN),
    StaticPoint("decode", 64, 1024, 10.680, _MAIN),
    StaticPoint("decode", 64, 4096, 19.245, _MAIN),
    StaticPoint("decode", 128, 1024, 14.851, _MAIN),
    StaticPoint("decode", 256, 128, 12.350, _MAIN),
    StaticPoint("decode", 256, 1024, 23.685, _MAIN),
    StaticPoint("prefill", 1, 1024, 26.167, _AGAIN),
    StaticPoint("decode", 1, 1024, 6.589, _AGAIN),
    StaticPoint("decode", 64, 1024, 10.143, _AGAIN),
)


@dataclass(frozen=True)
class EagerPoint:
    """One eager step alone, synchronous: its wall time and its device busy time (the union of
    its kernels' times under torch.profiler), from test/benchmark/profile_step.py."""

    label: str
    work: StepWork
    wall_ms: float
    device_ms: float
    source: str


_PROFILE = "profile_step.py (2026-11-23)"
H100_EAGER_POINTS = (  # docs/benchmarks.md, "Simulated-GPU benchmark": the eager host time
    EagerPoint("prefill 1 x 128", StepWork(prefill_tokens=128, attention_pairs=causal_pairs(0, 128)),
               20.99, 6.72, _PROFILE),
    # 64 decodes of 256-token prompts (context ~257: each timed step adds one) and one 512-token chunk
    EagerPoint("64 decodes + 1 x 512", StepWork(64, 64 * 257, 512, causal_pairs(0, 512)), 31.50, 15.17, _PROFILE),
)


@dataclass(frozen=True)
class H100CostModel:
    """Step times (ms) of bench-8b on one H100; the defaults are the fit to H100_STATIC_POINTS and
    H100_EAGER_POINTS (`python test/benchmark/sim_cost.py` refits and prints them)."""

    decode_fixed_ms: float = 6.73
    decode_per_req_ms: float = 0.016608
    kv_read_ms_per_token: float = 4.4751e-05
    prefill_fixed_ms: float = 1.7336
    prefill_per_token_ms: float = 0.022468
    attention_ms_per_pair: float = 2.7052e-06
    eager_host_ms: float = 20.99  # host launch of an eager forward (prefill chunks only)
    eager_decode_host_ms: float = 10.51  # more launches when it also carries decodes
    # Host, not device, and not fitted: one router <-> worker rpyc round trip, which the static
    # benchmark (runner called in process) does not see. On the H100 one request streamed at
    # 6.93 ms a token against a 6.59 ms decode step (same lease): 0.34 ms of pipeline a step, of
    # which the simulation already spends 0.22 ms on this CPU (router loop, serialization).
    call_overhead_ms: float = 0.12

    def step_ms(self, work: StepWork) -> float:
        """A step alone, synchronous (what the static benchmark measures)."""
        return max(self.host_ms(work), self.device_ms(work))

    def host_ms(self, work: StepWork) -> float:
        """Time the worker's call is blocked launching an eager step; a graph replay's launch is
        part of decode_fixed_ms."""
        if work.prefill_tokens == 0:
            return 0.0
        return self.eager_host_ms + (self.eager_decode_host_ms if work.decode_reqs else 0.0)

    def device_ms(self, work: StepWork) -> float:
        if work.prefill_tokens == 0:
            return self.decode_ms(work) if work.decode_reqs else 0.0
        return (self.prefill_fixed_ms
                + self.prefill_per_token_ms * (work.prefill_tokens + work.decode_reqs)
                + self.attention_ms_per_pair * work.attention_pairs
                + self.kv_read_ms_per_token * work.decode_context)

    def decode_ms(self, work: StepWork) -> float:
        return (self.decode_fixed_ms + self.decode_per_req_ms * decode_bucket(work.decode_reqs)
                + self.kv_read_ms_per_token * work.decode_context)

    def with_eager_host_scale(self, scale: float) -> "H100CostModel":
        """The same device with eager steps launched `scale` times as slowly (0: as cheaply as a graph)."""
        return replace(self, eager_host_ms=self.eager_host_ms * scale,
                       eager_decode_host_ms=self.eager_decode_host_ms * scale)


def _relative_lstsq(rows: list[list[float]], ms: list[float]) -> np.ndarray:
    a, b = np.asarray(rows, dtype=float), np.asarray(ms, dtype=float)
    coef, *_ = np.linalg.lstsq(a / b[:, None], np.ones_like(b), rcond=None)
    return coef


def _fit_decode(points: list[StaticPoint]) -> dict:
    rows = [[1.0, decode_bucket(p.batch), p.work.decode_context] for p in points]
    fixed, per_req, kv = _relative_lstsq(rows, [p.ms for p in points])
    return {"decode_fixed_ms": fixed, "decode_per_req_ms": per_req, "kv_read_ms_per_token": kv}


def _fit_eager_host(points: list[EagerPoint]) -> dict:
    rows = [[1.0, 1.0 if p.work.decode_reqs else 0.0] for p in points]
    host, decode_host = _relative_lstsq(rows, [p.wall_ms for p in points])
    return {"eager_host_ms": host, "eager_decode_host_ms": decode_host}


def _fit_prefill_device(points: list[StaticPoint], kv_read: float, host: dict) -> dict:
    """Least squares over the device-bound prefills; a point is device-bound when the fit puts
    its device time above its host time. Start from all of them, repeat until the set is stable."""
    bound = points
    for _ in range(len(points)):
        rows = [[1.0, p.work.prefill_tokens, p.work.attention_pairs] for p in bound]
        fixed, per_token, per_pair = _relative_lstsq(rows, [p.ms for p in bound])
        model = H100CostModel(0, 0, kv_read, fixed, per_token, per_pair, **host)
        now = [p for p in points if model.device_ms(p.work) > model.host_ms(p.work)]
        if now == bound:
            break
        bound = now
    return {"prefill_fixed_ms": fixed, "prefill_per_token_ms": per_token, "attention_ms_per_pair": per_pair}


def fit(points=H100_STATIC_POINTS, eager=H100_EAGER_POINTS) -> H100CostModel:
    decode = _fit_decode([p for p in points if p.phase == "decode"])
    host = _fit_eager_host(list(eager))
    prefill = _fit_prefill_device([p for p in points if p.phase == "prefill"], decode["kv_read_ms_per_token"], host)
    return H100CostModel(**{key: float(value) for key, value in {**decode, **prefill, **host}.items()},
                         call_overhead_ms=H100CostModel.call_overhead_ms)


def residuals(model: H100CostModel, points=H100_STATIC_POINTS) -> list[dict]:
    return [{**asdict(p), "model_ms": model.step_ms(p.work), "error": model.step_ms(p.work) / p.ms - 1}
            for p in points]


def format_fit(model: H100CostModel, points=H100_STATIC_POINTS, eager=H100_EAGER_POINTS) -> str:
    lines = ["H100CostModel(", *(f"    {key}={value:.5g}," for key, value in asdict(model).items()), ")",
             "| phase | batch | length | measured ms | model ms | error | source |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in residuals(model, points):
        lines.append(f"| {r['phase']} | {r['batch']} | {r['length']} | {r['ms']:.3f} | {r['model_ms']:.3f} | "
                     f"{r['error']:+.1%} | {r['source']} |")
    errors = np.abs([r["error"] for r in residuals(model, points)])
    lines.append(f"max |error| {errors.max():.1%}, rms {np.sqrt(np.mean(errors ** 2)):.1%}")
    lines += ["", "| eager step | wall ms | model ms | device ms | model device ms | source |",
              "| --- | ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {p.label} | {p.wall_ms:.2f} | {model.step_ms(p.work):.2f} | {p.device_ms:.2f} | "
              f"{model.device_ms(p.work):.2f} | {p.source} |" for p in eager]
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_fit(fit()))
