"""The simulated-GPU benchmark: its H100 cost model against the measured static points, its
stand-in device's step protocol, and a small run through the real router loop."""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test" / "benchmark"))

from sharegpt import SampledRequest  # noqa: E402
from sim_cost import H100_STATIC_POINTS, H100CostModel, StepWork, fit  # noqa: E402
from sim_device import FILLER_TOKEN, SimDevice  # noqa: E402
from sim_serving import sim_config, simulate  # noqa: E402

from lightllm.engine.plan import Chunk, Release, StepPlan  # noqa: E402
from lightllm.server.io_struct import SamplingParams  # noqa: E402

STATIC_TOLERANCE = 0.06  # relative; the largest residual of the fit is 5.7% (docs/benchmarks.md)


def test_cost_model_reproduces_the_static_h100_points():
    model = H100CostModel()
    for point in H100_STATIC_POINTS:
        assert model.step_ms(point.work) == pytest.approx(point.ms, rel=STATIC_TOLERANCE), point


def test_the_default_coefficients_are_the_fit():
    fitted, default = asdict(fit()), asdict(H100CostModel())
    for name, value in fitted.items():
        assert default[name] == pytest.approx(value, rel=1e-3), name


def test_step_time_grows_with_each_kind_of_work():
    model = H100CostModel()
    rng = random.Random()
    base = StepWork(rng.randrange(1, 200), rng.randrange(1, 10**5), rng.randrange(0, 4096), rng.randrange(0, 10**6))
    for field in ("decode_reqs", "decode_context", "prefill_tokens", "attention_pairs"):
        more = StepWork(**{**asdict(base), field: getattr(base, field) * 4 + 300})
        assert model.step_ms(more) >= model.step_ms(base), field
    assert model.step_ms(StepWork(prefill_tokens=1, attention_pairs=1)) == model.eager_floor_ms
    assert model.step_ms(StepWork()) == 0.0


def test_new_interface_keeps_one_step_in_flight():
    device = SimDevice(H100CostModel())
    prompt_len = random.randrange(2, 64)
    first = StepPlan(0, chunks=[Chunk(7, [5] * prompt_len, 0, True, SamplingParams())])
    assert device.step(first) == []  # launched; nothing finished before it
    launched_at = time.perf_counter()
    second = StepPlan(1, decodes=[7])
    (result,) = device.step(second)
    assert result.step_id == 0 and [t.req_id for t in result.tokens] == [7]
    assert result.tokens[0].token_id == FILLER_TOKEN
    assert time.perf_counter() - launched_at >= H100CostModel().eager_floor_ms / 1000 * 0.9
    (final,) = device.step(StepPlan(2, sync=True))  # empty: only collects step 1
    assert final.step_id == 1 and device.context == {7: prompt_len + 1}
    assert device.step(StepPlan(3, ops=[Release(7)], sync=True)) == [] and device.context == {}
    assert device.steps == 2


def run_small(count: int, request_rate: float = math.inf, flags: str = ""):
    rng = random.Random()
    requests = [SampledRequest("", [rng.randrange(3, 50000) for _ in range(rng.randrange(4, 200))], rng.randrange(2, 30))
                for _ in range(count)]
    summary = simulate(requests, sim_config(flags), request_rate=request_rate, seed=rng.randrange(1000),
                       max_total_token_num=20_000, eos_token_ids=[2])
    return requests, summary


@pytest.mark.parametrize("request_rate", [math.inf, 200.0])
@pytest.mark.parametrize("flags", ["", "--disable_overlap --chunked_prefill_size 64"])
def test_every_request_finishes_with_its_tokens_through_the_router_loop(request_rate, flags):
    requests, summary = run_small(20, request_rate, flags)
    assert summary["completed"] == len(requests) and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(r.output_len for r in requests)
    assert summary["total_input_tokens"] == sum(r.prompt_len for r in requests)
    assert summary["kv_tokens_held_at_end"] == 0
    assert 0 < summary["device_busy_share"] <= 1
    # The longest request needs a prefill step and output_len - 1 decode steps, one after another.
    model = H100CostModel()
    longest = max(r.output_len for r in requests)
    floor_s = (model.eager_floor_ms + (longest - 1) * model.decode_fixed_ms) / 1000
    assert summary["duration"] >= floor_s
    assert summary["median_ttft_ms"] <= summary["median_e2el_ms"]
