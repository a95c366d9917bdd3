"""Model directories for benchmarks and CPU tests, with the default model's tokenizer.

    python -m lightllm.tools.bench_model --out DIR [--preset 8b|tiny]

8b ("bench-8b"): the Llama-3.1-8B shape (llama3 rope scaling, untied embeddings, bfloat16)
    with the default model's 49152-token vocabulary and no weight files: the server loads it
    with `--load_format dummy`, so a GPU benchmark needs neither a download nor 16 GB of disk.
tiny: a 2-layer model of the same family with seeded random float32 weights, small enough
    to serve on a CPU in tests of the server and the benchmark client.
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
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}
DTYPES = {"8b": "bfloat16", "tiny": "float32"}  # tiny: exact comparisons with transformers


def make_config(preset: str, tokenizer_dir: Path):
    from transformers import AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return LlamaConfig(
        **SHAPES[preset],
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        rope_theta=LLAMA3_ROPE_THETA,
        rope_scaling=dict(LLAMA3_ROPE_SCALING),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
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


def write_bench_model(out: Path, preset: str = "8b", seed: int = 0) -> Path:
    """Write the `preset` model directory into `out` and return it."""
    if preset not in SHAPES:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(SHAPES)}")
    out = Path(out)
    tokenizer_dir = ensure_default_model()
    config = make_config(preset, tokenizer_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()  # a directory reused across presets must not keep other weights
    if preset == "tiny":
        save_random_weights(config, out, seed)
    else:
        save_config_only(config, out)
    # Llama 3.1's own config.json spells rope as rope_theta + rope_scaling and the dtype as
    # torch_dtype; transformers 5 reads both spellings, older and plain-JSON readers only those.
    update_json(
        out / "config.json",
        rope_theta=LLAMA3_ROPE_THETA,
        rope_scaling=dict(LLAMA3_ROPE_SCALING),
        torch_dtype=DTYPES[preset],
    )
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, out / name)
    logger.info("wrote the %s model directory %s", preset, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--preset", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny preset's random weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(write_bench_model(args.out, args.preset, args.seed))


if __name__ == "__main__":
    main()
