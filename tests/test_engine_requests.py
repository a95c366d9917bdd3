"""A request's life through the engine core, driven by calls (no sockets, no model): length and
EOS endings, aborts of running and waiting requests, a failing step, and what stays in use."""

import random

import pytest
from helpers.fake_runner import EOS, FakeRunner

from lightllm.engine.core import EngineCore
from lightllm.engine.plan import StepPlan
from lightllm.engine.scheduler import Scheduler
from lightllm.engine.request import FinishReason, GenerateReq, SamplingParams


class ScriptedRunner(FakeRunner):
    """EOS for chosen requests after a given count; a poisoned prompt token fails its step."""

    def __init__(self, budget=10_000, eos_after=None, poison=None):
        super().__init__(budget, 0.0, random.Random(0))
        self.eos_after, self.poison, self.count = eos_after or {}, poison, {}

    def step(self, plan: StepPlan):
        if any(self.poison in c.token_ids for c in plan.chunks):
            self._pending = None
            self.apply(plan.ops)
            raise ValueError("poisoned prompt")
        self._sampled = iter(plan.sampled)
        return super().step(plan)

    def _token(self) -> int:
        req_id = next(self._sampled)
        self.count[req_id] = self.count.get(req_id, 0) + 1
        return EOS if self.count[req_id] == self.eos_after.get(req_id) else 100 + req_id


def request(req_id: int, prompt_len: int, max_new_tokens: int, **sampling) -> GenerateReq:
    return GenerateReq(req_id, [5] * prompt_len, SamplingParams(max_new_tokens=max_new_tokens, **sampling))


def make_core(runner, budget=10_000, chunk=64, overlap=True):
    return EngineCore(Scheduler(budget, chunk, 1000), runner, eos_token_ids=[EOS], overlap=overlap)


def idle(core, runner) -> bool:
    """No request holds a slot; what is in use is exactly what the prefix cache holds."""
    scheduler = core.scheduler
    return runner.own == {} and runner.used == scheduler.slots_used == scheduler.cached_tokens and not scheduler.tokens_used


def by_request(outs) -> dict[int, list]:
    got: dict[int, list] = {}
    for out in outs:
        got.setdefault(out.req_id, []).append(out)
    return got


@pytest.mark.parametrize("overlap", [True, False])
def test_requests_run_to_max_new_tokens_or_eos(overlap):
    runner = ScriptedRunner(eos_after={1: 3, 2: 2})
    core = make_core(runner, overlap=overlap)
    core.add(request(0, 4, 5))
    core.add(request(1, 4, 5))
    core.add(request(2, 4, 5, ignore_eos=True))
    got = by_request(core.drain())
    assert [len(got[i]) for i in range(3)] == [5, 3, 5]
    assert [got[i][-1].finish_reason for i in range(3)] == [FinishReason.LENGTH, FinishReason.EOS, FinishReason.LENGTH]
    assert all(out.finish_reason is None for i in range(3) for out in got[i][:-1])
    assert idle(core, runner)


def test_abort_frees_a_running_request_and_ignores_unknown_ids():
    runner = ScriptedRunner()
    core = make_core(runner)
    core.add(request(0, 4, 1000))
    core.add(request(1, 4, 3))
    outs = [out for _ in range(5) for out in core.step()]
    assert 0 in runner.kv
    assert core.abort(0)
    outs += core.step()
    assert 0 not in runner.kv
    outs += core.drain()
    got = by_request(outs)
    assert got[1][-1].finish_reason is FinishReason.LENGTH and len(got[1]) == 3
    assert all(out.finish_reason is None for out in got[0])  # no token after the abort
    assert not core.abort(1) and not core.abort(99)  # finished, never seen
    assert idle(core, runner)


def test_abort_of_a_waiting_request_never_runs_it():
    runner = ScriptedRunner(budget=20)
    core = make_core(runner, budget=20)
    core.add(request(0, 4, 16))  # its cap (19) plus the lag fills the budget
    core.add(request(1, 4, 10))
    outs = core.step()
    assert 1 in core.scheduler.waiting
    core.abort(1)
    assert set(by_request(outs + core.drain())) == {0}


def test_a_failing_step_gets_errors_and_serving_goes_on():
    runner = ScriptedRunner(poison=666)
    core = make_core(runner)
    core.add(request(0, 4, 20))
    outs = core.step() + core.step()
    core.add(GenerateReq(1, [5, 666], SamplingParams(max_new_tokens=5)))
    outs += core.step()
    got = by_request(outs)
    assert got[1] == [got[1][0]] and got[1][0].finish_reason is FinishReason.ERROR
    assert "poisoned prompt" in got[1][0].error
    assert got[0][-1].finish_reason is FinishReason.ERROR  # it shared the failed step
    core.add(request(2, 4, 6))
    later = by_request(core.drain())
    assert len(later[2]) == 6 and later[2][-1].finish_reason is FinishReason.LENGTH
    assert idle(core, runner)


def test_a_prompt_the_model_cannot_take_is_refused_alone():
    runner = ScriptedRunner()
    core = EngineCore(Scheduler(10_000, 64, 1000), runner, eos_token_ids=[EOS], vocab_size=1000)
    core.add(request(0, 4, 5))
    (refused,) = core.add(GenerateReq(1, [5, 1000], SamplingParams(max_new_tokens=5)))
    assert refused.req_id == 1 and refused.finish_reason is FinishReason.ERROR and "out of range" in refused.error
    assert core.add(GenerateReq(2, [], SamplingParams()))[0].finish_reason is FinishReason.ERROR
    got = by_request(core.drain())
    assert set(got) == {0} and len(got[0]) == 5 and idle(core, runner)
