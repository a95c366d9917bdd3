"""The scheduler without a model: the peak formula, and the KV budget under any mix of chunks,
decodes, EOS and aborts, with one step in flight or none (hypothesis drives the mixes)."""

import itertools
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.engine.core import EngineCore
from lightllm.engine.plan import SampledToken, StepPlan, StepResult
from lightllm.engine.scheduler import AGING_STEPS, POLICIES, Scheduler, peak_token_usage
from lightllm.server.io_struct import FinishReason, GenerateReq, SamplingParams

EOS = 2


def simulated_peak(held: list[int], left: list[int]) -> int:
    """Step the batch one token at a time; a request frees its tokens right after its last step."""
    held, left = list(held), list(left)
    peak = sum(held)
    while held:
        held = [h + 1 for h in held]
        left = [n - 1 for n in left]
        peak = max(peak, sum(held))
        keep = [i for i, n in enumerate(left) if n > 0]
        held, left = [held[i] for i in keep], [left[i] for i in keep]
    return peak


def test_peak_formula_matches_step_simulation():
    rng = np.random.default_rng()
    for _ in range(300):
        n = int(rng.integers(1, 12))
        held = rng.integers(1, 60, n)
        left = rng.integers(1, 40, n)
        assert peak_token_usage(held, left) == simulated_peak(held.tolist(), left.tolist())
    assert peak_token_usage(np.array([], dtype=int), np.array([], dtype=int)) == 0


class FakeRunner:
    """ModelRunner's step contract (free, launch, answer with the previous step unless sync)
    with KV slots counted as the runner allocates them; EOS drawn at random."""

    def __init__(self, budget: int, eos_rate: float, rng: random.Random):
        self.budget, self.eos_rate, self.rng = budget, eos_rate, rng
        self.kv: dict[int, int] = {}
        self.peak = 0
        self._pending: StepResult | None = None

    def step(self, plan: StepPlan) -> list[StepResult]:
        for req_id in plan.free:
            self.kv.pop(req_id, None)  # a failed step may not have added it
        launched = None
        if not plan.empty:
            for req_id in plan.decodes:
                self.kv[req_id] += 1
            for chunk in plan.chunks:
                assert (chunk.start == 0) == (chunk.req_id not in self.kv)
                self.kv[chunk.req_id] = chunk.start + len(chunk.token_ids)
            self.peak = max(self.peak, sum(self.kv.values()))
            assert self.peak <= self.budget, (self.peak, self.budget)
            launched = StepResult(plan.step_id, [SampledToken(i, self._token(), -1.0) for i in plan.sampled])
        done = [self._pending] if self._pending is not None else []
        self._pending = None
        if launched is not None and (plan.sync or plan.empty):
            done.append(launched)
        else:
            self._pending = launched
        return done

    def _token(self) -> int:
        return EOS if self.rng.random() < self.eos_rate else 100


requests = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40), st.integers(0, 30)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(requests, st.integers(1, 70), st.integers(0, 200), st.booleans(), st.sampled_from([0.0, 0.05]),
       st.integers(1, 16), st.sampled_from(POLICIES), st.randoms(use_true_random=False))
def test_kv_budget_holds_and_every_request_ends(reqs, chunk, extra_budget, overlap, eos_rate, max_running, policy,
                                                rng):
    budget = max(p + n for p, n, _ in reqs) + extra_budget
    runner = FakeRunner(budget, eos_rate, rng)
    core = EngineCore(Scheduler(budget, chunk, max_running, policy), runner, eos_token_ids=[EOS], overlap=overlap)
    arrivals = sorted(((at, i) for i, (_, _, at) in enumerate(reqs)), reverse=True)
    aborted = {i for i in range(len(reqs)) if rng.random() < 0.1}
    outs: dict[int, list] = {}
    for step in itertools.count():
        while arrivals and arrivals[-1][0] <= step:
            _, i = arrivals.pop()
            prompt_len, max_new, _ = reqs[i]
            core.add(GenerateReq(i, [5] * prompt_len, SamplingParams(max_new_tokens=max_new)))
        if step == 15:
            for i in aborted:
                core.abort(i)
        for out in core.step():
            outs.setdefault(out.req_id, []).append(out)
        if not arrivals and not core.has_work:
            break
        assert step < 5000, "the engine stalled"
    assert runner.kv == {} and core.scheduler.tokens_used == 0
    for i, (_, max_new, _) in enumerate(reqs):
        got = outs.get(i, [])
        if i in aborted and (not got or got[-1].finish_reason is None):
            continue
        assert got and all(o.finish_reason is None for o in got[:-1])
        last = got[-1].finish_reason
        assert (last is FinishReason.LENGTH and len(got) == max_new) or (last is FinishReason.EOS and len(got) <= max_new)
    assert runner.peak <= budget


def admitted_order(scheduler: Scheduler) -> list[int]:
    return [req.req_id for req in scheduler.running]


def test_lpt_admits_long_generations_first_and_ages_the_rest():
    rng = random.Random()
    lengths = [rng.randrange(1, 500) for _ in range(20)]
    core = EngineCore(Scheduler(100_000, 64, 1000, "lpt"), FakeRunner(100_000, 0.0, rng), eos_token_ids=[EOS])
    for i, n in enumerate(lengths):
        core.add(GenerateReq(i, [5] * 8, SamplingParams(max_new_tokens=n)))
    core.step()
    order = admitted_order(core.scheduler)
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
    # One running slot: a short request that has waited AGING_STEPS steps goes before a longer,
    # younger one.
    core = EngineCore(Scheduler(100_000, 64, 1, "lpt"), FakeRunner(100_000, 0.0, rng), eos_token_ids=[EOS])
    core.add(GenerateReq(0, [5], SamplingParams(max_new_tokens=AGING_STEPS + 10)))
    core.add(GenerateReq(1, [5], SamplingParams(max_new_tokens=2)))
    outs = []
    for _ in range(AGING_STEPS + 5):
        outs += core.step()
    core.add(GenerateReq(2, [5], SamplingParams(max_new_tokens=AGING_STEPS)))
    outs += core.drain()
    first_token = {}
    for n, out in enumerate(outs):
        first_token.setdefault(out.req_id, n)
    assert first_token[0] < first_token[1] < first_token[2]


def test_fcfs_admits_in_arrival_order():
    rng = random.Random()
    core = EngineCore(Scheduler(100_000, 64, 1000, "fcfs"), FakeRunner(100_000, 0.0, rng), eos_token_ids=[EOS])
    for i in range(10):
        core.add(GenerateReq(i, [5] * 8, SamplingParams(max_new_tokens=rng.randrange(1, 100))))
    core.step()
    assert admitted_order(core.scheduler) == list(range(10))
