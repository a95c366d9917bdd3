"""Tensor-parallel process group: gloo on CPU, NCCL on CUDA, localhost only."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group; collectives are no-ops for one rank."""

    rank: int = 0
    world_size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (used once at start-up, so the sync is fine)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def init_tp(rank: int, world_size: int, port: int, device: torch.device | str) -> TPGroup:
    """Join the localhost TP group (a no-op for world_size 1) and return this rank's TPGroup."""
    if not 0 <= rank < world_size:
        raise ValueError(f"tp rank {rank} is outside the group of {world_size}")
    device = torch.device(device)
    if world_size == 1:
        return TPGroup()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                device_id=device if device.type == "cuda" else None)
        logger.info("tp rank %d/%d joined (%s, port %d)", rank, world_size, backend, port)
    return TPGroup(rank, world_size)
