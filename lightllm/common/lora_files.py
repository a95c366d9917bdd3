"""LoRA adapter directories in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`),
read and checked without torch: the HTTP process checks an adapter before the engine loads it
(lightllm/models/lora.py loads the weights)."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT's LoRA settings that change what the adapter computes beyond W x + scaling B A x (set: refused)
UNSUPPORTED_SETTINGS = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "lora_bias", "target_parameters",
                        "trainable_token_indices", "layer_replication", "alora_invocation_tokens", "use_qalora",
                        "use_bdlora", "fan_in_fan_out")
_KEY = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.\w+)?\.weight$")


class LoraAdapterError(ValueError):
    """The adapter cannot be served: names the problem."""


@dataclass
class AdapterSpec:
    """What an adapter directory holds, read and checked without loading its weights."""

    path: str
    rank: int
    scaling: float
    modules: dict[str, dict[str, str]]  # module name ("model.layers.0.self_attn.q_proj") -> {"A": key, "B": key}


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoraAdapterError(f"{path} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"cannot read {path / CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{path / CONFIG_FILE} is not a LoRA adapter's config")
    unsupported = [name for name in UNSUPPORTED_SETTINGS if config.get(name)]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise LoraAdapterError(f"adapter settings not supported: {', '.join(unsupported)}")
    return config


def _safetensors_shapes(file: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the file's header alone."""
    try:
        with open(file, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise LoraAdapterError(f"{file.parent} has no {WEIGHTS_FILE}") from None
    except (OSError, ValueError, struct.error) as exc:
        raise LoraAdapterError(f"cannot read {file}: {exc}") from None
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def read_adapter(path: str | Path, shapes: dict[str, tuple[int, int]], max_rank: int) -> AdapterSpec:
    """The adapter at `path`, checked against the model's projections `shapes` (module name -> (out, in))
    and `max_rank` (LoraAdapterError says why not)."""
    path = Path(path)
    config = _read_config(path)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or not 0 < rank <= max_rank or not isinstance(alpha, (int, float)):
        raise LoraAdapterError(f"adapter rank {rank!r} (lora_alpha {alpha!r}): must be 1..{max_rank} (--max_lora_rank)")
    modules: dict[str, dict[str, str]] = {}
    for key, shape in _safetensors_shapes(path / WEIGHTS_FILE).items():
        found = _KEY.match(key)
        if found is None or found.group(1) not in shapes:
            raise LoraAdapterError(f"adapter tensor {key} is not on a projection served with LoRA (the q, k, v, o, "
                                   "gate, up and down projections of dense layers)")
        name, part = found.group(1), found.group(5)
        out, inp = shapes[name]
        if shape != ([rank, inp] if part == "A" else [out, rank]):
            raise LoraAdapterError(f"adapter tensor {key} has shape {shape}, the model needs "
                                   f"{[rank, inp] if part == 'A' else [out, rank]}")
        modules.setdefault(name, {})[part] = key
    incomplete = [name for name, parts in modules.items() if len(parts) != 2]
    if incomplete or not modules:
        raise LoraAdapterError(f"adapter without both lora_A and lora_B for {incomplete or 'any module'}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return AdapterSpec(str(path), rank, scaling, modules)
