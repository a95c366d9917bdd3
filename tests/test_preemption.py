"""Preemption under the priority policy, through the engine on a tiny model (CPU, fp32): a running
request preempted for a more urgent one starts again from its outputs so far and answers what it
answers alone, token for token, greedy and seeded sampling with penalties, min_tokens and a bad
word of two tokens alike; with the prefix cache (its KV found again) and without (computed again)."""

import pytest
from helpers.models import assert_idle, make_model, make_runner, random_prompts

from lightllm.engine.core import EngineCore
from lightllm.engine.request import FinishReason, GenerateReq, SamplingParams
from lightllm.engine.scheduler import Scheduler

LOW, URGENT = 0, 1

PARAMS = {
    "greedy": SamplingParams(max_new_tokens=24, ignore_eos=True),
    "sampled": SamplingParams(max_new_tokens=24, ignore_eos=True, do_sample=True, temperature=0.9, top_p=0.95,
                              seed=7, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2,
                              min_tokens=20, stop_token_ids=[3], bad_words_ids=[(4, 5)]),
}


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("llama")
    make_model("llama_gqa_llama3_rope", model_dir)
    return make_runner(model_dir, tokens=256, running_max_req_size=1, max_req_total_len=96)


def core_on(runner, prefix_cache: bool) -> EngineCore:
    scheduler = Scheduler(runner.max_total_token_num, 16, runner.req_table.max_reqs, "priority",
                          prefix_cache=prefix_cache)
    return EngineCore(scheduler, runner, eos_token_ids=[])


def collect(outs, got: dict) -> None:
    for out in outs:
        got.setdefault(out.req_id, []).append(out)


def alone(runner, prompt, params) -> list[int]:
    core = core_on(runner, prefix_cache=False)
    core.add(GenerateReq(LOW, prompt, params))
    got = {}
    collect(core.drain(), got)
    assert_idle(core)
    return [o.token_id for o in got[LOW]]


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("kind", list(PARAMS))
def test_a_preempted_request_answers_what_it_answers_alone(runner, kind, prefix_cache):
    low_prompt, urgent_prompt = random_prompts(5, lengths=(11, 7))
    params = PARAMS[kind]
    expected = alone(runner, low_prompt, params)
    urgent_alone = alone(runner, urgent_prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    core = core_on(runner, prefix_cache)
    core.add(GenerateReq(LOW, low_prompt, params, priority=5))
    got = {}
    while len(got.get(LOW, [])) < 8:  # one running slot, the low request's, well into its decode
        collect(core.step(), got)
    core.add(GenerateReq(URGENT, urgent_prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), priority=0))
    order = []
    while core.has_work:
        outs = core.step()
        order += [o.req_id for o in outs]
        collect(outs, got)
    assert core.scheduler.num_preemptions == 1
    assert [o.token_id for o in got[URGENT]] == urgent_alone
    assert [o.token_id for o in got[LOW]] == expected
    assert [o.finish_reason for o in got[LOW]] == [None] * (len(expected) - 1) + [FinishReason.LENGTH]
    assert order.index(URGENT) < len(order) - order[::-1].index(LOW) - 1 and order[0] == URGENT  # urgent first
    assert_idle(core)


def test_no_preemption_among_equals(runner):
    """A waiting request of the running one's priority waits for it (preemption is strict)."""
    prompt = random_prompts(6, lengths=(9,))[0]
    core = core_on(runner, prefix_cache=True)
    core.add(GenerateReq(LOW, prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), priority=3))
    core.step()
    core.add(GenerateReq(URGENT, prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), priority=3))
    order = []
    while core.has_work:
        order += [o.req_id for o in core.step()]
    assert core.scheduler.num_preemptions == 0 and order == [LOW] * 30 + [URGENT] * 4
    assert_idle(core)
