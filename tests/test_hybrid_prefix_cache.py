"""The prefix cache for the hybrid models (tiny, random, fp32): a prompt that shares a cached prefix
resumes from the snapshot of the linear layers' recurrent and conv states at the deepest snapshot
boundary inside the match, reuses the full-attention layers' KV up to there, prefills the rest,
and still gives transformers' greedy tokens; `cached_tokens` is that snapshot's depth.

Snapshots every 8 tokens with 7-token chunks: a request's chunks are cut at 8, 16, 24 (7 + 1 each),
so a restore at the wrong boundary (or none: the row's state left by an earlier request, or zeros)
changes the tokens. Relies on transformers' Qwen3-Next / Qwen3.5 torch paths and greedy `generate`."""

import pytest
import torch
from helpers.models import assert_idle, hf_greedy, make_runner
from test_hybrid_models import make_hybrid

from lightllm.engine.core import EngineCore
from lightllm.engine.request import GenerateReq, SamplingParams
from lightllm.engine.scheduler import Scheduler

INTERVAL, CHUNK, NEW = 8, 7, 6


def hybrid_engine(runner, interval: int = INTERVAL, budget: int = CHUNK) -> EngineCore:
    scheduler = Scheduler(runner.max_total_token_num, budget, runner.req_table.max_reqs,
                          snapshot_interval=interval, snapshot_slots=runner.info["state_snapshot_slots"])
    return EngineCore(scheduler, runner, eos_token_ids=[])


def serve(core, prompts: list[list[int]], first_id: int, new: int = NEW) -> tuple[list[list[int]], list[int]]:
    """Prompts at once, `new` greedy tokens each: (greedy tokens, cached_tokens) of each."""
    for i, p in enumerate(prompts):
        core.add(GenerateReq(first_id + i, p, SamplingParams(max_new_tokens=new)))
    got = {}
    for out in core.drain():
        got.setdefault(out.req_id, []).append(out)
    ids = range(first_id, first_id + len(prompts))
    return [[o.token_id for o in got[i]] for i in ids], [got[i][0].cached_tokens for i in ids]


# qwen3_5 also with its recurrent states stored in bf16 (--mamba_ssm_cache_dtype): rounded once a token
@pytest.mark.parametrize("name,state_dtype", [("qwen3_next", "auto"), ("qwen3_5", "auto"), ("qwen3_5", "bfloat16")])
def test_a_shared_prefix_resumes_from_its_snapshot_and_equals_transformers(name, state_dtype, tmp_path):
    hf_model = make_hybrid(name, tmp_path)
    runner = make_runner(tmp_path, tokens=512, max_req_total_len=96, running_max_req_size=4, state_snapshot_slots=3,
                         mamba_ssm_cache_dtype=state_dtype)
    assert runner.info["state_snapshot_slots"] == 3 and runner.snapshot_pool.slot_bytes() == runner.state_pool.slot_bytes()
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(0, 101, (40,), generator=gen).tolist()
    tails = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (9, 4, 12)]
    # 40 tokens, then two at once sharing 21 and 17 of them (snapshots at 8, 16, 24, 32: resume at 16),
    # then one sharing 27 (resume at 24) after the others ended
    workload = [[base], [base[:21] + tails[0], base[:17] + tails[1]], [base[:27] + tails[2]]]
    expected = hf_greedy(hf_model, [p for group in workload for p in group], NEW)
    core = hybrid_engine(runner)
    tokens, cached = [], []
    for group in workload:
        t, c = serve(core, group, len(tokens))
        tokens += t
        cached += c
        core.scheduler.cache.check()
    assert tokens == [expected[i] for i in range(len(tokens))]
    assert cached == [0, 16, 16, 24]
    assert core.scheduler.prefix_hit_tokens == 56
    assert_idle(core)
    assert core.scheduler.cache.snapshots_used == 0  # every snapshot went with its node
    core.scheduler.cache.check()


def test_chunks_end_at_snapshot_boundaries_and_snapshots_stay_on_device():
    """A hybrid request's chunks do not cross a multiple of the interval, but for the prompt's last
    one where the step takes the whole rest (16 + 14 here, a step sooner); a chunk ending on one
    leaves a snapshot on its node once it joins the cache; an offloaded node drops its snapshot."""
    from lightllm.common.radix_cache import Offload, Snapshot
    from lightllm.engine.request import Req

    s = Scheduler(1000, 20, 4, host_cache_tokens=100, snapshot_interval=INTERVAL, snapshot_slots=2)
    s.add(Req(GenerateReq(0, list(range(30)), SamplingParams(max_new_tokens=1)), frozenset()))
    lengths, taken = [], []
    for _ in range(4):
        plan = s.schedule()
        lengths += [(c.start, len(c.token_ids)) for c in plan.chunks]
        taken.append([type(op) for op in plan.ops].count(Snapshot))
        s.cache.check()
    assert lengths == [(0, 8), (8, 8), (16, 14)]
    assert taken == [0, 1, 1, 0] and s.cache.snapshots_used == 2
    s.abort(0)
    s.add(Req(GenerateReq(1, list(range(50, 70)), SamplingParams(max_new_tokens=1)), frozenset()))
    s.schedule()
    assert [type(op) for op in s.schedule().ops].count(Snapshot) == 1  # an idle snapshot gave its slot up
    assert s.cache.snapshots_used == 2
    s.abort(1)
    s.schedule()
    assert s.cache.evict(s.cache.total_tokens) and s.cache.snapshots_used == 0
    assert any(isinstance(op, Offload) for op in s._ops)
    s.cache.check()


def test_a_shared_prefixs_followers_take_their_questions_in_one_chunk():
    """Followers resume where their shared prefix ends (20), just before a snapshot boundary (24):
    each takes the rest of its prompt in one chunk (one step to its first token) and leaves no
    snapshot of its own there; the leader still cuts at 20 and leaves the one they resume from."""
    from lightllm.common.radix_cache import Snapshot
    from lightllm.engine.request import Req

    s = Scheduler(1000, 32, 4, snapshot_interval=INTERVAL * 3, snapshot_slots=4)
    prefix = list(range(100, 120))
    for i, tail in enumerate((list(range(9)), list(range(20, 25)), list(range(40, 47)))):
        s.add(Req(GenerateReq(i, prefix + tail, SamplingParams(max_new_tokens=1)), frozenset()))
    chunks, snapshots = [], 0
    for _ in range(4):
        plan = s.schedule()
        chunks += [(c.req_id, c.start, len(c.token_ids)) for c in plan.chunks]
        snapshots += [type(op) for op in plan.ops].count(Snapshot)
        s.cache.check()
    assert chunks == [(0, 0, 20), (0, 20, 9), (1, 20, 5), (2, 20, 7)]
    assert snapshots == 1 and s.cache.snapshots_used == 1  # the prefix's, at 20


WIDE = 64  # a snapshot interval past every shared prefix below: only the cuts leave snapshots


def wide_engine(tmp_path, budget: int):
    """A tiny Qwen3.5 and an engine on it with snapshots every WIDE tokens and 3 slots."""
    hf_model = make_hybrid("qwen3_5", tmp_path)
    runner = make_runner(tmp_path, tokens=512, max_req_total_len=96, running_max_req_size=4, state_snapshot_slots=3)
    return hf_model, hybrid_engine(runner, WIDE, budget)


def three_sharing_20(tmp_path, seed: int, budget: int):
    """wide_engine's engine, three prompts sharing their first 20 tokens, transformers' greedy tokens."""
    hf_model, core = wide_engine(tmp_path, budget)
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 101, (20,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 101, (n,), generator=gen).tolist() for n in (9, 5, 7)]
    return core, prompts, list(hf_greedy(hf_model, prompts, NEW).values())


@pytest.mark.parametrize("budget", [32, 12])
def test_requests_admitted_together_resume_where_their_shared_prefix_ends(budget, tmp_path):
    """Three prompts at once sharing 20 tokens (no multiple of the interval inside): the first's
    chunks end at 20 (in one chunk, or two with a budget of 12) and leave a snapshot there; the
    others wait until it is cached and resume from it."""
    core, prompts, expected = three_sharing_20(tmp_path, 5, budget)
    tokens, cached = serve(core, prompts, 0)
    assert tokens == expected
    assert cached == [0, 20, 20]
    assert not core.scheduler._leaders  # the leader is forgotten once it stops prefilling
    assert_idle(core)
    core.scheduler.cache.check()


def test_a_prefix_cached_inside_an_interval_is_snapshotted_by_the_next_request_that_shares_it(tmp_path):
    """One prompt served alone, then a second sharing its first 20 tokens: the second resumes from
    nothing (no snapshot at 20) but computes those 20 in a chunk of their own and leaves a
    snapshot there, from which a third resumes."""
    core, prompts, expected = three_sharing_20(tmp_path, 6, 32)
    tokens, cached = [], []
    for i, prompt in enumerate(prompts):
        t, c = serve(core, [prompt], i)
        tokens += t
        cached += c
        core.scheduler.cache.check()
    assert tokens == expected
    assert cached == [0, 0, 20]
    assert_idle(core)
    core.scheduler.cache.check()


def test_a_group_whose_prompts_begin_like_a_cached_one_still_shares_its_prefix(tmp_path):
    """A prompt served alone, then three at once sharing 20 tokens of their own whose first 3 are
    the first prompt's too (a chat template's header, say): the leader resumes from nothing and
    computes those 3 again, its copy of them gives way to the cache's (Adopt) and the rest of its
    chunk joins the cache below them with a snapshot at 20, so the two others resume there. Every
    token is transformers' and no slot is left over (with the leader's copy kept instead, its
    chunk never joined the cache and both others computed all 20 again)."""
    hf_model, core = wide_engine(tmp_path, 32)
    gen = torch.Generator().manual_seed(8)
    header = torch.randint(0, 101, (3,), generator=gen).tolist()
    alone = header + torch.randint(0, 101, (12,), generator=gen).tolist()
    prefix = header + torch.randint(0, 101, (17,), generator=gen).tolist()
    group = [prefix + torch.randint(0, 101, (n,), generator=gen).tolist() for n in (9, 5, 7)]
    expected = list(hf_greedy(hf_model, [alone] + group, NEW).values())
    tokens, cached = serve(core, [alone], 0)
    more, more_cached = serve(core, group, 1)
    assert tokens + more == expected
    assert cached + more_cached == [0, 0, 20, 20]
    assert_idle(core)
    core.scheduler.cache.check()


def test_a_chats_next_turn_resumes_where_the_last_one_ended(tmp_path):
    """A request leaves a snapshot of its state at the end of what it cached (its prompt and every
    token it fed back), so the next turn of the chat, which repeats them, resumes there."""
    hf_model, core = wide_engine(tmp_path, 32)
    gen = torch.Generator().manual_seed(7)
    first = torch.randint(0, 101, (13,), generator=gen).tolist()
    answer, cached = serve(core, [first], 0)
    second = first + answer[0] + torch.randint(0, 101, (5,), generator=gen).tolist()
    tokens, cached_next = serve(core, [second], 1)
    assert [answer[0], tokens[0]] == list(hf_greedy(hf_model, [first, second], NEW).values())
    assert cached == [0] and cached_next == [len(first) + NEW - 1]  # its last token was never fed back
    assert_idle(core)
    core.scheduler.cache.check()
