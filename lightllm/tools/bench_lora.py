"""Random LoRA adapters in PEFT's format for a model directory, for benchmarks and GPU tests.

    python -m lightllm.tools.bench_lora --model DIR --out DIR [--count 16] [--rank 16]

Writes OUT/lora-0 ... OUT/lora-{count-1}, each an `adapter_config.json` and an
`adapter_model.safetensors` on the q, k, v, o, gate, up and down projections of every dense
layer, A and B drawn from a seeded normal (B non-zero, unlike a fresh PEFT adapter, so that the
adapter changes the output), in the model's dtype; it needs only the model's config.json (a
bench-8b directory is enough). Prints the server's `--lora_modules` argument for them and the
benchmark client's `--lora-adapters`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from lightllm.common.lora_files import CONFIG_FILE, TARGETS, WEIGHTS_FILE
from lightllm.models import read_config, resolve_dtype
from lightllm.models.lora import module_shapes

logger = logging.getLogger(__name__)
WEIGHT_STD = 0.02


def write_adapter(out: Path, shapes: dict[str, tuple[int, int]], rank: int, dtype: torch.dtype, seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (out_features, in_features) in shapes.items():
        for part, shape in (("A", (rank, in_features)), ("B", (out_features, rank))):
            weight = torch.randn(shape, generator=gen) * WEIGHT_STD
            tensors[f"base_model.model.{name}.lora_{part}.weight"] = weight.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(TARGETS),
              "bias": "none", "use_rslora": False, "task_type": "CAUSAL_LM"}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the model directory (its config.json)")
    parser.add_argument("--out", type=Path, required=True, help="folder of the adapters")
    parser.add_argument("--count", type=int, default=16, help="adapters to write")
    parser.add_argument("--rank", type=int, default=16, help="their rank")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = read_config(str(args.model))
    shapes, dtype = module_shapes(cfg), resolve_dtype("auto", cfg, torch.device("cuda"))  # the dtype a GPU serves
    names = [f"lora-{i}" for i in range(args.count)]
    for i, name in enumerate(names):
        write_adapter(args.out / name, shapes, args.rank, dtype, seed=i)
    logger.info("wrote %d adapters of rank %d in %s", args.count, args.rank, args.out)
    print("--lora_modules " + " ".join(f"{name}={args.out / name}" for name in names))
    print("--lora-adapters " + ",".join(names))


if __name__ == "__main__":
    main()
