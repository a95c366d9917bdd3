"""A weight pulled into the GPU's L2 cache ahead of the GEMM that reads it.

In a small decode step the projections stream their weights from HBM at copy speed, and between
them run kernels that read almost nothing (attention over one request's keys, norms, rotary):
for those microseconds HBM idles. Launched on a second stream beside them, `l2_prefetch` asks
the memory system for the first `nbytes` of the next GEMM's weight, so that GEMM finds part of
it in L2. A hint with no result: the reference does nothing, and so does the CPU path.

Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2`) fetches CHUNK bytes an instruction, one
instruction a thread; with `evict_last` the lines are kept in preference to the streaming reads
that follow until the GEMM has read them.
"""
import torch

from ._triton import cdiv, fast_launch, tl, triton

CHUNK = 16384  # bytes a prefetch instruction (the bulk copy takes any multiple of 16)
PER_PROGRAM = 32  # instructions a program, one a thread

PREFETCH_ASM = {
    "last": ("{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $2, 0; "
             "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
             "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $3, pol; mov.b32 $0, 0; }"),
    "normal": "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.b32 $0, 0; }",
}


def l2_prefetch_ref(weight: torch.Tensor, nbytes: int, policy: str = "last") -> None:
    """Nothing to do: the prefetch changes no value, only where the bytes wait."""


@fast_launch
@triton.jit
def _l2_prefetch_kernel(ptr, chunks, ASM: tl.constexpr, PER_PROGRAM: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    size = tl.full([PER_PROGRAM], CHUNK, tl.int32)
    tl.inline_asm_elementwise(ASM, "=r,l,r,r", [ptr + i.to(tl.int64) * CHUNK, (i < chunks).to(tl.int32), size],
                              dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch_triton(weight: torch.Tensor, nbytes: int, policy: str = "last") -> None:
    """Prefetch the first min(nbytes, its size) bytes of the contiguous `weight` into L2, with the
    evict_last priority (`policy` "last") or the normal one."""
    chunks = min(nbytes, weight.numel() * weight.element_size()) // CHUNK
    if chunks == 0:
        return
    flat = weight.view(torch.uint8) if weight.element_size() == 1 else weight.view(-1).view(torch.uint8)
    _l2_prefetch_kernel[(cdiv(chunks, PER_PROGRAM),)](flat, chunks, ASM=PREFETCH_ASM[policy], PER_PROGRAM=PER_PROGRAM,
                                                      CHUNK=CHUNK, num_warps=max(1, min(4, PER_PROGRAM // 32)))
