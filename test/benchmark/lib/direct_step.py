"""One synchronous model-runner step without a scheduler, for the tests and the engine benchmarks."""

from __future__ import annotations

from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.plan import Chunk, StepPlan

_direct_steps = iter(range(-1, -(1 << 62), -1))  # ids of direct steps, apart from the scheduler's


def run_step(runner: ModelRunner, decodes: list[int] = (), prompts: list[tuple] = ()) -> list[tuple[int, float]]:
    """One synchronous step without a scheduler (tests and benchmarks): `decodes` are running
    request ids, `prompts` whole prompts as (req_id, token ids, SamplingParams); returns
    (token, logprob) per request, decodes first."""
    chunks = [Chunk(req_id, list(ids), 0, True, params) for req_id, ids, params in prompts]
    (result,) = runner.step(StepPlan(next(_direct_steps), list(decodes), chunks, sync=True))
    return [(t.token_id, t.logprob) for t in result.tokens]
