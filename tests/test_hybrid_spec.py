"""Speculative decoding on the hybrid models (tiny, random, fp32): a verify step reads each request's
linear-layer states without moving them, and the commit after it advances them over the accepted
tokens only, so greedy tokens with drafts (all right, some wrong, all wrong; beside plain decodes
and prefill chunks; with chunked prefill and the prefix cache's snapshots) are the tokens without
drafts and transformers'. A state left past a rejected draft changes every later token."""

import random

import pytest
from helpers.models import assert_idle, hf_greedy, make_runner
from helpers.spec import OracleDraft
from test_hybrid_models import make_hybrid
from test_hybrid_prefix_cache import serve
from test_spec_decode import decode, drafted_run, plain_run, prefill

from lightllm.engine.core import EngineCore
from lightllm.engine.plan import Chunk, StepPlan
from lightllm.engine.request import SamplingParams
from lightllm.engine.scheduler import Scheduler
from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.engine.spec.controller import Speculator
from lightllm.kernels.causal_conv1d import (causal_conv1d_chunks_triton, causal_conv1d_runs_triton,
                                            causal_conv1d_step_triton)
from lightllm.kernels.gated_delta_rule import gated_delta_rule_runs_triton, gated_delta_rule_step_triton, linear_gates_triton
from lightllm.kernels.rms_norm import gated_rms_norm_triton
from lightllm.models import qwen3_next

K = 4
SPEC = f'{{"method": "ngram", "num_speculative_tokens": {K}}}'


# "triton": the decode, verify and commit kernels, the prompt's conv, the gates and the gated norm (the CUDA path) in
# the model, under Triton's interpreter here; "graph": 8 request rows, so a verify step's rows (1 + K) fit a decode
# bucket and run padded as its verify graph replays them (eager on the CPU), runs found on the device among padding
@pytest.mark.parametrize("name,kernels", [("qwen3_next", "reference"), ("qwen3_5", "reference"),
                                          ("qwen3_5", "triton"), ("qwen3_next", "graph")])
def test_drafts_right_and_wrong_leave_the_state_at_the_last_accepted_token(name, kernels, tmp_path, monkeypatch):
    if kernels == "triton":
        monkeypatch.setattr(qwen3_next, "causal_conv1d_runs", causal_conv1d_runs_triton)
        monkeypatch.setattr(qwen3_next, "gated_delta_rule_runs", gated_delta_rule_runs_triton)
        monkeypatch.setattr(qwen3_next, "gated_rms_norm", gated_rms_norm_triton)
        monkeypatch.setattr(qwen3_next, "linear_gates", linear_gates_triton)
        monkeypatch.setattr(qwen3_next, "causal_conv1d_step", causal_conv1d_step_triton)
        monkeypatch.setattr(qwen3_next, "gated_delta_rule_step", gated_delta_rule_step_triton)
        monkeypatch.setattr(qwen3_next, "causal_conv1d_chunks", causal_conv1d_chunks_triton)  # the prompt's too
    hf_model = make_hybrid(name, tmp_path)
    runner = make_runner(tmp_path, tokens=256, max_req_total_len=64, running_max_req_size=8 if kernels == "graph" else 3,
                         speculative_config=SPEC)
    padded_verifies = []
    run = runner.graphs.run
    monkeypatch.setattr(runner.graphs, "run", lambda meta, n, *args: padded_verifies.append(args[-1] and n < meta.shape[1])
                        or run(meta, n, *args))
    prompt = [5, 7, 9, 11, 13, 5, 7, 9]
    truth = plain_run(runner, prompt, 24, SamplingParams())
    assert truth == hf_greedy(hf_model, [prompt], 24)[0]
    rng = random.Random(0)
    # under the interpreter (two minutes for all three) drafts partly wrong only: both outcomes in one run
    for wrong in (0.4,) if kernels == "triton" else (0.0, 0.4, 1.0):
        assert drafted_run(runner, prompt, 24, SamplingParams(), truth, wrong, rng) == truth
    assert any(padded_verifies) == (kernels == "graph")


def test_verify_runs_are_found_on_the_device_among_padding():
    """A padded verify step's rows: a request with 3 tokens, one with 1, one with 2, then padding
    (-1): one run a request, at its first row, of its length; nothing at the other rows."""
    import torch

    rows, starts, lengths = qwen3_next.verify_runs(torch.tensor([5, 5, 5, 2, 7, 7, -1, -1]))
    assert rows.tolist() == [5, -1, -1, 2, 7, -1, -1, -1] and starts.tolist() == list(range(8))
    assert lengths.tolist() == [3, 0, 0, 1, 2, 0, 0, 0]


def test_a_verify_beside_plain_decodes_and_a_chunk(tmp_path):
    """One request verifies drafts (one wrong) while another decodes plainly and a third prefills:
    each one's state is its own, and they all go on as without drafts."""
    make_hybrid("qwen3_5", tmp_path)
    runner = make_runner(tmp_path, tokens=256, max_req_total_len=64, running_max_req_size=3, speculative_config=SPEC)
    greedy = SamplingParams()
    prompts = {0: [3, 4, 5, 3, 4], 1: [9, 8, 7, 6], 2: list(range(20, 33))}
    truth = {i: plain_run(runner, p, 10, greedy) for i, p in prompts.items()}
    got = {i: prefill(runner, i, prompts[i], greedy) for i in (0, 1)}
    drafts = {0: truth[0][1:3] + [(truth[0][3] + 1) % 101]}
    (result,) = runner.step(StepPlan(100, [0, 1], [Chunk(2, prompts[2], 0, True, greedy)], drafts=drafts, sync=True))
    for t in result.tokens:
        got.setdefault(t.req_id, []).append(t.token_id)
    assert len(got[0]) == 4 and len(got[1]) == 2
    while any(len(v) < 10 for v in got.values()):
        for t in decode(runner, [i for i in got if len(got[i]) < 10]):
            got[t.req_id].append(t.token_id)
    assert {i: v[:10] for i, v in got.items()} == truth


def spec_hybrid_engine(runner, method: str, drafter=None) -> EngineCore:
    """Chunks of 7, snapshots every 8 tokens, and a controller that gives every decoding request
    all the drafts its source has, at every step (`drafter`: the runner's draft call, for a draft
    run by the runner): what is under test is verification, not the controller's timing."""
    scheduler = Scheduler(runner.max_total_token_num, 7, runner.req_table.max_reqs, snapshot_interval=8,
                          snapshot_slots=runner.info["state_snapshot_slots"])
    config = SpeculativeConfig(method, num_speculative_tokens=K, prompt_lookup_min=1)
    spec = Speculator(config, runner.config.vocab_size, runner.req_table.max_reqs * (1 + K), drafter=drafter)
    spec.guard = None
    spec.allocate = lambda alphas, limits, tokens, outputs: [min(k, K) for k in limits] if alphas else None
    scheduler.speculator = spec
    return EngineCore(scheduler, runner, eos_token_ids=[])


LOOP = [11, 12, 13, 14, 15] * 5  # a prompt that repeats
BASE = [(7 * i + 3) % 101 for i in range(26)]
# then prompts sharing a cached prefix (resumed from its snapshot at 16)
WORKLOAD = [[LOOP, BASE], [BASE[:20] + [1, 2, 3], LOOP[:17] + [40, 41]]]
NEW = 16


@pytest.fixture(scope="module")
def hybrid_expected(tmp_path_factory):
    """A tiny Qwen3-Next and transformers' greedy tokens of the workload (once: its torch path is slow)."""
    path = tmp_path_factory.mktemp("qwen3_next")
    hf_model = make_hybrid("qwen3_next", path)
    flat = [p for group in WORKLOAD for p in group]
    expected = hf_greedy(hf_model, flat, NEW)
    return path, [expected[i] for i in range(len(flat))]


# ngram from one token on: drafts from the repeating prompt, which the random model does not follow
# (rejected); the oracle's are transformers' tokens, 30% of them made wrong (accepted and rejected)
@pytest.mark.parametrize("method", ["ngram", "helpers.spec:OracleDraft"])
def test_the_engine_with_drafts_chunks_and_snapshots_equals_transformers(method, hybrid_expected):
    path, expected = hybrid_expected
    runner = make_runner(path, tokens=512, max_req_total_len=80, running_max_req_size=3, state_snapshot_slots=6,
                         speculative_config=SPEC)
    OracleDraft.ORACLE = {tuple(p): expected[i] for i, p in enumerate(p for group in WORKLOAD for p in group)}
    core = spec_hybrid_engine(runner, method)
    tokens, cached = [], []
    for group in WORKLOAD:
        t, c = serve(core, group, len(tokens), NEW)
        tokens += t
        cached += c
    assert tokens == expected
    assert cached[2:] == [16, 16]
    spec = core.scheduler.speculator
    assert spec.num_draft_tokens > spec.num_accepted_tokens  # drafts were rejected
    assert spec.num_accepted_tokens > 0 or method == "ngram"  # ... and accepted
    assert_idle(core)


