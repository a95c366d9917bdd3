"""Model directories for benchmarks and CPU tests, with the default model's tokenizer.

    python -m lightllm.tools.bench_model --out DIR [--preset NAME] [--tokenizer DIR]

8b ("bench-8b"): the Llama-3.1-8B shape (llama3 rope scaling, untied embeddings, bfloat16)
    with the default model's 49152-token vocabulary and no weight files: the server loads it
    with `--load_format dummy`, so a GPU benchmark needs neither a download nor 16 GB of disk.
1b ("bench-1b"): Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads, 8 KV heads of 64,
    intermediate 8192) with the same vocabulary: the draft model of bench-8b in speculative
    decoding benchmarks (with --load_format dummy_echo on both, every draft is accepted).
70b ("bench-70b"): the same for Llama-3.1-70B's shape (80 layers, hidden 8192, 64 heads,
    8 KV heads, intermediate 28672): 141 GB of bf16 weights, served at --tp 4 or 8.
qwen3-8b, gemma3-12b: the same for Qwen3-8B's shape (36 layers, q/k norms, rope base 1e6) and
    Gemma-3-12B's (48 layers, head_dim 256, sliding window 1024 on 5 layers of 6, rope base 1e4
    on those and 1e6 with linear scaling 8 on the global ones, tied embeddings), both with the
    default tokenizer's vocabulary: their own (151936, 262208 tokens) would only add to the head.
tiny: a 2-layer model of the same family with seeded random float32 weights, small enough
    to serve on a CPU in tests of the server and the benchmark client; tiny-qwen3, tiny-gemma2
    and tiny-gemma3 the same for those families (sliding window 16 where they have one);
    tiny-gemma4 4 layers of Gemma 4 (shared K/V, per-layer inputs);
    tiny-mixtral and tiny-qwen3-moe with 8 experts (2 active) in place of the dense MLPs.
qwen3-30b-a3b: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 32 heads, 4 KV heads of 128,
    experts in every layer: 128 of intermediate 768, 8 active, renormalised), dummy weights:
    61 GB in bf16, served on one H200, or on an H100 with --quantization fp8 (31 GB).
gemma4-31b: a Gemma 4 dense shape (60 layers, hidden 5376, 32 heads; 5 of every 6 layers slide over
    1024 positions with 16 KV heads of 256, the others are global with 4 KV heads of 512, v = k's
    projection, a quarter of each head turning), with the default tokenizer's vocabulary: 59.1 GB of
    bf16 weights, 880 KiB of bf16 K/V a token (2 x (50 x 16 x 256 + 10 x 4 x 512) x 2 bytes).
gemma4-26b-a4b: a Gemma 4 MoE shape (30 layers, hidden 2816, 16 heads; sliding layers 8 KV heads of
    256, global ones 2 of 512; in every layer 128 GELU experts of intermediate 704, 8 active, beside a
    dense MLP of 2112): 49.3 GB of bf16 weights (experts 45.7), 220 KiB of bf16 K/V a token (2 x (25 x 8 x 256 + 5 x 2 x 512) x 2 bytes).
gpt-oss-20b, gpt-oss-120b: gpt-oss's shapes (24 / 36 layers, hidden 2880, 64 heads and 8 KV heads
    of 64, sliding window 128 on every other layer, YaRN over 4096 positions by 32, 32 / 128
    experts of intermediate 2880, 4 active) with MXFP4 experts as published, dummy weights and the
    default tokenizer's vocabulary (their own 201088 tokens would add 1.7 GB): 20b 12.0 GB of
    weights (experts 10.2 GB; 38.2 in bf16), 120b 63.5 GB (experts 60.9 GB; 229 in bf16), on one
    H200. tiny-gpt-oss: 3 layers of 4 experts, dense fp32 experts, window 16.
qwen3.5-27b, qwen3.5-35b-a3b: the hybrid Qwen3.5 shapes (Gated DeltaNet in 3 layers of 4, gated
    full attention in the 4th, head_dim 256 with a quarter of it rotated, rope base 1e7): the dense
    27B (64 layers, hidden 5120, 24 heads, 4 KV heads, 16 key and 48 value heads of 128 in the
    linear layers, intermediate 17408) and the 35B-A3B (40 layers, hidden 2048, 16 heads, 2 KV
    heads, 16 key and 32 value heads, 256 experts of 512 with 8 active and a shared one of 512);
    tiny-qwen3.5: 4 such layers at the tiny size.

The tokenizer comes from the default model, or from `--tokenizer DIR` (any directory with
its files, such as a bench-8b directory): where there is no network, as on the GPU machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

from lightllm.tools.default_model import ensure_default_model, update_json

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Llama 3.1's rope scaling, as in its config.json.
LLAMA3_ROPE_THETA = 500000.0
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES = {
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),
    "70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "gemma3-12b": dict(
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
    ),
}
SHAPES.update({f"tiny-{family}": dict(SHAPES["tiny"], num_hidden_layers=3) for family in ("qwen3", "gemma2", "gemma3")})
TINY_EXPERTS = dict(SHAPES["tiny"], num_experts_per_tok=2)
SHAPES.update({
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,  # of a dense layer; it has none (no mlp_only_layers)
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
    ),
    "tiny-mixtral": dict(TINY_EXPERTS, num_local_experts=8),
    "tiny-qwen3-moe": dict(TINY_EXPERTS, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True),
    "tiny-gpt-oss": dict(TINY_EXPERTS, num_hidden_layers=3, intermediate_size=32, num_local_experts=4),
})
GPT_OSS = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
               num_experts_per_tok=4)
SHAPES["gemma4-31b"] = dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
                            num_key_value_heads=16, head_dim=256, num_global_key_value_heads=4)
# tiny-gemma4: sliding and global layers alternating (heads of 16 and 32), the last two sharing the K/V
# of the first two, per-layer inputs of 8
SHAPES["tiny-gemma4"] = dict(SHAPES["tiny"], num_hidden_layers=4, num_global_key_value_heads=1, global_head_dim=32,
                             num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                             layer_types=["sliding_attention", "full_attention"] * 2)
SHAPES["gemma4-26b-a4b"] = dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=256, num_global_key_value_heads=2, enable_moe_block=True,
                                num_experts=128, top_k_experts=8, moe_intermediate_size=704)
SHAPES.update({"gpt-oss-20b": dict(GPT_OSS, num_hidden_layers=24, num_local_experts=32),
               "gpt-oss-120b": dict(GPT_OSS, num_hidden_layers=36, num_local_experts=128)})
MOE_PRESETS = {"qwen3-30b-a3b": "qwen3_moe", "tiny-qwen3-moe": "qwen3_moe", "tiny-mixtral": "mixtral",
               "qwen3.5-35b-a3b": "qwen3.5_moe",
               "gpt-oss-20b": "gpt_oss", "gpt-oss-120b": "gpt_oss", "tiny-gpt-oss": "gpt_oss"}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
MXFP4_CONFIG = {"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                           "lm_head"]}
HYBRID_LAYERS = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, head_dim=256)
SHAPES.update({
    "qwen3.5-27b": dict(HYBRID_LAYERS, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
                        linear_num_value_heads=48),
    "qwen3.5-35b-a3b": dict(HYBRID_LAYERS, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                            num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512),
    "tiny-qwen3.5": dict(SHAPES["tiny"], num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=8),
})
# tiny presets: float32, for exact comparisons with transformers
DTYPES = {name: "float32" if name.startswith("tiny") else "bfloat16" for name in SHAPES}
TINY_WINDOW = 16


def family_config(preset: str) -> tuple[str, dict]:
    """(transformers config class, its family's fields) of a preset; Llama 3.1's by default."""
    family = MOE_PRESETS.get(preset) or preset.removeprefix("tiny-").split("-")[0]
    tiny = preset.startswith("tiny")
    if family.startswith("qwen3.5"):
        rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
        # one MTP layer, as the published configs name it (its mtp.* weights: dummy load formats only)
        common = dict(rope_parameters=rope, max_position_embeddings=262144, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, mtp_num_hidden_layers=1)
        if family == "qwen3.5_moe":
            return "Qwen3_5MoeTextConfig", dict(common, architectures=["Qwen3_5MoeForCausalLM"])
        return "Qwen3_5TextConfig", dict(common, architectures=["Qwen3_5ForCausalLM"])
    if family == "qwen3_moe":
        return "Qwen3MoeConfig", dict(rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    if family == "gpt_oss":
        return "GptOssConfig", dict(rope_parameters=dict(GPT_OSS_ROPE), max_position_embeddings=131072,
                                    rms_norm_eps=1e-5, sliding_window=TINY_WINDOW if tiny else 128,
                                    tie_word_embeddings=False, architectures=["GptOssForCausalLM"])
    if family == "mixtral":
        return "MixtralConfig", dict(rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-5,
                                     tie_word_embeddings=False, architectures=["MixtralForCausalLM"])
    if family == "qwen3":
        return "Qwen3Config", dict(rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    if family == "gemma4":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
        dims = {} if tiny else dict(global_head_dim=512, hidden_size_per_layer_input=0)
        return "Gemma4TextConfig", dict(dims, attention_k_eq_v=True, sliding_window=TINY_WINDOW if tiny else 1024,
                                        final_logit_softcapping=30.0,
                                        max_position_embeddings=262144, rms_norm_eps=1e-6, rope_parameters=rope,
                                        tie_word_embeddings=True, architectures=["Gemma4ForCausalLM"])
    if family in ("gemma2", "gemma3"):
        head_dim = SHAPES[preset]["head_dim"]
        common = dict(sliding_window=TINY_WINDOW if tiny else 1024, query_pre_attn_scalar=head_dim,
                      max_position_embeddings=8192 if family == "gemma2" else 131072, rms_norm_eps=1e-6,
                      tie_word_embeddings=True)
        if family == "gemma2":
            return "Gemma2Config", dict(common, architectures=["Gemma2ForCausalLM"])
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}
        return "Gemma3TextConfig", dict(common, rope_parameters=rope, architectures=["Gemma3ForCausalLM"],
                                        sliding_window_pattern=2 if tiny else 6)
    return "LlamaConfig", dict(max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu",
                               rope_theta=LLAMA3_ROPE_THETA, rope_scaling=dict(LLAMA3_ROPE_SCALING),
                               tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def make_config(preset: str, tokenizer_dir: Path):
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    class_name, fields = family_config(preset)
    if class_name == "Gemma4TextConfig":  # its per-layer inputs' table covers the vocabulary
        fields = dict(fields, vocab_size_per_layer_input=len(tokenizer))
    return getattr(transformers, class_name)(
        **SHAPES[preset],
        **fields,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=DTYPES[preset],
    )


def save_random_weights(config, out: Path, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)  # also writes config.json and generation_config.json


def save_config_only(config, out: Path) -> None:
    from transformers import GenerationConfig

    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def flatten_layer_overrides(path: Path) -> None:
    """Gemma 4's global layers as its published config.json gives them (global_head_dim,
    num_global_key_value_heads), not as transformers 5.24 writes them (a per_layer_config of
    overrides), which other readers refuse (vLLM 0.26 with an older transformers: "'head_dim' is
    a per-layer attribute")."""
    values = json.loads(path.read_text())
    overrides = values.pop("per_layer_config", None) or {}
    shapes = {(o.get("head_dim"), o.get("num_key_value_heads")) for o in overrides.values()}
    if len(shapes) > 1:
        raise ValueError(f"global layers of different shapes in {path}: {shapes}")
    if shapes:
        (head_dim, kv_heads), = shapes
        values.update({k: v for k, v in (("global_head_dim", head_dim), ("num_global_key_value_heads", kv_heads))
                       if v is not None})
    path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def save_as_published_qwen3_5(text_config, out: Path) -> None:
    """A Qwen3.5 shape as its published checkpoints' config.json has it: the text model's config
    under text_config of a Qwen3_5(Moe)ForConditionalGeneration (vision_config transformers'
    default; its weights are never read), which vLLM 0.26 serves (it registers no
    Qwen3_5ForCausalLM); this server reads the same text model from either form."""
    import transformers

    moe = text_config.model_type == "qwen3_5_moe_text"
    config = getattr(transformers, "Qwen3_5MoeConfig" if moe else "Qwen3_5Config")(text_config=text_config.to_dict())
    config.architectures = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    config.tie_word_embeddings = text_config.tie_word_embeddings
    config.save_pretrained(out)


def write_bench_model(out: Path, preset: str = "8b", seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Write the `preset` model directory into `out` and return it; the tokenizer's files come
    from `tokenizer_dir`, else from the default model."""
    if preset not in SHAPES:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(SHAPES)}")
    out = Path(out)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else ensure_default_model()
    config = make_config(preset, tokenizer_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()  # a directory reused across presets must not keep other weights
    if preset.startswith("tiny"):
        save_random_weights(config, out, seed)
    else:
        save_config_only(config, out)
    if config.model_type == "llama":
        # Llama 3.1's own config.json spells rope as rope_theta + rope_scaling and the dtype as
        # torch_dtype; transformers 5 reads both spellings, older and plain-JSON readers only those.
        update_json(out / "config.json", rope_theta=LLAMA3_ROPE_THETA, rope_scaling=dict(LLAMA3_ROPE_SCALING),
                    torch_dtype=DTYPES[preset])
    if config.model_type == "qwen3_moe":  # as Qwen3-MoE's own config.json counts its experts
        update_json(out / "config.json", num_experts=config.num_experts)
    if config.model_type == "gpt_oss" and not preset.startswith("tiny"):  # MXFP4 experts, as published
        update_json(out / "config.json", quantization_config=MXFP4_CONFIG)
    if config.model_type == "gemma4_text":
        flatten_layer_overrides(out / "config.json")
    if config.model_type in ("qwen3_5_text", "qwen3_5_moe_text") and not preset.startswith("tiny"):
        save_as_published_qwen3_5(config, out)
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, out / name)
    logger.info("wrote the %s model directory %s", preset, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--preset", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny preset's random weights")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="directory to copy the tokenizer from (default: the default model's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(write_bench_model(args.out, args.preset, args.seed, args.tokenizer))


if __name__ == "__main__":
    main()
