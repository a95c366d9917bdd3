"""What crosses the seam between the engine core (router process) and the model workers, per step.

The scheduler writes a `StepPlan`; every rank's model runner turns it into tensors and runs one
forward over all of it (decodes first, then prefill chunks). A worker's `step(plan)` launches the
plan and answers with the `StepResult` of the step before it (one step always in flight), or of
this step when `plan.sync` is set. rpyc carries them as plain tuples (`to_wire`/`*_from_wire`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lightllm.server.io_struct import SamplingParams


@dataclass
class Chunk:
    """A run of one request's prompt tokens whose KV is computed in this step."""

    req_id: int
    token_ids: list[int]
    start: int  # position of the first token = prompt tokens already in the cache
    last: bool  # ends the prompt: the step samples the request's first output token
    sampling: SamplingParams | None = None  # on the first chunk (start == 0) only


@dataclass
class StepPlan:
    step_id: int
    decodes: list[int] = field(default_factory=list)  # req ids; each feeds its last sampled token (on the device)
    chunks: list[Chunk] = field(default_factory=list)
    free: list[int] = field(default_factory=list)  # req ids whose slots and rows are freed before the step
    sync: bool = False  # answer with this step's result instead of the previous one's

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.chunks

    @property
    def sampled(self) -> list[int]:
        """Req ids that get a token from this step, in result order."""
        return self.decodes + [c.req_id for c in self.chunks if c.last]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(len(c.token_ids) for c in self.chunks)


@dataclass
class SampledToken:
    req_id: int
    token_id: int
    logprob: float


@dataclass
class StepResult:
    step_id: int
    tokens: list[SampledToken] = field(default_factory=list)  # in `StepPlan.sampled` order
    error: str | None = None  # the step failed: none of its requests got a token


# ---- rpyc passes lists by reference (a round trip per element): plans cross as nested tuples ----

_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def sampling_to_wire(params: SamplingParams | None) -> tuple | None:
    if params is None:
        return None
    return tuple(tuple(v) if isinstance(v, list) else v for v in (getattr(params, n) for n in _SAMPLING_FIELDS))


def sampling_from_wire(values: tuple | None) -> SamplingParams | None:
    if values is None:
        return None
    params = dict(zip(_SAMPLING_FIELDS, values))
    params["stop_sequences"] = list(params["stop_sequences"])
    return SamplingParams(**params)


def plan_to_wire(plan: StepPlan) -> tuple:
    chunks = tuple((c.req_id, tuple(c.token_ids), c.start, c.last, sampling_to_wire(c.sampling)) for c in plan.chunks)
    return plan.step_id, tuple(plan.decodes), chunks, tuple(plan.free), plan.sync


def plan_from_wire(wire: tuple) -> StepPlan:
    step_id, decodes, chunks, free, sync = wire
    return StepPlan(step_id, list(decodes),
                    [Chunk(r, list(t), s, last, sampling_from_wire(p)) for r, t, s, last, p in chunks],
                    list(free), sync)


def result_to_wire(result: StepResult | None) -> tuple | None:
    if result is None:
        return None
    return result.step_id, tuple((t.req_id, t.token_id, t.logprob) for t in result.tokens), result.error


def result_from_wire(wire: tuple | None) -> StepResult | None:
    if wire is None:
        return None
    step_id, tokens, error = wire
    return StepResult(step_id, [SampledToken(*t) for t in tokens], error)
