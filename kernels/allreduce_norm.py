"""The tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it.

After a row-parallel projection (attention's o, the MLP's down) every rank holds a partial sum
of the hidden states; the layer then adds their total to the residual stream and normalises it.
Unfused that is two kernels: the one-shot all-reduce (lightllm/utils/allreduce.py) and
add_rms_norm. Here one program per token row does all of it, reading its peers' rows through
symmetric memory (every rank's buffer mapped into every other's address space):

1. count this row's call: its epoch, one more than the last (a per-row counter in this rank's
   own memory, so a CUDA graph's replays count too);
2. push this rank's row into every peer's buffer, into the region of (the epoch's parity, this
   rank): each buffer has one per parity and sender;
3. signal every peer (store the epoch in the peer's flag of this row and sender, release: the
   row lands first), then wait until every peer's flag here has reached the epoch (acquire);
4. sum the ranks' rows in rank order (the peers' from this rank's own buffer, where they were
   pushed; the same bits on every rank), add the residual, store the new residual, normalise,
   store the norm's output.

Pushed rows, not pulled: a rank's stores to its peers are posted, and what it reads after the
barrier is local, so a call costs one NVLink round trip (the signal's), not two (signal, then
the peers' rows read over the link). No barrier at the end either. A rank writes a peer's
region of one parity again two epochs later, and it can only be there after that peer has
signalled the epoch between: a peer signals an epoch when its program of that row starts,
which is after the kernel of the epoch before, and so its reads of that region, have ended (one
stream). A peer may be one epoch ahead when a rank waits (it signalled, passed the barrier and
started the next call): its flag then exceeds the epoch, which is why the wait is for "at
least". Every rank runs the same sequence of these kernels with the same rows, so a row's epoch
is the same on every rank. Counters and flags are int64: they never wrap.

`one_shot_add_rms_norm_ref` is the oracle: the ranks' rows summed as the unfused path sums them
(in fp32, rounded once to the dtype), then add_rms_norm_ref. The kernel matches it bit for bit
where the unfused NCCL or one-shot sum of two ranks does (a + b rounded once). Under
TRITON_INTERPRET the kernel runs as one rank whose peers' signals are already set
(tests/test_kernels.py), or as two processes over shared CPU memory (tests/test_allreduce.py);
on GPUs tests/test_allreduce.py runs it between ranks.
"""
import torch

from ._triton import fast_launch, grid_dependency_wait, next_power_of_2, pdl, tl, triton
from .rms_norm import _add_and_normalise, add_rms_norm_ref, norm_warps


def flag_count(max_rows: int, world_size: int) -> int:
    """int64 flags a rank's buffer holds: one per (row, sender)."""
    return max_rows * world_size


def one_shot_add_rms_norm_ref(parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual): residual += sum(parts) (the sum rounded once to the dtype), then RMSNorm."""
    total = torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
    return add_rms_norm_ref(total, residual, weight, eps), residual


@triton.jit
def _barrier(flags_ptrs, epoch, row, rank, WORLD: tl.constexpr):
    """Signal every peer's program of this row that this rank reached `epoch`, then wait until
    every peer has reached it (or gone past)."""
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flags = tl.load(flags_ptrs + peer).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flags + row * WORLD + rank, epoch, sem="release", scope="sys")
    mine = tl.load(flags_ptrs + rank).to(tl.pointer_type(tl.int64))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            while tl.atomic_add(mine + row * WORLD + peer, 0, sem="acquire", scope="sys") < epoch:
                pass


@fast_launch
@triton.jit
def _one_shot_add_rms_norm_kernel(x_ptr, data_ptrs, flags_ptrs, counters_ptr, residual_ptr, weight_ptr, y_ptr,
                                  hidden, rank, region_elems, eps, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                                  PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    offsets = row.to(tl.int64) * hidden + cols
    # Before anything is read or written: x is the projection's output, and the epoch argument
    # (module docstring) needs every earlier kernel of this stream ended, which the wait gives
    # (the projection ahead was launched only after them).
    grid_dependency_wait(PDL)
    epoch = tl.load(counters_ptr + row) + 1  # this program alone touches its row's counter
    tl.store(counters_ptr + row, epoch)
    parity = (epoch % 2) * WORLD  # the first of this parity's regions, one per sender
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    for peer in tl.static_range(WORLD):
        if peer != rank:
            # 16-byte aligned regions (the buffer's and the offsets'): without the hint, scalar stores
            theirs = tl.multiple_of(tl.load(data_ptrs + peer).to(tl.pointer_type(dtype)), 16)
            tl.store(theirs + (parity + rank) * region_elems + offsets, x, mask=mask)
    tl.debug_barrier()  # every thread's part of the row is pushed before the signal
    _barrier(flags_ptrs, epoch, row, rank, WORLD)
    tl.debug_barrier()
    mine = tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(dtype)), 16)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for sender in tl.static_range(WORLD):  # in rank order: every rank gets the same bits
        if sender == rank:
            total += x.to(tl.float32)
        else:
            total += tl.load(mine + (parity + sender) * region_elems + offsets, mask=mask, other=0.0,
                             cache_modifier=".cg").to(tl.float32)
    total = total.to(dtype).to(tl.float32)  # the all-reduce's result, as the unfused path rounds it
    y = _add_and_normalise(total, x_ptr, residual_ptr, residual_ptr + offsets, weight_ptr, cols, mask, hidden, eps,
                           True)
    tl.store(y_ptr + offsets, y.to(dtype), mask=mask)


def one_shot_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                                 data_ptrs: torch.Tensor, flags_ptrs: torch.Tensor, counters: torch.Tensor,
                                 rank: int, region_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual) as one_shot_add_rms_norm_ref of every rank's x, residual updated in place.
    data_ptrs / flags_ptrs: int64 tensors of each rank's data (2 x world regions of region_bytes,
    one after the other: parity 0's per sender, then parity 1's) and flags
    (flag_count(len(counters), world) int64, zero before the first call) in its symmetric buffer;
    counters: this rank's int64 epoch per row (zero before the first call, on this device).
    x: [rows <= len(counters), hidden], contiguous, its bytes within a region (16-byte aligned)."""
    rows, hidden = x.shape
    assert x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape and rows <= counters.numel()
    assert x.numel() * x.element_size() <= region_bytes and region_bytes % 16 == 0 and counters.dtype == torch.int64
    y = torch.empty_like(x)
    block = next_power_of_2(hidden)
    _one_shot_add_rms_norm_kernel[(rows,)](x, data_ptrs, flags_ptrs, counters, residual, weight, y, hidden, rank,
                                           region_bytes // x.element_size(), eps, WORLD=data_ptrs.numel(),
                                           BLOCK=block, num_warps=norm_warps(block), **pdl(x))
    return y, residual
