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

In a step of up to BESIDE_ROWS rows each projection group's shrink runs beside its base GEMM:
`start` queues it on the pool's second CUDA stream before the caller queues the GEMM (it reads only
x), and `finish` has the expand, which adds to the GEMM's output in place, wait for both; in a
CUDA graph the two streams are two branches. A decode step then has one LoRA launch a projection
group in its path instead of two. In a step of up to SHARE_ROWS rows, where the output goes to a
kernel that can add to it as it reads it (o and down, tp 1: the next norm's residual add;
gate/up: the activation; q/k/v without q/k norms: rotary_kv_), `share_beside` queues the expand
beside the GEMM too, into a zeroed fp32 share that kernel adds (RowParallelLinear.defer_lora_sum,
GatedMLP, Attention): no LoRA launch waits for the GEMM. In steps of more rows the GEMM is
compute-bound and a shrink of small row blocks beside it slows it down: both run in turn, except
in steps of LARGE_ROWS to LARGE_BESIDE_ROWS rows, whose shrink (kernels/lora.py: fewer, larger row
blocks) runs beside the GEMM again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from lightllm.common.lora_files import TARGETS, WEIGHTS_FILE, AdapterSpec, LoraAdapterError, read_adapter
from lightllm.kernels import lora as lora_kernels
from lightllm.kernels import lora_expand_, lora_segments, lora_shrink
from lightllm.kernels.lora import Segments

from .config import ModelConfig

__all__ = ["LoraAdapterError", "LoraAdapters", "load_adapter", "module_shapes", "share_beside", "shrink_beside"]

# The most rows of a step whose shrinks run beside the base GEMMs. H100, bench-8b, 16 slots of rank
# 16, a step's GEMMs and LoRA work in one CUDA graph (lora_bench.py, 2026-12-06): the LoRA work
# added 641 / 844 / 1,567 / 1,620 us beside against 1,068 / 1,248 / 2,170 / 2,044 in turn at
# 1 / 4 / 16 / 64 rows, and 2,455 against 2,375 at 256, 10,940 against 8,141 at 2,048.
BESIDE_ROWS = 64
# And from kernels/lora.py's LARGE_ROWS (blocks of 64 rows) to LARGE_BESIDE_ROWS rows. H100, the
# same bench at 4453380: 5,059 / 6,983 / 6,733 us added beside at 1,024 / 1,536 / 2,048 rows against
# 6,388 / 7,028 / 7,379 in turn; at 4,096 rows 13,806 beside against 11,129 in turn.
LARGE_BESIDE_ROWS = 2048

# The most rows of a step whose projections hand their whole share to the kernel that takes their
# output (`share_beside`). H100, bench-8b, 16 slots of rank 16 (lora_bench.py, 42fd056, 2026-12-06):
# the whole share beside added 125 / 319 / 626 / 1,222 us to the step's base GEMMs at 1 / 2 / 4 / 8
# rows, the shrink alone beside 641 / 715 / 834 / 1,046 (the side branch outlasts the small GEMMs).
SHARE_ROWS = 4


def _shrinks_beside(rows: int) -> bool:
    """Whether a step of `rows` rows runs its shrinks beside the base GEMMs."""
    return rows <= BESIDE_ROWS or lora_kernels.LARGE_ROWS <= rows <= LARGE_BESIDE_ROWS


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every projection an adapter may adapt."""
    d, h, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (cfg.num_heads * d, h), "k_proj": (cfg.num_kv_heads * d, h),
              "v_proj": (cfg.num_kv_heads * d, h), "o_proj": (h, cfg.num_heads * d), "gate_proj": (inter, h),
              "up_proj": (inter, h), "down_proj": (h, inter)}
    sparse = set(cfg.moe.layers) if cfg.moe is not None else set()
    return {f"model.layers.{i}.{TARGETS[name]}.{name}": shape for i in range(cfg.num_layers)
            for name, shape in shapes.items() if not (TARGETS[name] == "mlp" and i in sparse)}


@dataclass
class LoraAdapter:
    """An adapter's weights in host memory: module name -> (A [r, in], B * scaling [out, r]) in fp32."""

    spec: AdapterSpec
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _beside(stream: torch.cuda.Stream | None, device: torch.device):
    """Where to queue work that runs beside what the current stream takes next: `stream`, after
    what the current stream holds so far (the current stream must wait for it before reading the
    work's results); without a stream (CPU), here and now."""
    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


def shrink_beside(x: torch.Tensor, a: torch.Tensor, seg: Segments,
                  stream: torch.cuda.Stream | None) -> torch.Tensor:
    """lora_shrink(x, a, seg), queued beside what the current stream takes next (`_beside`)."""
    with _beside(stream, x.device):
        s = lora_shrink(x, a, seg)
    if stream is not None:  # its memory is not handed out again before the current stream's reads end
        s.record_stream(torch.cuda.current_stream(x.device))
    return s


def share_beside(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: Segments,
                 stream: torch.cuda.Stream | None) -> torch.Tensor:
    """The adapters' share of x's rows, fp32 [T, out] (zero in rows of no adapter), its shrink and
    expand queued beside what the current stream takes next (`_beside`)."""
    share = torch.empty(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)  # the current stream's
    with _beside(stream, x.device):
        lora_expand_(share.zero_(), lora_shrink(x, a, seg), b, seg)
    return share


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    from safetensors.torch import load_file

    spec = read_adapter(path, module_shapes(cfg), max_rank)
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

    def host_form(self, adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The adapter's slot contents for this projection, laid out as a slot holds them (its
        parts' A stacked along the rank, each part's B in its own rank columns, zero-padded) in the
        slot's dtype, on the host (page-locked where the slots are on a GPU, so that `load` is two
        asynchronous copies); None where the adapter leaves the projection alone."""
        if not any(name in adapter.weights for name, _, _, _ in self.parts):
            return None
        a_host = torch.zeros(self.a.shape[1:], dtype=self.a.dtype)
        b_host = torch.zeros(self.b.shape[1:], dtype=self.b.dtype)
        in_start, in_count = self.in_slice
        row = 0
        for i, (name, _, start, count) in enumerate(self.parts):
            pair = adapter.weights.get(name)
            if pair is not None:
                a, b = pair
                r, first = a.shape[0], i * self.max_rank
                a_host[first: first + r] = a[:, in_start: in_start + in_count]
                b_host[row: row + count, first: first + r] = b[start: start + count]
            row += count
        if self.a.is_cuda:
            a_host, b_host = a_host.pin_memory(), b_host.pin_memory()
        return a_host, b_host

    def load(self, slot: int, form: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Slot `slot` takes `host_form`'s contents (None: zeros), in stream order."""
        if form is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
            return
        self.a[slot].copy_(form[0], non_blocking=True)
        self.b[slot].copy_(form[1], non_blocking=True)

    def start(self, x: torch.Tensor) -> torch.Tensor | None:
        """Call before queueing x's base GEMM: the shrink, begun beside it (None: no row of the step
        has an adapter)."""
        seg = self.pool.segments
        if seg is None:
            return None
        return shrink_beside(x, self.a, seg, self.pool.stream if _shrinks_beside(x.shape[0]) else None)

    def finish(self, s: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
        """y (x's base output) plus the adapters' share, in place, from `start`'s shrink."""
        if s is None:
            return y
        if _shrinks_beside(y.shape[0]):
            self.join()
        return lora_expand_(y, s, self.b, self.pool.segments)

    def share_beside(self, x: torch.Tensor) -> torch.Tensor | None:
        """Call before queueing x's base GEMM, for a projection whose output goes next to a kernel
        that adds the share as it reads it (a norm, the activation, rotary_kv_): in a step of up to
        SHARE_ROWS rows, the adapters' share of x's rows, fp32 [T, out] (zero in rows of no
        adapter), its shrink and expand queued on the second stream, beside the GEMM (`join` before
        it is read). None: no adapter row, or a larger step (`start` and `finish` then)."""
        seg = self.pool.segments
        if seg is None or x.shape[0] > SHARE_ROWS:
            return None
        return share_beside(x, self.a, self.b, seg, self.pool.stream)

    def join(self) -> None:
        """The current stream waits for what `start` or `share_beside` queued on the second one."""
        if self.pool.stream is not None:
            torch.cuda.current_stream(self.pool.stream.device).wait_stream(self.pool.stream)


def _projections(layer) -> list:
    out = [layer.attn.qkv, layer.attn.o]
    mlp = layer.mlp
    if hasattr(mlp, "gate_up") and hasattr(mlp, "down"):  # a dense MLP (not the experts)
        out += [mlp.gate_up, mlp.down]
    return out


class LoraSlots:
    """The device's adapter slots, `num_slots` of rank up to `max_rank`, allocated once: attached to
    every served projection of `model`. `prepare` groups a step's rows by slot (slot -1: none), or
    turns the adapters off for a step where no row has one."""

    def __init__(self, model, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        if not model.serves_lora:  # its forward would never group a step's rows: adapters silently unused
            raise ValueError(f"LoRA adapters are not served for {type(model).__name__} yet (--max_loras 0)")
        self.num_slots = num_slots
        # where the shrinks run beside the base GEMMs (LoraTarget.start); created here,
        # not while a CUDA graph is captured
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.targets = []
        for layer in model.layers:
            for linear in _projections(layer):
                linear.lora = LoraTarget(linear, self, max_rank, device, dtype)
                self.targets.append(linear.lora)
        self.segments: Segments | None = None
        model.lora = self

    def prepare(self, slots: torch.Tensor | None) -> None:
        """slots None: no row of the step has an adapter, and the projections launch no LoRA kernel."""
        self.segments = None if slots is None else lora_segments(slots, self.num_slots)

    def host_form(self, adapter: LoraAdapter) -> list:
        """The adapter as the slots hold it, one entry a projection (LoraTarget.host_form)."""
        return [target.host_form(adapter) for target in self.targets]

    def load(self, slot: int, form: list) -> None:
        """Slot `slot` takes an adapter's `host_form`: two asynchronous copies a projection."""
        for target, part in zip(self.targets, form):
            target.load(slot, part)

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

    def place(self, lora_id: int) -> int | None:
        """A slot that holds no adapter, now `lora_id`'s (used by no request yet); None where every
        slot holds one, or the adapter is resident already."""
        if lora_id in self.owner or 0 not in self.owner:
            return None
        slot = self.owner.index(0)
        self.owner[slot] = lora_id
        return slot

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
    """A runner's adapters: every loaded one in host memory by id (as the slots hold it:
    LoraSlots.host_form), the resident ones in the device's slots. An adapter added while a slot
    holds none goes into it at once (the adapters of --lora_modules at start, up to the slots), so
    that its first request's step does not copy it in; `acquire` gives a starting request its
    adapter's slot (copying the weights in if they are not there), `release` hands it back when the
    request ends."""

    def __init__(self, model, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype):
        self.cfg, self.max_rank = cfg, max_rank
        self.slots = LoraSlots(model, num_slots, max_rank, device, dtype)
        self.table = SlotTable(num_slots)
        self.host: dict[int, list] = {}  # id -> LoraSlots.host_form

    def add(self, lora_id: int, path: str) -> None:
        self.host[lora_id] = self.slots.host_form(load_adapter(path, self.cfg, self.max_rank))
        slot = self.table.place(lora_id)
        if slot is not None:
            self.slots.load(slot, self.host[lora_id])

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
