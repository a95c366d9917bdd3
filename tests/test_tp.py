"""Tensor parallelism on CPU: two gloo ranks give the logits of one rank.

Covers a KV-head split (GQA 4/2), a replicated KV head (MQA: 1 KV head, 2 ranks: each rank
keeps a copy of the one head), q/k/v biases, Qwen3's per-head q/k norms, Gemma's sliding windows,
soft caps and extra norms, tied and untied heads, a vocabulary (101) that does not divide by 2
(padded shards), and Qwen3-MoE's experts (each rank half of every expert's intermediate dimension)
beside a dense layer, and gpt-oss's sinks (split with the q heads) and biased experts (the down
bias added by one rank), and Gemma 4's global layers (one KV head of
their own size, replicated), shared KV, per-layer inputs (replicated) and experts beside the
dense MLP. Tolerance atol = rtol = 1e-4 in fp32 (all-reduce
changes the summation order; observed differences are ~1e-6).
"""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.models import make_model, make_runner, random_prompts, run_schedule

from lightllm.models import ModelConfigError
from lightllm.models.layers import split_even, split_kv_heads
from lightllm.engine import model_runner, sampling
from lightllm.utils.dist import TPGroup

ATOL = RTOL = 1e-4
TP_CASES = ["llama_gqa_llama3_rope", "llama_mqa_tied_theta", "qwen2_bias_tied", "qwen3_head_dim_24",
            "gemma2_window_16", "gemma3_window_16", "qwen3_moe", "gpt_oss", "gemma4", "gemma4_moe"]


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
    results = [schedule_logits(d, seen, tp_rank=rank, tp=world_size, nccl_port=port)
               for d in model_dirs]
    if rank == 0:
        torch.save(results, out_file)
    leave_together()


def leave_together():
    """Both ranks leave the group before either process exits: a rank that exits while gloo's
    threads still serve the other one was seen to abort (std::terminate) under a loaded CPU."""
    dist.barrier()
    dist.destroy_process_group()


def assert_tp2_matches_tp1(tmp_path, worker, tp1_logits):
    """`worker` on 2 ranks over TP_CASES' models (rank 0 saves its logits), against
    `tp1_logits(model_dir, seen)` in this process: the same 9 steps' logits, within ATOL/RTOL."""
    dirs = [tmp_path / name for name in TP_CASES]
    for name, d in zip(TP_CASES, dirs):
        make_model(name, d)
    out_file = tmp_path / "tp2.pt"
    mp.spawn(worker, args=(2, free_port(), dirs, out_file), nprocs=2, join=True)
    tp2 = torch.load(out_file)
    original_sample = model_runner.sample
    try:
        seen = capture_logits()
        tp1 = [tp1_logits(d, seen) for d in dirs]
    finally:
        model_runner.sample = original_sample
    for name, ours, reference in zip(TP_CASES, tp2, tp1):
        assert len(ours) == len(reference) == 9, name
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=name)


def test_tp2_matches_tp1(tmp_path):
    assert_tp2_matches_tp1(tmp_path, tp_worker, schedule_logits)


def test_kv_heads_split_or_replicate():
    assert [split_kv_heads(8, TPGroup(r, 4)) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [split_kv_heads(2, TPGroup(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [split_kv_heads(1, TPGroup(r, 2)) for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(ModelConfigError, match="num_key_value_heads = 3"):
        split_kv_heads(3, TPGroup(0, 2))
    with pytest.raises(ModelConfigError, match="num_attention_heads = 9 is not divisible"):
        split_even(9, TPGroup(0, 2), "num_attention_heads")


# ---- CUDA: tp 2 through the decode CUDA graphs (skipped without two GPUs) ----
# The ranks all-reduce through symmetric memory here (one-shot: 256-byte messages), NCCL
# gathers the logits; decode steps of 2 and 3 requests replay the graphs of buckets 2 and 4.


def cuda_runner(model_dir, rank=0, world_size=1, port=0):
    return make_runner(model_dir, device=f"cuda:{rank}", tp_rank=rank, tp=world_size, nccl_port=port)


def cuda_schedule_logits(model_dir, seen, **kw):
    seen.clear()
    runner = cuda_runner(model_dir, **kw)
    assert runner.tp.world_size == 1 or runner.tp.symmetric is not None, "symmetric memory was not set up (see the log)"
    run_schedule(runner, random_prompts(3))
    return [logits.cpu() for logits in seen]


def cuda_tp_worker(rank, world_size, port, model_dirs, out_file):
    seen = capture_logits()
    results = [cuda_schedule_logits(d, seen, rank=rank, world_size=world_size, port=port) for d in model_dirs]
    if rank == 0:
        torch.save(results, out_file)
    leave_together()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_cuda_graphs_match_tp1(tmp_path):
    assert_tp2_matches_tp1(tmp_path, cuda_tp_worker, cuda_schedule_logits)


def test_bench_70b_is_llama_3_1_70b_and_splits_over_4_and_8_ranks(default_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from lightllm.models import read_config
    from lightllm.tools.bench_model import write_bench_model

    model_dir = write_bench_model(tmp_path / "bench-70b", "70b", tokenizer_dir=default_model_dir)
    cfg = read_config(model_dir)
    shape = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.head_dim)
    assert shape == (80, 8192, 64, 8, 28672, 128)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["factor"] == 8.0 and cfg.rope_scaling["original_max_position_embeddings"] == 8192
    assert cfg.vocab_size == len(AutoTokenizer.from_pretrained(model_dir, local_files_only=True)) == 49152
    assert not cfg.tie_word_embeddings and cfg.torch_dtype == "bfloat16"
    assert not list(model_dir.glob("*.safetensors"))  # served with --load_format dummy
    for tp in (4, 8):
        assert [split_kv_heads(8, TPGroup(r, tp)) for r in range(tp)] == [(r * 8 // tp, 8 // tp) for r in range(tp)]
        assert split_even(64, TPGroup(tp - 1, tp), "num_attention_heads") == ((tp - 1) * 64 // tp, 64 // tp)
        assert split_even(28672, TPGroup(tp - 1, tp), "intermediate_size")[1] == 28672 // tp
