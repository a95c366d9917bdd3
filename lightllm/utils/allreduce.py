"""The tensor-parallel all-reduce: PyTorch's symmetric memory for decode-sized messages among
the GPUs of one machine, torch.distributed (NCCL on CUDA, gloo on the CPU) for everything else.

A decode step all-reduces batch x hidden activations twice a layer: 8 KiB per request for an
8B model in bf16, 16 KiB for a 70B one. NCCL's ring and tree are built for bandwidth; at these
sizes their fixed cost dominates. Symmetric memory maps every rank's buffer into every other
rank's address space, so one kernel reads its peers' halves over NVLink directly:

- one-shot: every rank reads all peers' whole messages and sums them (one barrier at each end);
- two-shot: every rank sums 1/n of the message (reduce-scatter) and the ranks then read each
  other's sums (all-gather): n times less read by each rank, one barrier more.

`choose_path` picks by message size (ONE_SHOT_MAX_BYTES, SYMMETRIC_MAX_BYTES below; tune them
with test/benchmark/kernels/allreduce_bench.py, which times all three by size). The symmetric buffer is
allocated and exchanged once, when the group is made (init_tp), so that the decode CUDA graphs
capture only the copy into it and the reduction kernel: nothing is allocated from symmetric
memory or exchanged between ranks during capture or replay. NVLink multicast (the multimem
operations) is never used.

Symmetric memory is off, with one log line saying why, when the group spans machines, when the
group size has no compiled kernel (2, 4 and 8 do), when peer access or the set-up fails on any
rank, and where the environment variable SYMMETRIC_ENV is "0" (read here only: it exists for
before/after measurements, test/benchmark/serving/multi_gpu.sh's "-nccl" items).
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightllm.kernels.allreduce_norm import fits, flag_count, one_shot_add_rms_norm_triton

logger = logging.getLogger(__name__)

SYMMETRIC_ENV = "LIGHTLLM_SYMM_MEM_ALL_REDUCE"
# One-shot reads (n - 1) whole messages per rank, two-shot about 2 (n - 1) / n of one plus a
# barrier, so one-shot wins while a message is small, and for longer the fewer the ranks: for 2
# ranks both read one message's worth. The crossovers are those vLLM measured for its own
# one-/two-stage kernels on H100 NVLink (512 KiB up to 4 GPUs, 256 KiB at 8; "always" at 2,
# capped here at 1 MiB, as its 24 blocks may not keep up past that: allreduce_bench.py will say).
ONE_SHOT_MAX_BYTES = {2: 1 << 20, 4: 512 << 10, 8: 256 << 10}  # by group size; its keys: the sizes with kernels
# The symmetric buffer, and so the largest message it takes: the largest decode bucket at the
# default --running_max_req_size (512) x 8192 (a 70B model's hidden size) x 2 bytes (bf16).
# Larger messages (prefill) go through NCCL, which is bandwidth-bound there anyway.
SYMMETRIC_MAX_BYTES = 8 << 20
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)  # the symmetric kernels' dispatch
ANOTHER_RANK = "another rank could not set it up (see its log)"
# The all-reduce after the o and down projections fused with the residual add and RMSNorm that
# follow it (kernels/allreduce_norm.py): one kernel a layer fewer, twice. "0" turns it off
# (before/after measurements). By group size: FUSED_MAX_BYTES, the largest message it takes (at 2
# ranks a one-shot exchange moves no more bytes than two-shot, so it takes mixed steps too;
# beyond 2 the one-shot limit above), and FUSED_PROGRAMS, its programs at most (one row each up
# to as many rows; 256 measured best at 2 ranks, docs/multi_gpu.md; at 4 and 8 enough for one row
# a program at every size they take). FUSED_MAX_HIDDEN: columns a row's registers. A data region
# (fused_region_bytes) takes any message up to FUSED_MAX_BYTES: 80 MiB at 2 ranks (320 MiB a GPU
# for 2 parities and 2 senders), 4.5 and 2.25 MiB at 4 and 8 (36 MiB a GPU).
FUSED_ENV = "LIGHTLLM_FUSED_ALL_REDUCE_NORM"
FUSED_MAX_HIDDEN = 16384
FUSED_MAX_BYTES = {2: 64 << 20, 4: ONE_SHOT_MAX_BYTES[4], 8: ONE_SHOT_MAX_BYTES[8]}
FUSED_PROGRAMS = {2: 256, 4: 64, 8: 32}
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALIGNMENT = 16  # bytes: the kernels' vector width, for the message's start and its length


class AllReducePath(enum.Enum):
    COLLECTIVE = "torch.distributed"  # NCCL on CUDA, gloo on the CPU
    ONE_SHOT = "one-shot"
    TWO_SHOT = "two-shot"


def choose_path(nbytes: int, dtype: torch.dtype, world_size: int, capacity: int) -> AllReducePath:
    """Where a contiguous, aligned message of `nbytes` goes, given a symmetric buffer of
    `capacity` bytes (0: none)."""
    if capacity == 0 or dtype not in SYMMETRIC_DTYPES or nbytes % ALIGNMENT or nbytes > capacity:
        return AllReducePath.COLLECTIVE
    return AllReducePath.ONE_SHOT if nbytes <= ONE_SHOT_MAX_BYTES[world_size] else AllReducePath.TWO_SHOT


def symmetric_unsupported(device_type: str, world_size: int, single_node: bool, enabled: bool) -> str | None:
    """Why a group cannot use symmetric memory, or None when it may try."""
    if device_type != "cuda":
        return f"{device_type} device (gloo)"
    if not single_node:
        return "the group spans machines (--nnodes > 1)"
    if world_size not in ONE_SHOT_MAX_BYTES:
        return f"no symmetric kernels for {world_size} ranks (only {sorted(ONE_SHOT_MAX_BYTES)})"
    if not enabled:
        return f"{SYMMETRIC_ENV}=0"
    return None


def symmetric_enabled() -> bool:
    return os.environ.get(SYMMETRIC_ENV, "1") != "0"


class SymmetricAllReduce:
    """One symmetric buffer, exchanged among the group once. Its first `capacity` bytes take
    torch's one-shot and two-shot kernels' messages (each call copies its message there and
    reduces it); after them, unless FUSED_ENV is "0", the fused all-reduce + add + RMSNorm's
    rows (a region per epoch parity and sender, which the senders push their rows into) and its
    flags (kernels/allreduce_norm.py)."""

    def __init__(self, buffer: torch.Tensor, group_name: str, world_size: int, capacity: int,
                 fused: FusedRegions | None = None):
        self.buffer, self.group_name, self.world_size = buffer, group_name, world_size
        self.capacity = capacity
        self.fused = fused
        # The copy into the buffer fused into the one-shot kernel (torch >= 2.8).
        self._one_shot_copy = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)

    @classmethod
    def create(cls, device: torch.device, world_size: int, capacity: int, fused_bytes: int | None = None,
               programs: int | None = None, fused: bool = True) -> SymmetricAllReduce:
        """fused_bytes: the largest message the fused kernel takes, programs its most programs
        (FUSED_MAX_BYTES and FUSED_PROGRAMS by default; allreduce_bench.py tries others); without
        `fused` (or with FUSED_ENV "0") no fused kernel, and no regions for it."""
        # Ask torch not to map the buffer for NVLink multicast: no multimem op runs here, and the
        # shared machines this is measured on forbid it (docs/multi_gpu.md).
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        fused = fused and os.environ.get(FUSED_ENV, "1") != "0"
        programs = programs or FUSED_PROGRAMS[world_size]
        region_bytes = fused_region_bytes(fused_bytes or FUSED_MAX_BYTES[world_size], programs)
        data_bytes = 2 * world_size * region_bytes if fused else 0  # a region per parity and sender
        flag_bytes = 8 * flag_count(programs, world_size) if fused else 0
        buffer = symm_mem.empty(capacity + data_bytes + flag_bytes, dtype=torch.uint8, device=device)
        buffer[capacity + data_bytes:].zero_()  # the flags: zero on every rank before any peer can signal
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(buffer, group_name)
        for op in ("one_shot_all_reduce_out", "two_shot_all_reduce_out"):
            getattr(torch.ops.symm_mem, op)  # AttributeError now rather than at the first step
        regions = None
        if fused:
            bases = [int(p) for p in handle.buffer_ptrs]  # every rank's buffer, mapped here
            regions = FusedRegions(
                data_ptrs=torch.tensor([b + capacity for b in bases], dtype=torch.int64, device=device),
                flags_ptrs=torch.tensor([b + capacity + data_bytes for b in bases], dtype=torch.int64, device=device),
                counters=torch.zeros(programs, dtype=torch.int64, device=device),
                rank=dist.get_rank(), region_bytes=region_bytes,
                max_bytes=fused_bytes or FUSED_MAX_BYTES[world_size])
        return cls(buffer, group_name, world_size, capacity, regions)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(residual + sum of x over the ranks), residual) in one kernel, residual
        updated in place; None where the fused kernel does not take these tensors."""
        fused = self.fused
        if (fused is None or residual is None or x.dim() != 2 or x.dtype not in FUSED_DTYPES
                or residual.dtype != x.dtype or weight.dtype != x.dtype or residual.shape != x.shape
                or not (x.is_contiguous() and residual.is_contiguous()) or x.shape[1] > FUSED_MAX_HIDDEN
                or x.numel() * x.element_size() > fused.max_bytes
                or not fits(x.shape[0], x.shape[1], fused.counters.numel(), fused.region_bytes // x.element_size())):
            return None
        return one_shot_add_rms_norm_triton(x, residual, weight, eps, data_ptrs=fused.data_ptrs,
                                            flags_ptrs=fused.flags_ptrs, counters=fused.counters, rank=fused.rank,
                                            region_bytes=fused.region_bytes)

    def path(self, x: torch.Tensor) -> AllReducePath:
        if not x.is_contiguous() or (x.storage_offset() * x.element_size()) % ALIGNMENT:
            return AllReducePath.COLLECTIVE
        return choose_path(x.numel() * x.element_size(), x.dtype, self.world_size, self.capacity)

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks in a new tensor."""
        flat = x.view(-1)
        staged, out = self._staging(flat), torch.empty_like(flat)
        if self._one_shot_copy is not None:
            self._one_shot_copy(staged, flat, "sum", self.group_name, out)
        else:
            staged.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out.view_as(x)

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, written into x (which the kernel does not read)."""
        flat = x.view(-1)
        staged = self._staging(flat)
        staged.copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return x

    def _staging(self, flat: torch.Tensor) -> torch.Tensor:
        return self.buffer[: flat.numel() * flat.element_size()].view(flat.dtype)


@dataclass(frozen=True)
class FusedRegions:
    """Where the fused all-reduce + add + RMSNorm finds every rank's rows and flags."""

    data_ptrs: torch.Tensor  # int64 [world]: each rank's data regions, as mapped on this rank
    flags_ptrs: torch.Tensor  # int64 [world]: each rank's flags
    counters: torch.Tensor  # int64 [programs]: this rank's calls so far, per program (the epochs)
    rank: int
    region_bytes: int  # each data region's size
    max_bytes: int  # the largest message it takes


def fused_region_bytes(max_bytes: int, programs: int) -> int:
    """A data region of the fused kernel: slots of a program's share of max_bytes plus one row of
    FUSED_MAX_HIDDEN fp32, so that every message up to max_bytes fits (slots() rounds a
    program's rows up: at most one row more than its share)."""
    slot = -(-max_bytes // programs) + 4 * FUSED_MAX_HIDDEN
    return -(-slot // 16) * 16 * programs


def setup_symmetric(device: torch.device, world_size: int, single_node: bool,
                    capacity: int = SYMMETRIC_MAX_BYTES, fused: bool = True) -> SymmetricAllReduce | None:
    """Every rank of the (just initialised) group calls this once; all get a SymmetricAllReduce
    or all get None (NCCL for every message). One log line says which: rank 0's, and that of a
    rank whose own set-up failed."""
    if device.type != "cuda":
        return None  # gloo: nothing to say
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    reason = symmetric_unsupported(device.type, world_size, single_node, symmetric_enabled())
    same_on_all_ranks = reason is not None
    symmetric = None
    if reason is None:
        reason = _agree(_peer_access_problem(device), device)
    if reason is None:
        try:
            symmetric = SymmetricAllReduce.create(device, world_size, capacity, fused=fused)
        except Exception as exc:  # any failure of an alpha API means NCCL, never a dead server
            reason = f"set-up failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        reason = _agree(reason, device)
    if reason is None:
        if dist.get_rank() == 0:
            fused = symmetric.fused
            logger.info("all-reduce: symmetric memory, one-shot up to %d KiB, two-shot up to %d KiB, NCCL above; "
                        "fused with the next add + RMSNorm up to %s", ONE_SHOT_MAX_BYTES[world_size] >> 10,
                        capacity >> 10, "off" if fused is None else f"{fused.max_bytes >> 10} KiB")
        return symmetric
    if dist.get_rank() == 0 or not (same_on_all_ranks or reason == ANOTHER_RANK):
        logger.warning("all-reduce: NCCL for every message (symmetric memory off: %s)", reason)
    return None


def _peer_access_problem(device: torch.device) -> str | None:
    """Whether this rank's GPU can map every peer's memory (what the symmetric buffer needs)."""
    mine = torch.tensor([device.index], device=device)
    indices = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(indices, mine)
    for peer in {int(i) for i in indices} - {device.index}:
        if not torch.cuda.can_device_access_peer(device.index, peer):
            return f"GPU {device.index} has no peer access to GPU {peer}"
    return None


def _agree(reason: str | None, device: torch.device) -> str | None:
    """`reason`, or a stand-in where only another rank has one: all ranks go the same way."""
    ok = torch.tensor([int(reason is None)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if reason is None and not ok.item():
        return ANOTHER_RANK
    return reason
