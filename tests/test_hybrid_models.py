"""The hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE with its experts per expert or fused as
published, and a multimodal Qwen3.5 checkpoint's text model; tiny, random, fp32) through the engine core and a real model runner give transformers'
greedy tokens: prompts of 5 to 70 tokens (past the delta rule's 64-token blocks), chunked prefill
cutting the prompts anywhere (7 tokens a chunk: each request's recurrent and conv states must be
carried from chunk to chunk), the same prompt twice at once (n > 1), and more requests than
request rows: the memory (patched) holds the recurrent states of 2 requests only, so the runner
takes 2 rows of the 8 asked for, and requests wait for a row and its state, which later ones reuse.
Relies on transformers' Qwen3-Next / Qwen3.5 modeling code (its torch paths) and greedy `generate`."""

import dataclasses

import pytest
import torch
from helpers.models import Client, assert_idle, engine, hf_greedy, make_runner, randomize_
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)

from lightllm.engine import memory
from lightllm.engine.request import SamplingParams

# one request's state: 3 linear layers x (conv 96 channels x 3 inputs + recurrent 4 heads x 16 x 8) x 4 bytes
SLOT_BYTES = 3 * (96 * 3 + 4 * 16 * 8) * 4
# 3 linear-attention layers and 1 full one (layer_types' default); 4 value heads share 2 key heads
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=101, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=32)
NEW = 12


def fuse_experts(model_dir) -> None:
    """Rewrite the checkpoint's experts as the published Qwen3.5-MoE checkpoints store them:
    mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and mlp.experts.down_proj [E, H, I]."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors, experts = load_file(path), {}
    for name in [n for n in tensors if ".mlp.experts." in n]:
        layer, rest = name.split(".mlp.experts.")
        expert, proj, _ = rest.split(".")
        experts.setdefault(layer, {}).setdefault(proj, {})[int(expert)] = tensors.pop(name)
    for layer, projs in experts.items():
        stack = {proj: torch.stack([by_expert[e] for e in sorted(by_expert)]) for proj, by_expert in projs.items()}
        tensors[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        tensors[f"{layer}.mlp.experts.down_proj"] = stack["down_proj"]
    save_file(tensors, path, metadata={"format": "pt"})


def make_hybrid(name: str, out_dir):
    if name == "qwen3_5_moe_fused":
        model = make_hybrid("qwen3_5_moe", out_dir)
        fuse_experts(out_dir)
        return model
    if name == "qwen3_5_vl":
        config = Qwen3_5Config(text_config=TEXT, vision_config=VISION, attn_implementation="eager")
        model_cls = Qwen3_5ForConditionalGeneration
    else:
        config_cls, model_cls, extra = {
            # experts in layers 0 and 2 (decoder_sparse_step 1, mlp_only_layers), top 2 not renormalised
            "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, dict(EXPERTS, mlp_only_layers=[1, 3],
                                                                       norm_topk_prob=False, tie_word_embeddings=True)),
            "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, {}),
            "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, EXPERTS),
        }[name]
        config = config_cls(**TEXT, **extra, attn_implementation="eager")
    torch.manual_seed(0)
    model = model_cls(config).eval()
    randomize_(model, 0)
    model.save_pretrained(out_dir)
    return model


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = (70, 5, 33)
    out = [torch.randint(0, TEXT["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
    return out + [out[2]]  # the same prompt twice at once, as n = 2 runs it


# Qwen3.5's dense text model is the multimodal checkpoint's; its MoE's per-expert layout is Qwen3-Next's
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe_fused", "qwen3_5_vl"])
def test_chunked_prefill_carries_the_state_and_equals_transformers(name, tmp_path, monkeypatch):
    hf_model = make_hybrid(name, tmp_path)
    room = 3.5 * SLOT_BYTES * 2  # half of it for states (--mamba_full_memory_ratio 1): 3 slots, 2 rows and the padding row
    monkeypatch.setattr(memory, "memory_info", lambda device: (int(room), int(room)))
    runner = make_runner(tmp_path, tokens=512, max_req_total_len=96, running_max_req_size=8, mem_fraction=1.0)
    pool, cfg = runner.state_pool, runner.config
    assert runner.req_table.max_reqs == runner.info["running_max_req_size"] == 2
    assert pool.slots == 3 and pool.slot_bytes() == runner.model.state_slot_bytes() == SLOT_BYTES
    assert len(runner.token_table.k) == cfg.num_kv_layers == 1 and len(pool.recurrent) == 3
    workload = prompts()
    expected = list(hf_greedy(hf_model, workload[:3], NEW).values())
    expected.append(expected[2])
    core = engine(runner, chunk=7, prefix_cache=False)
    assert Client(core).run(workload, SamplingParams(max_new_tokens=NEW)) == expected
    assert_idle(core)


@pytest.mark.parametrize("ratio,rows", [(1.0, 3), (3.0, 5), (1 / 7, 0)])
def test_the_state_rows_take_the_asked_share_of_the_memory_left(ratio, rows, tmp_path, monkeypatch):
    """--mamba_full_memory_ratio r: the running requests' states take r / (1 + r) of the memory left
    (8.25 slots' worth here: 4 at r = 1, 6 at r = 3, 1 at r = 1/7, each less the padding row's), the
    rest goes to the snapshots and the KV cache; a share too small for one request is refused at start."""
    from lightllm.engine.config import EngineConfig

    make_hybrid("qwen3_5", tmp_path)
    room = 8 * SLOT_BYTES + SLOT_BYTES // 4
    monkeypatch.setattr(memory, "memory_info", lambda device: (int(room), int(room)))
    settings = dict(tokens=256, max_req_total_len=64, running_max_req_size=8, mem_fraction=1.0,
                    mamba_full_memory_ratio=ratio)
    if not rows:
        with pytest.raises(ValueError, match="no memory left for the recurrent state"):
            make_runner(tmp_path, **settings)
        return
    runner = make_runner(tmp_path, **settings)
    assert runner.req_table.max_reqs == runner.info["running_max_req_size"] == rows
    assert runner.state_pool.slots == rows + 1
    with pytest.raises(ValueError, match="mamba_full_memory_ratio"):
        EngineConfig(model_dir=str(tmp_path), mamba_full_memory_ratio=0).check()


@pytest.mark.parametrize("flag,config_dtype,expected", [("bfloat16", None, torch.bfloat16),
                                                         ("auto", "bfloat16", torch.bfloat16),
                                                         ("auto", None, torch.float32)])
def test_the_recurrent_states_take_the_asked_dtype_and_are_counted_at_its_size(flag, config_dtype, expected,
                                                                                tmp_path):
    """--mamba_ssm_cache_dtype (auto: the checkpoint's mamba_ssm_dtype, else fp32): the recurrent
    states' pool and the snapshots' in that dtype (the conv states in the model's), each request's
    slot counted at that size (test_hybrid_prefix_cache.py serves tokens from a bf16 pool)."""
    import json

    make_hybrid("qwen3_5", tmp_path)
    if config_dtype:
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "mamba_ssm_dtype": config_dtype}))
    runner = make_runner(tmp_path, tokens=512, max_req_total_len=96, running_max_req_size=4,
                         mamba_ssm_cache_dtype=flag)
    pool = runner.state_pool
    assert {t.dtype for t in pool.recurrent + runner.snapshot_pool.recurrent} == {expected}
    assert {t.dtype for t in pool.conv + runner.snapshot_pool.conv} == {torch.float32}
    recurrent = 3 * 4 * 16 * 8  # three linear layers' states, 4 heads of 16 x 8
    assert pool.slot_bytes() == runner.model.state_slot_bytes(0, expected) == SLOT_BYTES - recurrent * (4 - expected.itemsize)


def test_tp2_matches_tp1(tmp_path):
    """Two gloo ranks (each half of the key/value heads of the linear layers, of the attention heads,
    of every expert and of the shared expert) give one rank's logits over run_schedule's steps:
    Qwen3-Next's grouped projections with tied embeddings, Qwen3.5-MoE's separate ones."""
    import torch.multiprocessing as mp
    from test_tp import ATOL, RTOL, capture_logits, free_port, schedule_logits, tp_worker

    from lightllm.engine import model_runner

    dirs = [tmp_path / name for name in ("qwen3_next", "qwen3_5_moe")]
    for d in dirs:
        make_hybrid(d.name, d)
    mp.spawn(tp_worker, args=(2, free_port(), dirs, tmp_path / "tp2.pt"), nprocs=2, join=True)
    tp2 = torch.load(tmp_path / "tp2.pt")
    original_sample = model_runner.sample
    try:
        seen = capture_logits()
        tp1 = [schedule_logits(d, seen) for d in dirs]
    finally:
        model_runner.sample = original_sample
    for d, ours, reference in zip(dirs, tp2, tp1):
        assert len(ours) == len(reference) == 9, d.name
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=d.name)


@pytest.mark.parametrize("preset,state_mib,bf16_state_mib,kv_kib", [("qwen3.5-27b", 146.8, 74.8, 64),
                                                                     ("qwen3.5-35b-a3b", 61.4, 31.4, 20)])
def test_bench_presets_shapes_and_state_bytes(preset, state_mib, bf16_state_mib, kv_kib, default_model_dir, tmp_path):
    """Each preset reads as its family (written as the published checkpoints are: the text model of
    a ConditionalGeneration), the 27B's model (on the meta device) asks for exactly the text
    model's tensors, of exactly the shapes, that transformers' model of that config holds, at tp 1
    and 2, and a request's state is the size docs/architecture.md states (bf16 conv, fp32 recurrent)."""
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    from lightllm.models import read_config
    from lightllm.models.qwen3_next import HybridModel
    from lightllm.tools.bench_model import write_bench_model
    from lightllm.utils.dist import TPGroup
    from test_model_families import MetaWeights

    model_dir = write_bench_model(tmp_path / preset, preset, tokenizer_dir=default_model_dir)
    cfg = read_config(model_dir)
    assert cfg.architecture.endswith("ForConditionalGeneration") and cfg.linear_attn.weight_prefix == "model.language_model"
    assert len(cfg.linear_attn.layers) == cfg.num_layers * 3 // 4 and cfg.linear_attn.rotary_dim == 64
    assert cfg.rope_theta == 1e7 and (cfg.moe is not None) == preset.endswith("a3b")
    assert cfg.linear_attn.mtp_layers == 1  # as published: --speculative_config mtp under a dummy load format
    kv_bytes = 2 * cfg.num_kv_layers * cfg.num_kv_heads * cfg.head_dim * 2
    assert kv_bytes == kv_kib * 1024
    if preset.endswith("a3b"):
        assert cfg.moe.shared_intermediate_size == 512 and len(cfg.moe.layers) == 40 and cfg.moe.renormalize
    else:  # (transformers keeps the experts fused, under other names than the checkpoint's)
        with torch.device("meta"):
            hf_model = Qwen3_5ForConditionalGeneration(AutoConfig.from_pretrained(model_dir))
        expected = {name: tuple(t.shape) for name, t in hf_model.state_dict().items()
                    if not name.startswith("model.visual.")}  # the vision tower: never read
        weights = MetaWeights()
        HybridModel(cfg, weights, TPGroup(0, 1), 256, torch.device("meta"))
        assert weights.shapes() == expected
    model = HybridModel(cfg, MetaWeights(), TPGroup(1, 2), 256, torch.device("meta"))
    model.dtype = torch.bfloat16
    assert round(model.state_slot_bytes() * 2 / 2**20, 1) == state_mib  # tp 2: half of the heads a rank
    assert round(model.state_slot_bytes(0, torch.bfloat16) * 2 / 2**20, 1) == bf16_state_mib


def test_the_engine_serves_a_recurrent_state_with_snapshots_and_drafts_on_the_runners_rows():
    """A model with recurrent state (the runner's info says so) gets drafts (a draft model's none),
    a prefix cache only where the runner has snapshot slots, and as many running requests as the
    runner has rows for."""
    from lightllm.engine import build
    from lightllm.engine.config import EngineConfig

    config = EngineConfig(model_dir="m", running_max_req_size=64, state_snapshot_interval=512,
                          speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    info = {"eos_token_ids": [2], "vocab_size": 10, "burst_chunked_prefill_size": None, "running_max_req_size": 5}
    plain = build.build_engine(config, None, 1000, info).scheduler
    assert plain.cache is not None and plain.speculator is not None and plain.max_running == 5
    assert plain.snapshot_interval == 0 and plain.cache.snapshot_slots == 0
    hybrid = build.build_engine(config, None, 1000, {**info, "recurrent_state": True, "state_snapshot_slots": 3})
    hybrid = hybrid.scheduler
    assert hybrid.speculator is not None and hybrid.max_running == 5
    assert hybrid.snapshot_interval == 512 and hybrid.cache.snapshot_slots == 3
    draft_model = dataclasses.replace(config, speculative_config='{"method": "draft_model", "model": "d"}')
    hybrid_info = {**info, "recurrent_state": True, "state_snapshot_slots": 3}
    assert build.build_engine(draft_model, None, 1000, hybrid_info).scheduler.speculator is None
    no_room = build.build_engine(config, None, 1000, {**info, "recurrent_state": True, "state_snapshot_slots": 0})
    assert no_room.scheduler.cache is None


def test_the_runner_refuses_drafts_and_a_cached_prefix_without_its_snapshot(tmp_path):
    """Drafts need the verify stash, which a runner started without --speculative_config lacks, and a
    cached prefix without the snapshot of the state after it has no state to start from: a hybrid
    model's runner refuses both before anything changes."""
    from benchmark.lib.direct_step import run_step

    from lightllm.engine.plan import Chunk, Insert, StepPlan

    make_hybrid("qwen3_next", tmp_path)
    runner = make_runner(tmp_path, tokens=128, state_snapshot_slots=2)
    run_step(runner, prompts=[(0, [1, 2, 3, 4], SamplingParams())])
    with pytest.raises(ValueError, match="recurrent state"):
        runner.step(StepPlan(10, [0], drafts={0: [5, 6]}, sync=True))
    runner.apply([Insert(0, 0, 4, 0)])  # a prefix-cache node over request 0's four tokens
    for snapshot in (-1, 2):  # none, or past the 2 slots
        cached = Chunk(1, [7, 8], 4, True, SamplingParams(), prefix=(0,), snapshot=snapshot)
        with pytest.raises(ValueError, match="snapshot"):
            runner.step(StepPlan(11, [], [cached], sync=True))
    assert run_step(runner, [0]) and runner.reqs[0].seq_len == 5  # request 0 decodes on as before
