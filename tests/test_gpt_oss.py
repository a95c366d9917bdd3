"""gpt-oss (tiny, random, fp32) against transformers: a checkpoint with MXFP4 experts (packed blocks
and scales, kept packed in memory) gives the logits of transformers' model holding those experts
dequantised; bench_model's presets ask for a published checkpoint's tensors. Greedy tokens past the
window through the engine with chunked prefill and the prefix cache are tests/test_model_families.py's
case, the dense checkpoint's logits, its Triton path and tp 2 tests/test_model_vs_hf.py's and
tests/test_tp.py's."""

import dataclasses
import json

import pytest
import torch
from helpers.models import assert_logits_match_hf, make_model, make_runner, random_prompts, run_schedule
from safetensors.torch import save_file
from test_model_families import MetaWeights
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from lightllm.models import read_config, resolve_mxfp4_experts


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


@pytest.mark.parametrize("experts", ["packed", "dequantized"])
def test_mxfp4_checkpoint_matches_transformers(tmp_path, captured_logits, experts):
    """Through the references; the Triton kernels' MXFP4 path is tests/test_gpt_oss_moe.py's. Packed
    (the default), the experts stay as the checkpoint holds them; dequantized (--mxfp4_experts), they
    are widened at load to the model's dtype, in the dense experts' layout."""
    hf_model = make_model("gpt_oss", tmp_path)
    write_mxfp4_checkpoint(hf_model, tmp_path)
    assert read_config(tmp_path).moe.mxfp4
    runner = make_runner(tmp_path, mxfp4_experts=experts)
    mlp = runner.model.layers[0].mlp
    if experts == "packed":
        assert mlp.experts[0].dtype == torch.uint8 and mlp.experts[0].shape == (4, 64, 32)  # [E, 2I, H / 2]
    else:
        assert [(w.dtype, tuple(w.shape)) for w in mlp.experts] == [(torch.float32, (4, 64, 64)),  # [E, 2I, H]
                                                                      (torch.float32, (4, 64, 32))]  # [E, H, I]
    steps = run_schedule(runner, random_prompts(5))
    assert_logits_match_hf(hf_model, captured_logits, steps)


def test_mxfp4_experts_in_fp8_are_the_checkpoint_values(tmp_path):
    """--mxfp4_experts dequantized --quantization fp8: the experts re-encoded in fp8 with per-row
    scales hold exactly the values that the dequantized experts widen to."""
    write_mxfp4_checkpoint(make_model("gpt_oss", tmp_path), tmp_path)
    wide = make_runner(tmp_path, mxfp4_experts="dequantized").model.layers
    narrow = make_runner(tmp_path, mxfp4_experts="dequantized", quantization="fp8").model.layers
    for layer, fp8_layer in zip(wide, narrow):
        gate_up, down, gate_up_scale, down_scale = fp8_layer.mlp.experts
        assert gate_up.dtype == down.dtype == torch.float8_e4m3fn
        assert torch.equal(gate_up.float() * gate_up_scale[..., None], layer.mlp.experts[0])
        assert torch.equal(down.float() * down_scale[..., None], layer.mlp.experts[1])


def test_auto_widens_mxfp4_experts_where_half_the_gpu_holds_them(tmp_path):
    """--mxfp4_experts auto: widened where the widened experts (fp8 under --quantization fp8, else the
    model's dtype; this rank's share) take at most half of the GPU memory the server may use, packed
    past that and on the CPU, as given when named, and a model of no MXFP4 experts keeps the flag."""
    write_mxfp4_checkpoint(make_model("gpt_oss", tmp_path), tmp_path)
    cfg = read_config(tmp_path)
    moe = cfg.moe
    weights = len(moe.layers) * moe.num_experts * 3 * moe.intermediate_size * cfg.hidden_size
    bf16, fp8 = cfg, dataclasses.replace(cfg, quantization="fp8")
    assert resolve_mxfp4_experts("auto", bf16, torch.bfloat16, 4 * weights) == "dequantized"
    assert resolve_mxfp4_experts("auto", bf16, torch.bfloat16, 4 * weights - 1) == "packed"
    assert resolve_mxfp4_experts("auto", fp8, torch.bfloat16, 2 * weights) == "dequantized"
    assert resolve_mxfp4_experts("auto", bf16, torch.bfloat16, 2 * weights, tp=2) == "dequantized"
    assert resolve_mxfp4_experts("auto", bf16, torch.bfloat16, None) == "packed"
    assert resolve_mxfp4_experts("dequantized", bf16, torch.bfloat16, None) == "dequantized"
    assert resolve_mxfp4_experts("packed", bf16, torch.bfloat16, 4 * weights) == "packed"
    assert resolve_mxfp4_experts("auto", dataclasses.replace(cfg, moe=None), torch.bfloat16, 4 * weights) == "auto"
    runner = make_runner(tmp_path)  # the default on the CPU: packed, and said so
    assert runner.model.layers[0].mlp.experts[0].dtype == torch.uint8 and runner.info["mxfp4_experts"] == "packed"


def mxfp4_names(dense: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """transformers' dense expert tensors [E, in, out] replaced by the published checkpoints' MXFP4
    blocks [E, out, in / 32, 16] and scales [E, out, in / 32]."""
    out = {}
    for name, shape in dense.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, k, n = shape
            out[f"{name}_blocks"], out[f"{name}_scales"] = (experts, n, k // 32, 16), (experts, n, k // 32)
        else:
            out[name] = shape
    return out


@pytest.mark.parametrize("preset,layers,experts,gigabytes", [("gpt-oss-20b", 24, 32, 12.0),
                                                             ("gpt-oss-120b", 36, 128, 63.5)])
def test_bench_presets_ask_for_the_published_mxfp4_checkpoint(preset, layers, experts, gigabytes, default_model_dir,
                                                                tmp_path):
    """The preset's config reads as gpt-oss's (alternating windows of 128, YaRN, MXFP4 experts), and
    the model built from it (on the meta device) asks, at tp 1 and 2, for exactly the tensors of a
    published gpt-oss checkpoint of that shape, the experts packed: 20b 12.0 GB, 120b 63.5 GB."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightllm.models import LlamaModel
    from lightllm.tools.bench_model import write_bench_model
    from lightllm.utils.dist import TPGroup

    model_dir = write_bench_model(tmp_path / preset, preset, tokenizer_dir=default_model_dir)
    cfg = read_config(model_dir)
    assert (cfg.num_layers, cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.mxfp4, cfg.attn_sinks) == (layers, experts, 4,
                                                                                                  True, True)
    assert cfg.layer_windows == (128, 0) * (layers // 2) and cfg.rope_scaling["rope_type"] == "yarn"
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    expected = mxfp4_names({name: tuple(t.shape) for name, t in hf_model.state_dict().items()})
    for rank in (0, 1):
        weights = MetaWeights()
        LlamaModel(cfg, weights, TPGroup(rank, 2), 256, torch.device("meta"))
        assert weights.shapes() == expected
    total = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in weights.asked.values())
    assert round(total / 1e9, 1) == gigabytes


@pytest.mark.parametrize("extra", [dict(truncate=False), dict(truncate=True), dict(attention_factor=1.3),
                                   dict(mscale=0.9, mscale_all_dim=0.7)])
def test_yarn_frequencies_and_attention_factor_are_transformers(extra):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lightllm.models.layers import rope_attention_factor, rope_inv_freq

    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0, **extra}
    config = GptOssConfig(head_dim=64, rope_parameters=dict(rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    torch.testing.assert_close(rope_inv_freq(64, 150000.0, scaling), inv_freq, atol=0, rtol=1e-6)
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
