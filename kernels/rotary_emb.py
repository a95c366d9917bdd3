"""Rotary position embedding, in place, HF Llama "rotate_half" layout (i pairs with i + D/2)."""
import torch

from ._triton import tl, triton


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def rotary_emb_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _rotate_ref(q, cos, sin)
    _rotate_ref(k, cos, sin)


def rotary_emb_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    raise NotImplementedError
