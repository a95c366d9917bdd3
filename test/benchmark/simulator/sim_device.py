"""A stand-in for the model workers whose steps take the time the cost model gives, in wall time.

It speaks the model workers' interface to the engine core (`lightllm/engine/plan.py`):
`step(plan)` launches the plan on a simulated asynchronous device and answers with the previous
step's result once that step has finished (one step always in flight), or with this step's own
too when `plan.sync` is set. Launching an eager step (one with prefill chunks) holds the call for
the cost model's host time H, as the real worker's Python launches do: the step's kernels start
as they are launched, so it finishes at max(device free + D, call start + H), and the caller can
plan the next step only after H.

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

from lightllm.engine.plan import (Release, Reset, SampledToken, StepPlan, StepResult, plan_from_wire, plan_to_wire, result_from_wire,
                                  result_to_wire)
from benchmark.simulator.sim_cost import H100CostModel, StepWork, causal_pairs

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

    def _release(self, ops) -> None:
        """Requests that ended leave; the prefix cache's ops move no simulated work."""
        for op in ops:
            if isinstance(op, Release):
                self.context.pop(op.req_id)
                self.generated.pop(op.req_id)
            elif isinstance(op, Reset):
                self.context.clear()
                self.generated.clear()

    def _next(self, req_id: int) -> tuple[int, float]:
        self.generated[req_id] += 1
        if self.eos_token is not None and self.generated[req_id] == self.eos_after.get(req_id):
            return self.eos_token, FILLER_LOGPROB
        return FILLER_TOKEN, FILLER_LOGPROB

    # ---- the new interface (engine core): one step in flight ----
    def step(self, plan: StepPlan) -> list[StepResult]:
        plan = plan_from_wire(cross(plan_to_wire(plan)))
        half_trip = self.cost.call_overhead_ms / 2000.0
        self._release(plan.ops)
        due = [self._pending] if self._pending is not None else []
        self._pending = None
        arrives_at = time.perf_counter() + half_trip
        launched, launched_at = None, arrives_at
        if not plan.empty:
            launched, launched_at = self._launch(plan, arrives_at)
        if launched is not None and plan.sync:
            due.append(launched)
        else:
            self._pending = launched
        sleep_until(max([launched_at] + [d.finish_at for d in due]) + half_trip)
        return [result_from_wire(cross(result_to_wire(d.result))) for d in due]

    def _launch(self, plan: StepPlan, arrives_at: float) -> tuple[_Launched, float]:
        """The step on the device, and when its last kernel has been launched."""
        for req_id in plan.decodes:
            self.context[req_id] += 1
        for chunk in plan.chunks:
            assert chunk.first or self.context[chunk.req_id] == chunk.start, (chunk.req_id, chunk.start)
            self.context[chunk.req_id] = chunk.start + len(chunk.token_ids)
            self.generated.setdefault(chunk.req_id, 0)
        work = StepWork(decode_reqs=len(plan.decodes),
                        decode_context=sum(self.context[r] for r in plan.decodes),
                        prefill_tokens=sum(len(c.token_ids) for c in plan.chunks),
                        attention_pairs=sum(causal_pairs(c.start, len(c.token_ids)) for c in plan.chunks))
        device_s, launched_at = self.cost.device_ms(work) / 1000.0, arrives_at + self.cost.host_ms(work) / 1000.0
        self.busy_s += device_s
        self.steps += 1
        # Kernels queue behind the previous step and cannot run before they are launched.
        self.device_free_at = max(max(arrives_at, self.device_free_at) + device_s, launched_at)
        tokens = [SampledToken(r, *self._next(r)) for r in plan.sampled]
        return _Launched(self.device_free_at, StepResult(plan.step_id, tokens)), launched_at


def cross(wire):
    """A value after a trip through rpyc's serializer (real host work, as between processes)."""
    return brine.load(brine.dump(wire))


def sleep_until(deadline: float) -> None:
    """Sleep to a perf_counter() deadline; the deadline, not the sleep, sets the next step's start,
    so oversleeping does not add up over steps of the asynchronous device."""
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
