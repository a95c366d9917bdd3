"""Presence, frequency and repetition penalties over each request's generated-token counts."""
import torch

from ._triton import tl, triton


def apply_penalties_ref(logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                        repetition: torch.Tensor, token_ids: torch.Tensor, token_counts: torch.Tensor,
                        cu_offsets: torch.Tensor) -> None:
    """Request b's (id, count) pairs are token_ids/token_counts[cu_offsets[b]:cu_offsets[b+1]]."""
    batch = logits.shape[0]
    # output_size avoids a device sync on CUDA; the ids of one request are assumed unique.
    rows = torch.repeat_interleave(torch.arange(batch, device=logits.device), cu_offsets.diff().long(),
                                   output_size=token_ids.numel())
    ids = token_ids.long()
    counts = token_counts.float()
    picked = logits[rows, ids]
    rep = repetition[rows]
    picked = torch.where(picked > 0, picked / rep, picked * rep)
    picked = picked - frequency[rows] * counts - presence[rows] * (counts > 0).float()
    logits[rows, ids] = picked


def apply_penalties_triton(logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                           repetition: torch.Tensor, token_ids: torch.Tensor, token_counts: torch.Tensor,
                           cu_offsets: torch.Tensor) -> None:
    raise NotImplementedError
