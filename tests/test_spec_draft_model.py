"""Speculative decoding with a draft model: its proposals are the draft model's own greedy chain
(against transformers on the draft's weights), the engine's output is the target's greedy output
(against transformers on the target's weights), and the draft's KV is counted in the budget."""

import json

import pytest
from helpers.models import Client, assert_idle, engine, hf_greedy, make_model, make_runner, random_prompts

from lightllm.engine.plan import Chunk, DraftRequest, StepPlan
from lightllm.engine.request import SamplingParams
from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.engine.spec.controller import SPEC_PROBE_EVERY, Speculator
from lightllm.engine.spec.drafts import ModelDraft


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target dir, its transformers model, draft dir, the draft's transformers model): a smaller
    draft of the same vocabulary, other weights."""
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    hf_target = make_model("llama_gqa_llama3_rope", target, seed=0)
    hf_draft = make_model("llama_mha", draft, seed=5, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2)
    return target, hf_target, draft, hf_draft


def draft_runner(target, draft, k=4, **settings):
    config = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})
    return make_runner(target, tokens=512, max_req_total_len=96, speculative_config=config, **settings)


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["padded", "eager"])
def test_proposals_are_the_draft_models_greedy_chain(models, cuda_graph):
    """After a prompt (in two catch-up calls, one of them catch-up only) and after a verify step
    that rejected drafts, each proposal is transformers' greedy continuation on the draft's
    weights of the request's tokens so far (single-token steps as the draft's padded decode
    steps, graphs on a GPU, or eager chunks)."""
    target, _, draft, hf_draft = models
    runner = draft_runner(target, draft, k=5, cuda_graph=cuda_graph)
    prompt = random_prompts(3, lengths=(23,))[0]
    (result,) = runner.step(StepPlan(1, [], [Chunk(0, prompt, 0, True, SamplingParams())], sync=True))
    tokens = prompt + [result.tokens[0].token_id]
    (_, drafted), = runner.draft([DraftRequest(0, 0, tuple(tokens[:10]), 0)])
    assert drafted == 10
    (drafts, drafted), = runner.draft([DraftRequest(0, 10, tuple(tokens[10:]), 5)])
    assert drafted == len(tokens) - 1
    assert list(drafts) == hf_greedy(hf_draft, [tokens], 5)[0]
    wrong = [(d + 1) % 101 for d in drafts]  # all rejected: the target's token comes back alone
    (result,) = runner.step(StepPlan(2, [0], drafts={0: wrong}, sync=True))
    tokens += [t.token_id for t in result.tokens]
    (drafts, _), = runner.draft([DraftRequest(0, drafted, tuple(tokens[drafted:]), 3)])
    assert list(drafts) == hf_greedy(hf_draft, [tokens], 3)[0]
    runner.free([0])
    assert runner.token_table.used_count == 0


def test_a_proposal_that_skips_positions_is_refused(models):
    """Tokens from past the draft KV's length get no drafts, and the answer says where it ends; so
    does an ask while a step is in flight."""
    target, _, draft, _ = models
    runner = draft_runner(target, draft)
    runner.step(StepPlan(1, [], [Chunk(7, list(range(1, 12)), 0, True, SamplingParams())], sync=True))
    assert runner.draft([DraftRequest(7, 4, tuple(range(5, 12)) + (3,), 2)]) == [((), 0)]
    assert runner.draft([DraftRequest(8, 0, (1, 2), 2)]) == [((), 0)]  # not running
    runner.step(StepPlan(2, [7]))  # in flight: the request's length is not settled yet
    assert runner.draft([DraftRequest(7, 0, tuple(range(1, 14)), 2)]) == [((), 0)]  # 13: its length once settled
    runner.step(StepPlan(3, [], sync=True))


@pytest.mark.parametrize("chunk", [4, 64])
def test_greedy_with_a_draft_model_equals_transformers(models, chunk):
    """Through the engine (chunked prefill, the prefix cache, step in flight): the target's greedy
    tokens, with drafts both accepted and rejected; with the target as its own draft nearly all are."""
    target, hf_target, draft, _ = models
    prompts = random_prompts(chunk, lengths=(3, 17, 9, 30))
    expected = hf_greedy(hf_target, prompts, 20)
    for draft_dir in (draft, target):
        runner = draft_runner(target, draft_dir)
        core = engine(runner, chunk)
        spec = Speculator(SpeculativeConfig.parse(runner.engine_config.speculative_config), 101,
                          runner.req_table.max_reqs * 5, drafter=runner.draft)
        spec.measured(False, 1, 0.01)  # a flat step cost: drafts pay while any is accepted
        spec.global_alpha = 0.9
        spec.guard = None  # the per-step choice alone: this checks the tokens, not the guard
        core.scheduler.speculator = spec
        got = Client(core).run(prompts + prompts[:1], SamplingParams(max_new_tokens=20))
        assert got == [expected[i] for i in range(len(prompts))] + [expected[0]]
        assert spec.num_draft_tokens > 0
        if draft_dir == target:
            assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens
        else:
            assert spec.num_accepted_tokens < spec.num_draft_tokens
        assert_idle(core)


def test_the_draft_kv_is_in_the_budget(models):
    """Each target slot has a row of the draft's KV, and each request row k_max scratch rows."""
    target, _, draft, _ = models
    runner = draft_runner(target, draft, k=3)
    plain = make_runner(target, tokens=512, max_req_total_len=96)
    per_token, fixed = runner.kv_bytes()
    draft_token = 2 * 1 * 2 * 16 * 4  # one layer, 2 KV heads of 16, K and V, fp32
    assert per_token == plain.kv_bytes()[0] + draft_token
    rows = runner.req_table.max_reqs + 1
    assert fixed == (1 + rows * 3) * draft_token  # the padding rows' slot and the scratch rows
    assert runner.drafter.kv.size == 512 + 1 + rows * 3
    assert runner.drafter.kv.scratch_slot == runner.token_table.scratch_slot  # the padding row's, for both


def test_catch_up_is_bounded_a_call():
    """A call catches up on at most its budget: a request whose whole catch-up fits comes with its
    drafts, one that does not waits for a call with room, and a prompt longer than a whole call
    catches up over several calls (no drafts until done), from where the workers say it ends."""
    calls = []

    def drafter(asks):
        calls.append([(a.req_id, a.start, len(a.tokens), a.k) for a in asks])
        return [((9,) * a.k, a.start + len(a.tokens) - (1 if a.k else 0)) for a in asks]

    source = ModelDraft(drafter, catch_up_tokens=8)
    source.start(1, list(range(20)))
    source.start(2, [3, 4])
    source.start(3, [5, 6, 7, 8, 9, 10])
    assert source.propose_many({1: 2, 2: 2}) == {}  # request 1 alone, a part of its prompt
    assert calls[-1] == [(1, 0, 8, 0)]
    assert source.propose_many({2: 2, 3: 2, 1: 2}) == {2: [9, 9], 3: [9, 9]}
    assert calls[-1] == [(2, 0, 2, 2), (3, 0, 6, 2)]  # request 1's 12 tokens wait
    assert source.propose_many({1: 3}) == {}
    assert calls[-1] == [(1, 8, 8, 0)]
    assert source.propose_many({1: 3, 2: 1}) == {1: [9, 9, 9], 2: [9]}
    assert calls[-1] == [(1, 16, 4, 3), (2, 1, 1, 1)]
    assert source.last_catch_up == 5


def test_draft_model_config_needs_a_model():
    with pytest.raises(ValueError, match="needs \"model\""):
        SpeculativeConfig.parse({"method": "draft_model"})
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "/x"}).model == "/x"


def test_no_shadow_proposals_with_a_draft_model():
    """Proposals cost device time: none is made to measure acceptance; requests may speculate at once."""
    calls = []
    spec = Speculator(SpeculativeConfig("draft_model", model="/x"), 101, 8,
                      drafter=lambda asks: calls.append(asks) or [((), 0)] * len(asks))
    req = spec.start(1, [1, 2, 3])
    spec.shadow_drafts([(1, req)])
    assert not calls and req.measured and spec.limit(req) == spec.k_max


def test_draft_cost_is_a_line_through_its_calls():
    from lightllm.engine.spec.controller import DraftCost

    cost = DraftCost()
    assert cost(4) == 0.0
    cost.add(2, 0.004)
    assert cost(4) == pytest.approx(0.008)  # one chain length seen: proportional
    for chain in (1, 3, 5, 8, 2):
        cost.add(chain, 0.002 + 0.0003 * chain)
    assert cost(6) == pytest.approx(0.002 + 0.0018, rel=0.15)  # the old point has faded


@pytest.mark.parametrize("step_ms, expected", [(0.3, range(6, 9)), (5.0, None)])
def test_the_controller_counts_the_draft_models_steps(step_ms, expected):
    """At batch 1 (a 4 ms step, 4.4 ms with 8 drafts), drafts accepted 95% of the time: with cheap
    draft steps (2 ms a call + 0.3 ms a step) most of the 8 pay; with a step as dear as a target's
    none does."""
    spec = Speculator(SpeculativeConfig("draft_model", model="/x", num_speculative_tokens=8), 101, 8,
                      drafter=lambda asks: [])
    spec.guard = None  # the per-step choice alone
    spec._probe_gap = SPEC_PROBE_EVERY  # tried before (its calls are timed below): no first probe due
    spec.measured(False, 1, 0.004)
    spec.measured(False, 300, 0.030)
    spec.measured(True, 9, 0.0044)
    for chain in (1, 4, 8):
        spec.draft_cost.add(chain, 0.002 + step_ms / 1000 * chain)
    counts = spec.allocate([0.95], [8], 1, 1)
    assert counts is None if expected is None else counts[0] in expected


def test_probes_that_bring_nothing_come_ever_further_apart():
    """Probes the rates do not call for (a draft model's are tried whatever the acceptance): the
    first at once (only verification measures a draft model's acceptance), then SPEC_PROBE_EVERY
    steps apart, then twice as far each time, empty calls (catch-up only) included: each would cost
    the step's overlap and a synchronous verify step."""

    spec = Speculator(SpeculativeConfig("draft_model", model="/x"), 101, 8, drafter=lambda asks: [((), 0)] * len(asks))
    spec.measured(False, 1, 0.004)
    spec.measured(True, 5, 0.040)  # drafts never pay: only probes ask for them
    spec.guard = None  # the per-step choice alone
    spec.global_alpha = 0.0
    spec.start(1, [1, 2, 3])
    asked = []
    for step in range(16 * SPEC_PROBE_EVERY):
        counts = spec.allocate([0.0], [4], 1, 1)
        drafts = spec.propose({1: counts[0]}) if counts else {}
        asked += [step] if counts else []
        spec.planned(bool(drafts))
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert asked[0] == 0
    assert gaps == [SPEC_PROBE_EVERY, 2 * SPEC_PROBE_EVERY, 4 * SPEC_PROBE_EVERY, 8 * SPEC_PROBE_EVERY]
