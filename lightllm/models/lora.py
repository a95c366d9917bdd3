"""LoRA adapters in PEFT's format, served many at once beside the base model.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (PEFT's
`save_pretrained`). Each adapted projection W gets W x + scaling * B (A x), with A [r, in] and
B [out, r], scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). The q, k, v, o, gate,
up and down projections of the dense layers are served; the experts of mixture-of-experts layers
are not yet (an adapter with them is refused).

On the device every adapted projection keeps a slot pool (`LoraSlots`), allocated once at start:
for slot s, A rows and B columns of rank `max_rank` (smaller ranks zero-padded), the scaling
folded into B. A merged projection (q/k/v, gate/up) stacks its parts' A along the rank and
places each part's B in its own rank columns, so one shrink and one expand serve all of its
parts. Tensor parallel cuts as the layers do: a column-parallel layer keeps all of A and its
rows of B, a row-parallel layer its columns of A and all of B (its output is a partial sum,
added before the layer's all-reduce).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from lightllm.kernels import lora_expand_, lora_segments, lora_shrink

from .config import ModelConfig

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


def _module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every projection an adapter may adapt."""
    d, h, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (cfg.num_heads * d, h), "k_proj": (cfg.num_kv_heads * d, h), "v_proj": (cfg.num_kv_heads * d, h),
              "o_proj": (h, cfg.num_heads * d), "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    sparse = set(cfg.moe.layers) if cfg.moe is not None else set()
    return {f"model.layers.{i}.{TARGETS[name]}.{name}": shape for i in range(cfg.num_layers)
            for name, shape in shapes.items() if not (TARGETS[name] == "mlp" and i in sparse)}


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


def read_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> AdapterSpec:
    """The adapter at `path`, checked against the model and `max_rank` (LoraAdapterError says why not)."""
    path = Path(path)
    config = _read_config(path)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or not 0 < rank <= max_rank or not isinstance(alpha, (int, float)):
        raise LoraAdapterError(f"adapter rank {rank!r} (lora_alpha {alpha!r}): must be 1..{max_rank} (--max_lora_rank)")
    shapes, expected = _safetensors_shapes(path / WEIGHTS_FILE), _module_shapes(cfg)
    modules: dict[str, dict[str, str]] = {}
    for key, shape in shapes.items():
        found = _KEY.match(key)
        if found is None or found.group(1) not in expected:
            raise LoraAdapterError(f"adapter tensor {key} is not on a projection served with LoRA (the q, k, v, o, "
                                   "gate, up and down projections of dense layers)")
        name, part = found.group(1), found.group(5)
        out, inp = expected[name]
        if shape != ([rank, inp] if part == "A" else [out, rank]):
            raise LoraAdapterError(f"adapter tensor {key} has shape {shape}, the model needs "
                                   f"{[rank, inp] if part == 'A' else [out, rank]}")
        modules.setdefault(name, {})[part] = key
    incomplete = [name for name, parts in modules.items() if len(parts) != 2]
    if incomplete or not modules:
        raise LoraAdapterError(f"adapter without both lora_A and lora_B for {incomplete or 'any module'}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return AdapterSpec(str(path), rank, scaling, modules)


@dataclass
class LoraAdapter:
    """An adapter's weights in host memory: module name -> (A [r, in], B * scaling [out, r]) in fp32."""

    spec: AdapterSpec
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    from safetensors.torch import load_file

    spec = read_adapter(path, cfg, max_rank)
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    weights = {name: (tensors[keys["A"]].float(), tensors[keys["B"]].float() * spec.scaling)
               for name, keys in spec.modules.items()}
    return LoraAdapter(spec, weights)


class LoraTarget:
    """One projection's slots: a [S, parts * R, in] and b [S, out, parts * R] (this rank's share),
    applied to the step's rows by the pool's segments."""

    def __init__(self, linear, pool: LoraSlots, max_rank: int, device, dtype):
        self.pool, self.parts, self.in_slice, self.max_rank = pool, linear.parts, linear.in_slice, max_rank
        rank, out = len(self.parts) * max_rank, sum(count for _, _, _, count in self.parts)
        self.a = torch.zeros(pool.num_slots, rank, self.in_slice[1], device=device, dtype=dtype)
        self.b = torch.zeros(pool.num_slots, out, rank, device=device, dtype=dtype)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        in_start, in_count = self.in_slice
        row = 0
        for i, (name, _, start, count) in enumerate(self.parts):
            pair = adapter.weights.get(name)
            if pair is not None:
                a, b = pair
                r, first = a.shape[0], i * self.max_rank
                self.a[slot, first: first + r] = a[:, in_start: in_start + in_count]
                self.b[slot, row: row + count, first: first + r] = b[start: start + count]
            row += count

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rows, starts = self.pool.segments
        return lora_expand_(y, lora_shrink(x, self.a, rows, starts), self.b, rows, starts)


def _projections(layer) -> list:
    out = [layer.attn.qkv, layer.attn.o]
    mlp = layer.mlp
    if hasattr(mlp, "gate_up") and hasattr(mlp, "down"):  # a dense MLP (not the experts)
        out += [mlp.gate_up, mlp.down]
    return out


class LoraSlots:
    """The device's adapter slots, `num_slots` of rank up to `max_rank`, allocated once: attached to
    every served projection of `model`. `prepare` groups a step's rows by slot (slot -1: none)."""

    def __init__(self, model, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.num_slots = num_slots
        self.targets = []
        for layer in model.layers:
            for linear in _projections(layer):
                linear.lora = LoraTarget(linear, self, max_rank, device, dtype)
                if hasattr(linear, "split_sum"):
                    linear.split_sum = 0  # its output must be whole for the adapter's share to be added
                self.targets.append(linear.lora)
        self.segments: tuple[torch.Tensor, torch.Tensor] | None = None
        model.lora = self

    def prepare(self, slots: torch.Tensor) -> None:
        self.segments = lora_segments(slots, self.num_slots)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        for target in self.targets:
            target.load(slot, adapter)

    def nbytes(self) -> int:
        return sum(t.a.nbytes + t.b.nbytes for t in self.targets)


class SlotTable:
    """Which adapter (by id; 0: none) each device slot holds, and how many running requests use
    it; an adapter not resident takes a free slot, else the least recently used slot no running
    request uses. CPU bookkeeping, the same on every rank."""

    def __init__(self, num_slots: int):
        self.owner, self.users, self.last_use = [0] * num_slots, [0] * num_slots, [0] * num_slots
        self._clock = 0

    def acquire(self, lora_id: int) -> tuple[int, bool]:
        """(slot, whether its weights must be loaded)."""
        self._clock += 1
        if lora_id in self.owner:
            slot, load = self.owner.index(lora_id), False
        else:
            idle = [s for s in range(len(self.owner)) if self.users[s] == 0]
            if not idle:
                raise RuntimeError(f"no free LoRA slot for adapter {lora_id}: all {len(self.owner)} in use")
            slot, load = min(idle, key=lambda s: (self.owner[s] != 0, self.last_use[s])), True
            self.owner[slot] = lora_id
        self.users[slot] += 1
        self.last_use[slot] = self._clock
        return slot, load

    def fits(self, lora_ids: set[int]) -> bool:
        """Whether requests of these adapters can all start now."""
        missing = [i for i in lora_ids if i not in self.owner]
        idle = sum(1 for s, owner in enumerate(self.owner) if self.users[s] == 0 and owner not in lora_ids)
        return len(missing) <= idle

    def release(self, slot: int) -> None:
        assert self.users[slot] > 0, slot
        self.users[slot] -= 1

    def forget(self, lora_id: int) -> None:
        """An unloaded adapter's slot holds nothing once its last user ends (it is then free)."""
        if lora_id in self.owner and self.users[self.owner.index(lora_id)] == 0:
            self.owner[self.owner.index(lora_id)] = 0


class LoraAdapters:
    """A runner's adapters: every loaded one in host memory by id, the resident ones in the
    device's slots. `acquire` gives a starting request its adapter's slot (copying the weights in
    if they are not there), `release` hands it back when the request ends."""

    def __init__(self, model, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype):
        self.cfg, self.max_rank = cfg, max_rank
        self.slots = LoraSlots(model, num_slots, max_rank, device, dtype)
        self.table = SlotTable(num_slots)
        self.host: dict[int, LoraAdapter] = {}

    def add(self, lora_id: int, path: str) -> None:
        self.host[lora_id] = load_adapter(path, self.cfg, self.max_rank)

    def drop(self, lora_id: int) -> None:
        self.host.pop(lora_id, None)
        self.table.forget(lora_id)

    def acquire(self, lora_id: int) -> int:
        slot, load = self.table.acquire(lora_id)
        if load:
            self.slots.load(slot, self.host[lora_id])
        return slot

    def release(self, slot: int) -> None:
        self.table.release(slot)
