"""A hybrid model's steps padded to the CUDA graphs' buckets (the graph path run eagerly on the
CPU), against the same steps unpadded and against transformers: a tiny Qwen3.5 (3 Gated DeltaNet
layers, 1 full attention; fp32).

The schedule cuts one prompt across the delta rule's 64-token blocks and across steps, puts decodes
beside chunks (a padded mixed step's decode rows then run over chunk tokens and padding), several
chunks in a step (padding chunks beside them), and decode batches that their bucket pads. Every
state slot starts random, so a fresh chunk that read its slot, or padding that wrote a request's,
shows. After every step both runners hold the same tokens and the same states in every request's
slot; padding reads and writes no state (the padding row's slot ends as it started); each
request's greedy tokens are transformers' `generate`.
"""

import torch
from helpers.models import hf_greedy, make_runner, random_prompts
from test_hybrid_models import TEXT, make_hybrid

from lightllm.engine.cuda_graph import FEW_GRAPH_CHUNKS, MAX_GRAPH_CHUNKS, StepGraphs
from lightllm.engine.plan import Chunk, Release, StepPlan
from lightllm.engine.request import SamplingParams

GREEDY = SamplingParams()
DECODE_STEPS = 5


def schedule(prompts):
    """(decodes, chunks, ops) in order; every request's first token comes from its last chunk."""
    p0, p1, p2, p3 = prompts
    plans = [([], [Chunk(0, p0[:40], 0, False, GREEDY), Chunk(1, p1, 0, True, GREEDY)], []),
             ([1], [Chunk(0, p0[40:], 40, True), Chunk(2, p2[:11], 0, False, GREEDY)], []),
             ([0, 1], [Chunk(2, p2[11:], 11, True), Chunk(3, p3, 0, True, GREEDY)], [])]
    plans += [([3, 2, 1, 0][: 3 + i % 2], [], []) for i in range(DECODE_STEPS)]  # batches of 3 (bucket 4) and 4
    return plans + [([], [], [Release(i) for i in range(4)])]


def run(runner, plans):
    """Each request's tokens, and after every step the states of the request rows in use."""
    tokens, states = {}, []
    for i, (decodes, chunks, ops) in enumerate(plans):
        plan = StepPlan(100 + i, decodes, chunks, ops=ops, sync=True)
        for result in runner.step(plan):
            for req_id, t in zip(plan.sampled, result.tokens):
                tokens.setdefault(req_id, []).append(t.token_id)
        rows = sorted(r.row for r in runner.reqs.values())
        pool = runner.state_pool
        states.append([s[rows].clone() for s in pool.conv + pool.recurrent])
    return tokens, states


def record_replays(monkeypatch) -> list[tuple]:
    """Each graph replay from now on, in order: ("run", its decode bucket) or ("run_mixed", its
    tokens, its chunk slots)."""
    replays = []
    for method in ("run", "run_mixed"):
        original = getattr(StepGraphs, method)
        monkeypatch.setattr(StepGraphs, method, lambda self, meta, *a, m=method, f=original: replays.append(
            (m, meta.shape[-1]) if m == "run" else (m, a[0].tokens, a[0].chunks)) or f(self, meta, *a))
    return replays


def padded_and_plain(tmp_path, plans, **runner_args):
    """run() of `plans` without graphs and then padded to them, from the same random state slots;
    asserts each leaves no token in use and the padding row's slot as it was."""
    runs = {}
    for graphs in (False, True):
        runner = make_runner(tmp_path, cuda_graph=graphs, **runner_args)
        gen = torch.Generator().manual_seed(7)
        slots = runner.state_pool.conv + runner.state_pool.recurrent
        for state in slots:
            state.copy_(torch.randn(state.shape, generator=gen))
        padding = [s[runner.req_table.max_reqs].clone() for s in slots]  # the padding row's slot
        runs[graphs] = run(runner, plans)
        assert runner.stats()["tokens_used"] == 0
        assert all(torch.equal(s[runner.req_table.max_reqs], p) for s, p in zip(slots, padding)), "padding: no state"
    return runs[False], runs[True]


def assert_same_run(plain, padded):
    (plain_tokens, plain_states), (padded_tokens, padded_states) = plain, padded
    assert padded_tokens == plain_tokens
    for plain_step, padded_step in zip(plain_states, padded_states):
        for a, b in zip(plain_step, padded_step):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)  # CPU GEMMs block by the padded rows


def test_padded_hybrid_steps_equal_unpadded_and_transformers(tmp_path, monkeypatch):
    hf_model = make_hybrid("qwen3_5", tmp_path)
    prompts = random_prompts(3, lengths=(70, 9, 33, 5), vocab=TEXT["vocab_size"])
    plans = schedule(prompts)
    replays = record_replays(monkeypatch)
    plain, padded = padded_and_plain(tmp_path, plans, tokens=256, max_req_total_len=96, running_max_req_size=6,
                                     cuda_graph_max_tokens=96)
    # mixed steps of 49, 42 and 29 tokens in buckets of 64 and 32, two chunks each: the few chunk slots;
    # decode batches of 3 and 4 in bucket 4
    few = FEW_GRAPH_CHUNKS
    assert replays == [("run_mixed", 64, few), ("run_mixed", 64, few), ("run_mixed", 32, few)] + \
        [("run", 4)] * DECODE_STEPS
    assert_same_run(plain, padded)
    padded_tokens = padded[0]
    expected = hf_greedy(hf_model, prompts, max(len(t) for t in padded_tokens.values()))
    assert padded_tokens == {i: expected[i][: len(t)] for i, t in padded_tokens.items()}


def test_a_step_of_more_chunks_than_the_few_slots_takes_the_full_bucket(tmp_path, monkeypatch):
    """A hybrid model's mixed buckets come in two chunk tiers: a step of FEW_GRAPH_CHUNKS + 2
    prompts replays a bucket of MAX_GRAPH_CHUNKS slots (a non-hybrid model has that tier only),
    padded as the unpadded step runs, tokens and states."""
    make_hybrid("qwen3_next", tmp_path)
    n = FEW_GRAPH_CHUNKS + 2
    prompts = random_prompts(5, lengths=(3,) * n, vocab=TEXT["vocab_size"])
    plans = [([], [Chunk(i, p, 0, True, GREEDY) for i, p in enumerate(prompts)], []),
             (list(range(n)), [Chunk(n, prompts[0], 0, True, GREEDY)], []),  # a step of one chunk beside them
             (list(range(n + 1)), [], []), ([], [], [Release(i) for i in range(n + 1)])]
    replays = record_replays(monkeypatch)
    plain, padded = padded_and_plain(tmp_path, plans, tokens=256, max_req_total_len=16, running_max_req_size=n + 2,
                                     cuda_graph_max_tokens=64)
    assert replays[:2] == [("run_mixed", 32, MAX_GRAPH_CHUNKS), ("run_mixed", 16, FEW_GRAPH_CHUNKS)]
    assert_same_run(plain, padded)
    assert [len(padded[0][i]) for i in range(n + 1)] == [3] * n + [2]
