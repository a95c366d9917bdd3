"""Scatter the new tokens' K and V into their cache slots."""
import torch

from ._triton import tl, triton


def copy_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor) -> None:
    slots = slots.long()
    k_cache[slots] = k
    v_cache[slots] = v


def copy_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    raise NotImplementedError
