"""Tensor parallelism on CPU: two gloo ranks give the logits of one rank.

Covers a KV-head split (GQA 4/2), a replicated KV head (MQA: 1 KV head, 2 ranks: each rank
keeps a copy of the one head), q/k/v biases, tied and untied heads, and a vocabulary (101)
that does not divide by 2 (padded shards). Tolerance atol = rtol = 1e-4 in fp32 (all-reduce
changes the summation order; observed differences are ~1e-6).
"""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from test_model_vs_hf import make_model, make_runner, random_prompts, run_schedule

from lightllm.models import ModelConfigError
from lightllm.models.layers import split_even, split_kv_heads
from lightllm.engine import model_runner, sampling
from lightllm.utils.dist import TPGroup

ATOL = RTOL = 1e-4
TP_CASES = ["llama_gqa_llama3_rope", "llama_mqa_tied_theta", "qwen2_bias_tied"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def capture_logits():
    seen = []

    def capture(logits, batch):
        seen.append(logits.clone())
        return sampling.sample(logits, batch)

    model_runner.sample = capture
    return seen


def schedule_logits(model_dir, seen, **kw):
    seen.clear()
    runner = make_runner(model_dir, **kw)
    run_schedule(runner, random_prompts(3))
    assert runner.stats()["tokens_used"] == 0
    return list(seen)


def tp_worker(rank, world_size, port, model_dirs, out_file):
    seen = capture_logits()
    results = [schedule_logits(d, seen, tp_rank=rank, world_size=world_size, nccl_port=port)
               for d in model_dirs]
    if rank == 0:
        torch.save(results, out_file)


def test_tp2_matches_tp1(tmp_path):
    dirs = [tmp_path / name for name in TP_CASES]
    for name, d in zip(TP_CASES, dirs):
        make_model(name, d)
    out_file = tmp_path / "tp2.pt"
    mp.spawn(tp_worker, args=(2, free_port(), dirs, out_file), nprocs=2, join=True)
    tp2 = torch.load(out_file)
    original_sample = model_runner.sample
    try:
        seen = capture_logits()
        tp1 = [schedule_logits(d, seen) for d in dirs]
    finally:
        model_runner.sample = original_sample
    for name, ours, reference in zip(TP_CASES, tp2, tp1):
        assert len(ours) == len(reference) == 7, name
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=name)


def test_kv_heads_split_or_replicate():
    assert [split_kv_heads(8, TPGroup(r, 4)) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [split_kv_heads(2, TPGroup(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [split_kv_heads(1, TPGroup(r, 2)) for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(ModelConfigError, match="num_key_value_heads = 3"):
        split_kv_heads(3, TPGroup(0, 2))
    with pytest.raises(ModelConfigError, match="num_attention_heads = 9 is not divisible"):
        split_even(9, TPGroup(0, 2), "num_attention_heads")
