"""Warming the GPU's L2 cache with a weight the next GEMM will read.

A batch-1 decode step streams every weight once, and between the q/k/v and the o projection the
memory bus idles while rotary, the KV write and attention (a few MB) run. Started before them, a
prefetch of the o projection's weight can fill L2, so that the GEMM reads it from there.

- `prefetch_l2(t, "bulk")`: one program issues Hopper's bulk L2 prefetch
  (`cp.async.bulk.prefetch.L2`) for the tensor in chunks and ends; the copies run on in the memory
  system while the next kernels run. sm90 and newer.
- `prefetch_l2(t, "load")`: programs read the tensor (kept in L2 by their eviction hint) and fold
  it into one word each; for a second stream, beside the kernels it overlaps.

Neither changes any value the model computes; on a CPU (the reference) it does nothing.
"""
from __future__ import annotations

import torch

from ._triton import cdiv, fast_launch, next_power_of_2, tl, triton

BULK_CHUNK = 1 << 16  # bytes a bulk prefetch instruction asks for
LOAD_PROGRAMS, LOAD_BLOCK = 64, 4096  # the load form: programs, int32 words a program loads a step


def prefetch_l2_ref(t: torch.Tensor, mode: str = "bulk") -> None:
    """The CPU path: no cache to warm."""


@fast_launch
@triton.jit
def _bulk_prefetch_kernel(ptr, num_bytes, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    offsets = tl.arange(0, CHUNKS).to(tl.int64) * CHUNK
    sizes = tl.minimum(num_bytes - offsets, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + offsets, sizes], dtype=tl.int32, is_pure=False, pack=1)


@fast_launch
@triton.jit
def _load_prefetch_kernel(ptr, num_words, words_per_program, scratch_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * words_per_program
    end = tl.minimum(start + words_per_program, num_words)
    acc = tl.zeros([BLOCK], tl.int32)
    for offset in range(start, end, BLOCK):
        words = offset + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + words, mask=words < end, other=0, eviction_policy="evict_last")
    tl.store(scratch_ptr + pid, tl.xor_sum(acc, axis=0))


_SCRATCH: dict[torch.device, torch.Tensor] = {}


def prefetch_l2_triton(t: torch.Tensor, mode: str = "bulk") -> None:
    """Start bringing contiguous `t` into L2 ("bulk" or "load", above)."""
    assert t.is_contiguous()
    num_bytes = t.numel() * t.element_size()
    if mode == "bulk":
        chunks = max(16, next_power_of_2(cdiv(num_bytes, BULK_CHUNK)))
        _bulk_prefetch_kernel[(1,)](t.view(torch.uint8).view(-1), num_bytes, CHUNK=BULK_CHUNK, CHUNKS=chunks,
                                    num_warps=4)
        return
    words = t.view(-1).view(torch.int32)
    scratch = _SCRATCH.get(t.device)
    if scratch is None:
        scratch = _SCRATCH[t.device] = torch.zeros(LOAD_PROGRAMS, dtype=torch.int32, device=t.device)
    _load_prefetch_kernel[(LOAD_PROGRAMS,)](words, words.numel(), cdiv(words.numel(), LOAD_PROGRAMS), scratch,
                                            BLOCK=LOAD_BLOCK, num_warps=4)
