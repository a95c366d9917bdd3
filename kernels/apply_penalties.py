"""Presence, frequency and repetition penalties over each request's generated-token counts."""
import torch

from ._triton import fast_launch, tl, triton


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


@fast_launch
@triton.jit
def _apply_penalties_kernel(logits_ptr, presence_ptr, frequency_ptr, repetition_ptr, token_ids_ptr,
                            token_counts_ptr, cu_offsets_ptr, logits_stride, BLOCK: tl.constexpr):
    req = tl.program_id(0)
    start = tl.load(cu_offsets_ptr + req)
    end = tl.load(cu_offsets_ptr + req + 1)
    presence = tl.load(presence_ptr + req).to(tl.float32)
    frequency = tl.load(frequency_ptr + req).to(tl.float32)
    repetition = tl.load(repetition_ptr + req).to(tl.float32)
    row_ptr = logits_ptr + req.to(tl.int64) * logits_stride
    for first in range(start, end, BLOCK):
        offsets = first + tl.arange(0, BLOCK)
        mask = offsets < end
        ids = tl.load(token_ids_ptr + offsets, mask=mask, other=0)
        counts = tl.load(token_counts_ptr + offsets, mask=mask, other=0).to(tl.float32)
        logit = tl.load(row_ptr + ids, mask=mask, other=0.0)
        logit = tl.where(logit > 0, logit / repetition, logit * repetition)
        logit = logit - frequency * counts - presence * (counts > 0).to(tl.float32)
        tl.store(row_ptr + ids, logit, mask=mask)


def apply_penalties_triton(logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                           repetition: torch.Tensor, token_ids: torch.Tensor, token_counts: torch.Tensor,
                           cu_offsets: torch.Tensor) -> None:
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    _apply_penalties_kernel[(logits.shape[0],)](logits, presence, frequency, repetition, token_ids, token_counts,
                                                cu_offsets, logits.stride(0), BLOCK=256, num_warps=4)
