"""Decode padded to bucket sizes (the CUDA-graph path, run eagerly on CPU) equals the unpadded
decode, and its padding rows touch nothing but the token table's scratch slot.

Tiny random models from helpers.models; running_max_req_size 8 gives buckets 1, 2, 4, 8,
and the schedules run batches of 3, 5, 6 and 7 requests, so every step is padded. Logits
agree to atol = rtol = 1e-5, not bit for bit: CPU matmuls block by row count, so a row's fp32
result moves in the last bits with the batch size (observed <= 4e-6); tokens are equal.
"""

import pytest
import torch
from helpers.models import make_model, make_runner, random_prompts

from lightllm.engine.request import SamplingParams
from lightllm.engine.cuda_graph import decode_buckets
from benchmark.lib.direct_step import run_step

PROMPT_LENS = (3, 17, 9, 1, 30, 6, 12)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_new_tokens=64)


def test_buckets_cover_every_batch_size():
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(300)[-3:] == [224, 256, 300]
    big = decode_buckets(1000)
    assert big[:5] == [1, 2, 4, 8, 16] and big[-3:] == [896, 960, 1000] and big == sorted(set(big))


def run_mixed_schedule(runner, prompts):
    """Prefill 5 (greedy and seeded sampling), decode, add 2, decode 7, free 1, decode 6, free 3,
    decode 3. Returns every step's tokens."""
    params = [SamplingParams() if i % 2 else SAMPLED for i in range(len(prompts))]
    reqs = [(i, p, params[i]) for i, p in enumerate(prompts)]
    steps = [run_step(runner, prompts=reqs[:5])]
    steps += [run_step(runner, [4, 0, 2, 1, 3]) for _ in range(2)]
    steps.append(run_step(runner, prompts=reqs[5:]))
    steps += [run_step(runner, [0, 1, 2, 3, 4, 5, 6]) for _ in range(3)]
    runner.free([2])
    steps += [run_step(runner, [6, 5, 4, 3, 1, 0]) for _ in range(2)]
    runner.free([0, 3, 6])
    steps += [run_step(runner, [5, 1, 4]) for _ in range(3)]
    runner.free([1, 4, 5])
    return [[tok for tok, _ in out] for out in steps]


@pytest.mark.parametrize("name", ["llama_gqa_llama3_rope", "qwen2_bias_tied"])
def test_padded_decode_equals_unpadded(name, tmp_path, captured_logits):
    make_model(name, tmp_path)
    prompts = random_prompts(5, lengths=PROMPT_LENS)
    runs = {}
    for cuda_graph in (False, True):
        captured_logits.clear()
        runner = make_runner(tmp_path, cuda_graph=cuda_graph)
        assert (runner.graphs is not None) == cuda_graph
        runs[cuda_graph] = run_mixed_schedule(runner, prompts), list(captured_logits)
        assert runner.stats()["tokens_used"] == 0 and runner.req_table.free_count == 8
    (plain_tokens, plain_logits), (padded_tokens, padded_logits) = runs[False], runs[True]
    assert padded_tokens == plain_tokens
    assert len(padded_logits) == len(plain_logits)
    for padded, plain in zip(padded_logits, plain_logits):
        assert padded.shape == plain.shape  # the padding rows' logits are dropped
        torch.testing.assert_close(padded, plain, atol=1e-5, rtol=1e-5)


def test_padding_rows_touch_only_the_scratch_slot(tmp_path):
    make_model("llama_gqa_llama3_rope", tmp_path)
    runner = make_runner(tmp_path, tokens=128)
    table, rows = runner.token_table, runner.req_table
    gen = torch.Generator().manual_seed(11)
    for cache in table.k + table.v:  # random contents, so that any stray write shows
        cache.copy_(torch.randn(cache.shape, generator=gen))
    prompts = random_prompts(6, lengths=(5, 11, 2))
    run_step(runner, prompts=[(i, p, SamplingParams()) for i, p in enumerate(prompts)])
    for _ in range(4):  # 3 requests run as a bucket of 4: one padding row per step
        before_k = [k.clone() for k in table.k]
        before_v = [v.clone() for v in table.v]
        before_rows, before_free = rows.req_to_token.clone(), table.free_count
        run_step(runner, [0, 1, 2])
        assert table.free_count == before_free - 3 == int(table.mem_state.sum())
        changed_entries = (rows.req_to_token != before_rows).nonzero().tolist()
        running = [runner.reqs[i] for i in (0, 1, 2)]
        assert sorted(changed_entries) == sorted([r.row, r.seq_len - 1] for r in running)
        new_slots = {int(rows.req_to_token[r.row, r.seq_len - 1]) for r in running}
        for before, after in zip(before_k + before_v, table.k + table.v):
            changed = set((before != after).any(-1).any(-1).nonzero().flatten().tolist())
            assert changed <= new_slots | {table.scratch_slot}
            assert new_slots <= changed
    assert table.scratch_slot == table.size and rows.req_to_token[rows.padding_row, 0] == table.scratch_slot
    runner.free([0, 1, 2])
    assert table.free_count == table.size == int(table.mem_state.sum()) and rows.free_count == rows.max_reqs
