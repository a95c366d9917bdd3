"""How long one engine step of bench-8b takes on one H100: a cost model fitted to measurements.

An estimate, not a validated model: each fit has as many coefficients as the points it is fitted
to (decode 2/2, eager host 2/2, prefill 3/3, fp8 host 2/2), so it passes through them whatever
the model's shape. The measurements no fit uses (`held_out()`, printed below the fits) are its
only test: on those the model is off by -31% to +73%. Use it to compare settings within the
simulation, never for a figure about the GPU.

    python test/benchmark/simulator/sim_cost.py          # fit bf16 and fp8, print the coefficients and the residuals

The points are H100 measurements of bench-8b in bf16 (H100, 2026-11-23, 6bfa73e and 9d728fa; docs/benchmarks-history.md): decode steps and eager
steps that test/benchmark/engine/profile_step.py profiled at 6bfa73e and 9d728fa, and the static
benchmark's prefills. Two kinds of step, two formulas:

- decode only (replayed from a CUDA graph, padded to its batch bucket):
      max(fixed + per_req * bucket(B), per_token * bucket(B)) + kv_read * (context tokens of the batch)
  fixed is streaming the ~15 GB of weights a step reads (5.0 ms at copy speed) plus the
  latency-bound small kernels; per_req the GEMM rows and sampling of one more request;
  per_token the prefill's (compute-bound rows, which bind past ~330 requests); kv_read one
  context token's K and V (128 KiB over 32 layers: 44 ns at 3 TB/s).
- with prefill (eager, not captured), two times that overlap:
      device  prefill_fixed + per_token * tokens + attention * pairs + kv_read * decode context
      host    eager_host + (eager_decode_host if the step also carries decodes)
  pairs = sum over chunks of (query token, key token) pairs under the causal mask; decodes that
  ride in such a step count as tokens of its GEMMs. An eager forward is launched kernel by kernel
  from Python, and the worker's call returns only when the last kernel is launched: that host
  time blocks the caller, and a step alone takes max(host, device). A mixed step launches the
  decode attention (and a cat) in every layer on top of the extend path, hence the second term.

On top, `call_overhead_ms`: host time of one router <-> worker call (see its comment).

The decode terms: kv_read is the decode attention kernel's time per context token (its KV stream,
H100_KV_STREAM), then fixed and per_req solve the two decode steps one in flight (H100_DECODE_POINTS:
the device's period as the engine core runs steps). The host terms solve the two eager rows
(H100_EAGER_POINTS: wall time of one synchronous step alone). The prefill device terms are fitted
to the static prefills whose fitted device time exceeds the eager host time (the others are
host-bound and say nothing about the device), repeated until that set stops changing.
Fits are least squares on relative error (numpy.linalg.lstsq, rows scaled by 1 / measured time),
so that 5 ms and 200 ms points weigh alike. `fit_fp8` fits `--quantization fp8` to its own H100
points (H100_FP8_DECODE_POINTS, H100_FP8_EAGER_POINTS); `with_fp8_kv_cache` prices a what-if on top
of either fit (no fp8 KV cache has been measured on a GPU).
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, replace

import numpy as np

from lightllm.engine.cuda_graph import decode_buckets


MAX_BATCH = 1000  # running_max_req_size in the H100 runs the points come from (27 decode graphs)
_BUCKETS = decode_buckets(MAX_BATCH)  # the runner's own buckets


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
class StepPoint:
    """One measured step: a prefill of `batch` x `length` alone, synchronous (the static
    benchmark), or a decode of `batch` requests at context `length`, steps one in flight."""

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


# Static benchmark, "Static benchmark (engine alone, CUDA graphs on)". Only its device-bound
# prefills are kept: not measured since, and of their kernels only the o/down GEMMs' weight layout
# changed (3df4290, chosen at decode sizes). Dropped: the 1 x 128 prefill
# (host-bound, and its host time was Triton's old launch path) and every decode point: they time a
# step alone, synchronous (launch, a host-device sync since removed, and sampling in series with the
# device), with decode attention's old launch settings and the old o/down/LM-head layout.
_MAIN, _AGAIN = "720458a", "94a5e24 (2026-11-22)"
H100_PREFILL_POINTS = (
    StepPoint("prefill", 1, 1024, 26.153, _MAIN),
    StepPoint("prefill", 8, 128, 24.919, _MAIN),
    StepPoint("prefill", 8, 1024, 197.145, _MAIN),
    StepPoint("prefill", 1, 1024, 26.167, _AGAIN),
)

# profile_step.py's "engine step, one in flight" (the server's loop) at 6bfa73e, context 1024.
_TUNED = "6bfa73e profile_step.py (2026-11-23)"
H100_DECODE_POINTS = (
    StepPoint("decode", 1, 1024, 5.661, _TUNED),
    StepPoint("decode", 256, 1024, 18.962, _TUNED),
)
H100_STEP_POINTS = H100_PREFILL_POINTS + H100_DECODE_POINTS

# The same profiles' decode attention split kernel (the one that streams the KV), ms a step, by
# the batch's context tokens: 0.96 of reading 128 KiB a token at copy speed between the two.
H100_KV_STREAM = ((1 * 1024, 0.194), (256 * 1024, 12.058))


@dataclass(frozen=True)
class EagerPoint:
    """One eager step alone, synchronous: its wall time and its device busy time (the union of
    its kernels' times under torch.profiler), from test/benchmark/engine/profile_step.py."""

    label: str
    work: StepWork
    wall_ms: float
    device_ms: float
    source: str


_FAST_LAUNCH = "9d728fa profile_step.py (2026-11-23)"  # Triton kernels launched directly
H100_EAGER_POINTS = (  # H100, 2026-11-23, 9d728fa (docs/benchmarks-history.md)
    EagerPoint("prefill 1 x 128", StepWork(prefill_tokens=128, attention_pairs=causal_pairs(0, 128)),
               11.65, 6.70, _FAST_LAUNCH),
    # 64 decodes of 256-token prompts (context ~257: each timed step adds one) and one 512-token chunk
    EagerPoint("64 decodes + 1 x 512", StepWork(64, 64 * 257, 512, causal_pairs(0, 512)), 17.75, 15.35, _FAST_LAUNCH),
)


# --quantization fp8 (bench-8b, fp8 projections, bf16 activations), profile_step.py on the H100.
# Decode steps one in flight at context 1024 (5f88c4c, H100, 2026-11-23); eager steps alone, synchronous,
# wall and device time: both host terms and the three prefill device terms come from these.
_FP8_DECODE, _FP8_HOST = "5f88c4c profile_step.py --quantization fp8 (2026-11-23)", "f6c956a (2026-11-23)"
H100_FP8_DECODE_POINTS = (
    StepPoint("decode", 1, 1024, 3.961, _FP8_DECODE),
    StepPoint("decode", 256, 1024, 17.449, _FP8_DECODE),
)
H100_FP8_EAGER_POINTS = (
    EagerPoint("prefill 1 x 128", StepWork(prefill_tokens=128, attention_pairs=causal_pairs(0, 128)),
               14.240, 4.984, _FP8_HOST),
    EagerPoint("448 decodes + 1 x 256", StepWork(448, 448 * 257, 256, causal_pairs(0, 256)), 29.664, 21.504, _FP8_HOST),
    EagerPoint("64 decodes + 1 x 512", StepWork(64, 64 * 257, 512, causal_pairs(0, 512)), 17.152, 14.295,
               "78e0a1e (2026-11-23)"),
    EagerPoint("448 decodes + 1 x 4096", StepWork(448, 448 * 257, 4096, causal_pairs(0, 4096)), 105.864, 98.838,
               "864ab51 (2026-11-23)"),
)


@dataclass(frozen=True)
class H100CostModel:
    """Step times (ms) of bench-8b on one H100; the defaults are the fit to H100_STEP_POINTS,
    H100_KV_STREAM and H100_EAGER_POINTS (`python test/benchmark/simulator/sim_cost.py` refits and prints them)."""

    decode_fixed_ms: float = 5.6088
    decode_per_req_ms: float = 0.0056353
    kv_read_ms_per_token: float = 4.5435e-05
    prefill_fixed_ms: float = 1.7336
    prefill_per_token_ms: float = 0.022468
    attention_ms_per_pair: float = 2.7052e-06
    eager_host_ms: float = 11.65  # host launch of an eager forward (prefill chunks only)
    eager_decode_host_ms: float = 6.10  # more launches when it also carries decodes
    # Host, not device, and not fitted: one router <-> worker rpyc round trip, which the static
    # benchmark (runner called in process) does not see. On the H100 one request streamed at
    # 6.93 ms a token against a 6.59 ms decode step (one machine, one run): 0.34 ms of pipeline a step, of
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
        """The rows cost at least as many prefill tokens: past ~330 requests a step's GEMMs are
        compute-bound, and the line through batches 1 and 256 would have them beat the prefill's
        715 TFLOP/s."""
        bucket = decode_bucket(work.decode_reqs)
        rows = max(self.decode_fixed_ms + self.decode_per_req_ms * bucket, self.prefill_per_token_ms * bucket)
        return rows + self.kv_read_ms_per_token * work.decode_context

    def with_eager_host_scale(self, scale: float) -> "H100CostModel":
        """The same device with eager steps launched `scale` times as slowly (0: as cheaply as a graph)."""
        return replace(self, eager_host_ms=self.eager_host_ms * scale,
                       eager_decode_host_ms=self.eager_decode_host_ms * scale)

    def with_fp8_kv_cache(self) -> "H100CostModel":
        """A what-if, not a fit (--kv_cache_dtype fp8_e4m3): every KV read takes half the time,
        the attention kernel's KV stream being half the bytes; nothing else changes."""
        return replace(self, kv_read_ms_per_token=self.kv_read_ms_per_token / 2)


def _relative_lstsq(rows: list[list[float]], ms: list[float]) -> np.ndarray:
    a, b = np.asarray(rows, dtype=float), np.asarray(ms, dtype=float)
    coef, *_ = np.linalg.lstsq(a / b[:, None], np.ones_like(b), rcond=None)
    return coef


def _fit_decode(points: list[StepPoint], kv_stream) -> dict:
    """kv_read from the attention kernel's growth with context; the rest of each step is
    fixed + per_req * bucket. Two points, two coefficients: exactly determined."""
    (context_a, ms_a), (context_b, ms_b) = kv_stream
    kv = (ms_b - ms_a) / (context_b - context_a)
    rows = [[1.0, decode_bucket(p.batch)] for p in points]
    fixed, per_req = _relative_lstsq(rows, [p.ms - kv * p.work.decode_context for p in points])
    return {"decode_fixed_ms": fixed, "decode_per_req_ms": per_req, "kv_read_ms_per_token": kv}


def _fit_eager_host(points: list[EagerPoint]) -> dict:
    rows = [[1.0, 1.0 if p.work.decode_reqs else 0.0] for p in points]
    host, decode_host = _relative_lstsq(rows, [p.wall_ms for p in points])
    return {"eager_host_ms": host, "eager_decode_host_ms": decode_host}


def _fit_prefill_device(points: list[StepPoint], kv_read: float, host: dict) -> dict:
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


def _fit_prefill_device_from_eager(points: list[EagerPoint], kv_read: float, per_pair: float) -> dict:
    """prefill_fixed and per_token from eager steps' device times (their decodes count as tokens
    and read their context), the attention's per-pair cost given: fp8 has no static prefills
    measured, its profiled eager steps are these, and its attention kernel is bf16's."""
    rows = [[1.0, p.work.prefill_tokens + p.work.decode_reqs] for p in points]
    device = [p.device_ms - kv_read * p.work.decode_context - per_pair * p.work.attention_pairs for p in points]
    fixed, per_token = _relative_lstsq(rows, device)
    return {"prefill_fixed_ms": fixed, "prefill_per_token_ms": per_token, "attention_ms_per_pair": per_pair}


FP8_HOST_POINTS = ("prefill 1 x 128", "448 decodes + 1 x 256")  # the fp8 host terms' two points


def fit_fp8(decode=H100_FP8_DECODE_POINTS, eager=H100_FP8_EAGER_POINTS, kv_stream=H100_KV_STREAM) -> H100CostModel:
    """The cost model of --quantization fp8, fitted to its own H100 points: the decode terms as
    bf16's are (kv_read from the same attention kernel), the host terms to the prefill alone and
    the 448-decode mixed step (the burst's mixed steps carry 450-500 decodes; with 64 decodes the
    host took less, which this model does not follow), prefill_fixed and per_token to the four
    eager steps' device times with bf16's attention cost."""
    terms = _fit_decode(list(decode), kv_stream)
    host_points = [p for p in eager if p.label in FP8_HOST_POINTS]
    terms |= _fit_eager_host(host_points) | _fit_prefill_device_from_eager(
        list(eager), terms["kv_read_ms_per_token"], fit().attention_ms_per_pair)
    return H100CostModel(**{key: float(value) for key, value in terms.items()})


def fit(points=H100_STEP_POINTS, eager=H100_EAGER_POINTS, kv_stream=H100_KV_STREAM) -> H100CostModel:
    decode = _fit_decode([p for p in points if p.phase == "decode"], kv_stream)
    host = _fit_eager_host(list(eager))
    prefill = _fit_prefill_device([p for p in points if p.phase == "prefill"], decode["kv_read_ms_per_token"], host)
    return H100CostModel(**{key: float(value) for key, value in {**decode, **prefill, **host}.items()})


def residuals(model: H100CostModel, points=H100_STEP_POINTS) -> list[dict]:
    return [{**asdict(p), "model_ms": model.step_ms(p.work), "error": model.step_ms(p.work) / p.ms - 1}
            for p in points]


def format_fit(model: H100CostModel, points=H100_STEP_POINTS, eager=H100_EAGER_POINTS) -> str:
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


@dataclass(frozen=True)
class HeldOut:
    """A measurement no fit uses, and what the fitted model says of it."""

    label: str
    measured_ms: float
    model_ms: float

    @property
    def error(self) -> float:
        return self.model_ms / self.measured_ms - 1


def held_out() -> list[HeldOut]:
    """Every H100 measurement above that no coefficient was fitted to: the bf16 eager steps'
    device times (the bf16 fit takes only their wall times, for the host terms) and the fp8 eager
    steps' wall times outside its two host points. Each fit has as many coefficients as the
    points it is fitted to (or nearly), so these are the only test of the model as a model."""
    bf16, fp8 = fit(), fit_fp8()
    rows = [HeldOut(f"bf16 {p.label}: device", p.device_ms, bf16.device_ms(p.work)) for p in H100_EAGER_POINTS]
    rows += [HeldOut(f"fp8 {p.label}: wall", p.wall_ms, fp8.step_ms(p.work)) for p in H100_FP8_EAGER_POINTS
             if p.label not in FP8_HOST_POINTS]
    return rows


def format_held_out(rows: list[HeldOut]) -> str:
    lines = ["| held-out measurement | measured ms | model ms | error |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r.label} | {r.measured_ms:.2f} | {r.model_ms:.2f} | {r.error:+.0%} |" for r in rows]
    lines.append(f"max |error| {max(abs(r.error) for r in rows):.0%} over {len(rows)} held-out points")
    return "\n".join(lines)


if __name__ == "__main__":
    print("bf16:\n" + format_fit(fit()))
    print("\n--quantization fp8:\n" + format_fit(fit_fp8(), H100_FP8_DECODE_POINTS, H100_FP8_EAGER_POINTS))
    print("\nheld out (no fit uses these):\n" + format_held_out(held_out()))
