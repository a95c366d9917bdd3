"""The tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it.

After a row-parallel projection (attention's o, the MLP's down) every rank holds a partial sum
of the hidden states; the layer then adds their total to the residual stream and normalises it.
Unfused that is two kernels: the one-shot all-reduce (lightllm/utils/allreduce.py) and
add_rms_norm. Here one program per token row does all of it, reading its peers' rows through
symmetric memory (every rank's buffer mapped into every other's address space):

1. copy this rank's row into its own buffer;
2. barrier with the peers' programs of the same row: each signals every peer, then waits for
   every peer's signal (flags in the same symmetric buffer);
3. sum the ranks' rows in rank order (the same bits on every rank), add the residual, store
   the new residual, normalise, store the norm's output;
4. barrier again, so that no rank writes its buffer's row again (the next call) while a peer
   may still read it.

A flag is a 32-bit word in the receiver's buffer, one per (barrier, row, sender): the sender
swaps it 0 -> 1 (release; it spins while the receiver has not yet taken the previous signal),
the receiver swaps it 1 -> 0 (acquire). Every rank runs the same sequence of these kernels, so
the k-th signal on a flag is always taken by the k-th wait on it.

`one_shot_add_rms_norm_ref` is the oracle: the ranks' rows summed as the unfused path sums them
(in fp32, rounded once to the dtype), then add_rms_norm_ref. The kernel matches it bit for bit
where the unfused NCCL or one-shot sum of two ranks does (a + b rounded once). Under
TRITON_INTERPRET the kernel runs as one rank whose peers' signals are already set
(tests/test_kernels.py); on GPUs tests/test_allreduce.py runs it between ranks.
"""
import torch

from ._triton import fast_launch, next_power_of_2, tl, triton
from .rms_norm import _add_and_normalise, add_rms_norm_ref, norm_warps

START, END = 0, 1  # the two barriers' flag sets (the kernel writes them as literals: no globals in a jit)


def flag_words(max_rows: int, world_size: int) -> int:
    """32-bit flags a buffer holds: one per (barrier, row, sender)."""
    return 2 * max_rows * world_size


def one_shot_add_rms_norm_ref(parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual): residual += sum(parts) (the sum rounded once to the dtype), then RMSNorm."""
    total = torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
    return add_rms_norm_ref(total, residual, weight, eps), residual


@triton.jit
def _signal_peers(flags_ptrs, phase, row, rank, max_rows, WORLD: tl.constexpr):
    """Tell every peer's program of this row that this rank reached the barrier."""
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flags = tl.load(flags_ptrs + peer).to(tl.pointer_type(tl.int32))
            flag = flags + (phase * max_rows + row) * WORLD + rank
            while tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0:
                pass


@triton.jit
def _wait_for_peers(flags_ptrs, phase, row, rank, max_rows, WORLD: tl.constexpr):
    """Until every peer's program of this row has signalled this rank."""
    flags = tl.load(flags_ptrs + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flag = flags + (phase * max_rows + row) * WORLD + peer
            while tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys") != 1:
                pass


@fast_launch
@triton.jit
def _one_shot_add_rms_norm_kernel(x_ptr, data_ptrs, flags_ptrs, residual_ptr, weight_ptr, y_ptr, hidden, rank,
                                  max_rows, eps, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    offsets = row.to(tl.int64) * hidden + cols
    dtype = x_ptr.dtype.element_ty
    # 16-byte aligned regions (the buffer's and the offsets'): without the hint, scalar loads
    mine = tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(dtype)), 16)
    tl.store(mine + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
    tl.debug_barrier()  # every thread's part of the row is written before the signal
    _signal_peers(flags_ptrs, 0, row, rank, max_rows, WORLD)  # START
    _wait_for_peers(flags_ptrs, 0, row, rank, max_rows, WORLD)
    tl.debug_barrier()
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):  # in rank order: every rank gets the same bits
        data = tl.multiple_of(tl.load(data_ptrs + peer).to(tl.pointer_type(dtype)), 16)
        total += tl.load(data + offsets, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    total = total.to(dtype).to(tl.float32)  # the all-reduce's result, as the unfused path rounds it
    y = _add_and_normalise(total, x_ptr, residual_ptr, residual_ptr + offsets, weight_ptr, cols, mask, hidden, eps,
                           True)
    tl.store(y_ptr + offsets, y.to(dtype), mask=mask)
    tl.debug_barrier()  # this program's reads of the peers' rows are done before it says so
    _signal_peers(flags_ptrs, 1, row, rank, max_rows, WORLD)  # END
    _wait_for_peers(flags_ptrs, 1, row, rank, max_rows, WORLD)


def one_shot_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                                 data_ptrs: torch.Tensor, flags_ptrs: torch.Tensor, rank: int,
                                 max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual) as one_shot_add_rms_norm_ref of every rank's x, residual updated in place.
    data_ptrs / flags_ptrs: int64 tensors of each rank's data region and flags (of
    flag_words(max_rows, world) int32 words, zero before the first call) in its symmetric buffer;
    x: [rows <= max_rows, hidden], contiguous, its bytes within each data region."""
    rows, hidden = x.shape
    assert x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape and rows <= max_rows
    y = torch.empty_like(x)
    block = next_power_of_2(hidden)
    _one_shot_add_rms_norm_kernel[(rows,)](x, data_ptrs, flags_ptrs, residual, weight, y, hidden, rank, max_rows,
                                           eps, WORLD=data_ptrs.numel(), BLOCK=block,
                                           num_warps=norm_warps(block))
    return y, residual
