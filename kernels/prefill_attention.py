"""Causal attention over a packed batch of variable-length prompts (no padding), GQA."""
import torch

from ._triton import tl, triton


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          max_seqlen: int, sm_scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hk, D]; sequence i holds tokens cu_seqlens[i]:cu_seqlens[i+1]."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()  # CPU path: a host copy is fine here
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs = q[start:end].float().transpose(0, 1)  # [Hq, L, D]
        ks = k[start:end].float().transpose(0, 1).repeat_interleave(group, dim=0)
        vs = v[start:end].float().transpose(0, 1).repeat_interleave(group, dim=0)
        scores = (qs @ ks.transpose(1, 2)) * sm_scale
        length = end - start
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        out[start:end] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return out


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                             max_seqlen: int, sm_scale: float) -> torch.Tensor:
    raise NotImplementedError
