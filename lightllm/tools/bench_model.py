"""Model directories for benchmarks and CPU tests, with the default model's tokenizer.

    python -m lightllm.tools.bench_model --out DIR [--preset 8b|70b|qwen3-30b-a3b|tiny|...] [--tokenizer DIR]

8b ("bench-8b"): the Llama-3.1-8B shape (llama3 rope scaling, untied embeddings, bfloat16)
    with the default model's 49152-token vocabulary and no weight files: the server loads it
    with `--load_format dummy`, so a GPU benchmark needs neither a download nor 16 GB of disk.
70b ("bench-70b"): the same for Llama-3.1-70B's shape (80 layers, hidden 8192, 64 heads,
    8 KV heads, intermediate 28672): 141 GB of bf16 weights, served at --tp 4 or 8.
qwen3-30b-a3b: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 32 heads, 4 KV heads of 128,
    experts in every layer: 128 of intermediate 768, 8 active, renormalised), dummy weights too:
    61 GB in bf16, served on one H200 (or an H100 with little room for the KV cache).
tiny: a 2-layer model of the same family with seeded random float32 weights, small enough
    to serve on a CPU in tests of the server and the benchmark client; tiny-mixtral and
    tiny-qwen3-moe the same with 8 experts (2 active) in place of the dense MLPs.

The tokenizer comes from the default model, or from `--tokenizer DIR` (any directory with
its files, such as a bench-8b directory): where there is no network, as on the GPU machines.
"""

from __future__ import annotations

import argparse
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
}
TINY_EXPERTS = dict(num_experts_per_tok=2, **SHAPES["tiny"])
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
    "tiny-mixtral": dict(num_local_experts=8, **TINY_EXPERTS),
    "tiny-qwen3-moe": dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, **TINY_EXPERTS),
})
# model_type of each preset that is not a Llama
FAMILIES = {"qwen3-30b-a3b": "qwen3_moe", "tiny-mixtral": "mixtral", "tiny-qwen3-moe": "qwen3_moe"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_ROPE_THETA = 1000000.0  # Mixtral's and Qwen3's, without scaling
# tiny*: exact comparisons with transformers
DTYPES = {"8b": "bfloat16", "70b": "bfloat16", "qwen3-30b-a3b": "bfloat16", "tiny": "float32",
          "tiny-mixtral": "float32", "tiny-qwen3-moe": "float32"}


def rope_fields(family: str) -> dict:
    """Rope as the real checkpoints' config.json spells it (and transformers 5 still reads)."""
    if family == "llama":
        return dict(rope_theta=LLAMA3_ROPE_THETA, rope_scaling=dict(LLAMA3_ROPE_SCALING))
    return dict(rope_theta=MOE_ROPE_THETA)


def make_config(preset: str, tokenizer_dir: Path):
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    family = FAMILIES.get(preset, "llama")
    return AutoConfig.for_model(
        family,
        **SHAPES[preset],
        **rope_fields(family),
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[ARCHITECTURES[family]],
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
    # Llama 3.1's own config.json spells rope as rope_theta + rope_scaling and the dtype as
    # torch_dtype (Qwen3-MoE's its expert count num_experts); transformers 5 reads both spellings,
    # older and plain-JSON readers only those.
    experts = {"num_experts": config.num_experts} if FAMILIES.get(preset) == "qwen3_moe" else {}
    update_json(out / "config.json", **rope_fields(FAMILIES.get(preset, "llama")), **experts,
                torch_dtype=DTYPES[preset])
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
