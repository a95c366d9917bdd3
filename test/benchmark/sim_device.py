"""A stand-in for the model workers whose steps take the time the cost model gives, in wall time.

Both interfaces the router loops use:
- the old, blocking one (`ModelWorkers`): `prefill(reqs)`, `decode(req_ids)`, `free(req_ids)`,
  `stats()`, `sentinels`, `shutdown()`: each call sleeps its step's cost, then answers;
- the new one (engine core, `lightllm/engine/plan.py`): `step(plan)` launches the plan on a
  simulated asynchronous device and answers with the previous step's result once that step has
  finished (one step always in flight), or with this step's own when `plan.sync` is set.

It tracks each request's context length (KV tokens) from the calls, which the cost model needs.
Tokens are a filler id, never EOS unless `eos_after` asks for it; nothing is computed. What the
real workers do on the host is done for real: arguments and results cross as rpyc would carry
them (nested tuples through rpyc's brine serializer, both ways), and every call also waits the
cost model's router <-> worker round trip (`call_overhead_ms`), which is host time, not device time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rpyc.core import brine

from lightllm.engine.plan import (SampledToken, StepPlan, StepResult, plan_from_wire, plan_to_wire, result_from_wire,
                                  result_to_wire, sampling_to_wire)
from lightllm.server.io_struct import SamplingParams
from sim_cost import H100CostModel, StepWork, causal_pairs

FILLER_TOKEN = 1000
FILLER_LOGPROB = -1.0


@dataclass
class _Launched:
    finish_at: float  # time.perf_counter() at which the simulated device completes the step
    result: StepResult


class SimDevice:
    def __init__(self, cost: H100CostModel | None = None, eos_token_ids=(), eos_after: dict[int, int] | None = None):
        assert FILLER_TOKEN not in set(eos_token_ids), "pick a filler token that is not EOS"
        self.cost = cost or H100CostModel()
        self.context: dict[int, int] = {}  # req_id -> KV tokens held
        self.generated: dict[int, int] = {}
        self.eos_after = eos_after or {}  # req_id -> output count at which EOS is returned
        self.eos_token = min(eos_token_ids) if eos_token_ids else None
        self.busy_s = 0.0  # simulated device time of every step so far
        self.steps = 0
        self.device_free_at = 0.0
        self._pending: _Launched | None = None

    # ---- the old, blocking interface (ModelWorkers) ----
    sentinels: list = []

    def prefill(self, reqs) -> tuple:
        reqs = cross(to_wire(reqs))
        work = StepWork(prefill_tokens=sum(len(p) for _, p, _ in reqs),
                        attention_pairs=sum(causal_pairs(0, len(p)) for _, p, _ in reqs))
        for req_id, prompt, _ in reqs:
            self.context[req_id], self.generated[req_id] = len(prompt), 0
        self._run_blocking(work)
        return cross(tuple(self._next(req_id) for req_id, _, _ in reqs))

    def decode(self, req_ids) -> tuple:
        req_ids = cross(tuple(req_ids))
        for req_id in req_ids:
            self.context[req_id] += 1  # the fed token's KV is written, then attended to
        self._run_blocking(StepWork(decode_reqs=len(req_ids), decode_context=sum(self.context[r] for r in req_ids)))
        return cross(tuple(self._next(req_id) for req_id in req_ids))

    def free(self, req_ids) -> None:
        self._release(cross(tuple(req_ids)))
        sleep_until(time.perf_counter() + self.cost.call_overhead_ms / 1000.0)

    def stats(self) -> dict:
        sleep_until(time.perf_counter() + self.cost.call_overhead_ms / 1000.0)
        return {"tokens_used": sum(self.context.values())}

    def shutdown(self) -> None:
        pass

    def _release(self, req_ids) -> None:
        for req_id in req_ids:
            del self.context[req_id], self.generated[req_id]

    def _run_blocking(self, work: StepWork) -> None:
        seconds = self.cost.step_ms(work) / 1000.0
        self._account(seconds)
        start = time.perf_counter() + self.cost.call_overhead_ms / 1000.0
        self.device_free_at = start + seconds
        sleep_until(self.device_free_at)

    def _next(self, req_id: int) -> tuple[int, float]:
        self.generated[req_id] += 1
        if self.eos_token is not None and self.generated[req_id] == self.eos_after.get(req_id):
            return self.eos_token, FILLER_LOGPROB
        return FILLER_TOKEN, FILLER_LOGPROB

    def _account(self, seconds: float) -> None:
        self.busy_s += seconds
        self.steps += 1

    # ---- the new interface (engine core): one step in flight ----
    def step(self, plan: StepPlan) -> StepResult | None:
        plan = plan_from_wire(cross(plan_to_wire(plan)))
        half_trip = self.cost.call_overhead_ms / 2000.0
        self._release(plan.free)
        previous, self._pending = self._pending, None
        launched = None if plan.empty else self._launch(plan, time.perf_counter() + half_trip)
        if plan.sync and launched is not None:
            assert previous is None, "a sync step would drop the pending result of the step before it"
            previous = launched
        else:
            self._pending = launched
        if previous is None:
            sleep_until(time.perf_counter() + 2 * half_trip)
            return None
        sleep_until(previous.finish_at + half_trip)
        return result_from_wire(cross(result_to_wire(previous.result)))

    def _launch(self, plan: StepPlan, arrives_at: float) -> _Launched:
        for req_id in plan.decodes:
            self.context[req_id] += 1
        for chunk in plan.chunks:
            assert self.context.get(chunk.req_id, 0) == chunk.start, (chunk.req_id, chunk.start)
            self.context[chunk.req_id] = chunk.start + len(chunk.token_ids)
            self.generated.setdefault(chunk.req_id, 0)
        work = StepWork(decode_reqs=len(plan.decodes),
                        decode_context=sum(self.context[r] for r in plan.decodes),
                        prefill_tokens=sum(len(c.token_ids) for c in plan.chunks),
                        attention_pairs=sum(causal_pairs(c.start, len(c.token_ids)) for c in plan.chunks))
        seconds = self.cost.step_ms(work) / 1000.0
        self._account(seconds)
        self.device_free_at = max(arrives_at, self.device_free_at) + seconds
        tokens = [SampledToken(r, *self._next(r)) for r in plan.sampled]
        return _Launched(self.device_free_at, StepResult(plan.step_id, tokens))


def to_wire(value):
    """Lists as nested tuples and SamplingParams as a tuple of its fields: what rpyc carries."""
    if isinstance(value, SamplingParams):
        return sampling_to_wire(value)
    if isinstance(value, (list, tuple)):
        return tuple(to_wire(item) for item in value)
    return value


def cross(wire):
    """A value after a trip through rpyc's serializer (real host work, as between processes)."""
    return brine.load(brine.dump(wire))


def sleep_until(deadline: float) -> None:
    """Sleep to a perf_counter() deadline; the deadline, not the sleep, sets the next step's start,
    so oversleeping does not add up over steps of the asynchronous device."""
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
