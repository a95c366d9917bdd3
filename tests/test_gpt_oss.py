"""gpt-oss (tiny, random, fp32) against transformers: a checkpoint with MXFP4 experts (packed blocks
and scales, kept packed in memory) gives the logits of transformers' model holding those experts
dequantised; and the engine
core with chunked prefill and the prefix cache gives transformers' greedy tokens past the window.
The dense checkpoint's logits, its Triton path and tp 2 are tests/test_model_vs_hf.py's and
tests/test_tp.py's cases."""

import json

import torch
from helpers.models import (Client, assert_idle, assert_logits_match_hf, engine, hf_greedy, make_model, make_runner,
                            random_prompts, run_schedule)
from safetensors.torch import save_file
from test_model_families import NEW, prompts
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from lightllm.engine.request import SamplingParams
from lightllm.models import read_config


def write_mxfp4_checkpoint(hf_model, out_dir, seed=0):
    """Replace each layer's experts by random MXFP4 ones, in hf_model (dequantised by transformers'
    own function) and in out_dir's checkpoint (packed, as gpt-oss's published checkpoints are)."""
    gen = torch.Generator().manual_seed(seed)
    state = {name: t.clone() for name, t in hf_model.state_dict().items()}
    for index, layer in enumerate(hf_model.model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(experts, proj)  # [E, in, out]
            num, k, n = param.shape
            blocks = torch.randint(0, 256, (num, n, k // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(121, 125, (num, n, k // 32), dtype=torch.uint8, generator=gen)
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            name = f"model.layers.{index}.mlp.experts.{proj}"
            del state[name]
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, out_dir / "model.safetensors")
    config = json.loads((out_dir / "config.json").read_text())
    unconverted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": unconverted}
    (out_dir / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_matches_transformers(tmp_path, captured_logits):
    """Through the references; the Triton kernels' MXFP4 path is tests/test_gpt_oss_moe.py's."""
    hf_model = make_model("gpt_oss", tmp_path)
    write_mxfp4_checkpoint(hf_model, tmp_path)
    assert read_config(tmp_path).moe.mxfp4
    runner = make_runner(tmp_path)
    mlp = runner.model.layers[0].mlp
    assert mlp.experts[0].dtype == torch.uint8 and mlp.experts[0].shape == (4, 64, 32)  # [E, 2I, H / 2]: packed
    steps = run_schedule(runner, random_prompts(5))
    assert_logits_match_hf(hf_model, captured_logits, steps)


def test_chunked_prefill_and_prefix_cache_equal_transformers(tmp_path):
    """Prompts past the sliding window (8) and generations far past it; chunks under, at and over it."""
    hf_model = make_model("gpt_oss", tmp_path)
    runner = make_runner(tmp_path, tokens=1024, max_req_total_len=96)
    workload = prompts()
    expected = list(hf_greedy(hf_model, workload, NEW).values())
    greedy = SamplingParams(max_new_tokens=NEW)
    for chunk, prefix_cache in ((5, True), (8, False), (64, True)):
        core = engine(runner, chunk=chunk, prefix_cache=prefix_cache)
        client = Client(core)
        got = client.run(workload, greedy, staggered=True) + client.run(workload, greedy)
        assert (core.scheduler.prefix_hit_tokens > 0) == prefix_cache
        assert got == expected + expected, (chunk, prefix_cache)
        assert_idle(core)
