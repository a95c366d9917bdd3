"""Gated MLP activation: silu(gate) * up, with x = [gate | up] along the last dim."""
import torch
import torch.nn.functional as F

from ._triton import tl, triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    return (F.silu(x[:, :inter].float()) * x[:, inter:].float()).to(x.dtype)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError
