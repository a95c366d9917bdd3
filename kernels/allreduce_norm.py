"""The tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it.

After a row-parallel projection (attention's o, the MLP's down) every rank holds a partial sum
of the hidden states; the layer then adds their total to the residual stream and normalises it.
Unfused that is two kernels: the one-shot all-reduce (lightllm/utils/allreduce.py) and
add_rms_norm. Here each program does all of it for a block of token rows, its peers' rows
pushed to it through symmetric memory (every rank's buffer mapped into every other's address
space). Program p takes rows [p R, p R + R), R the fewest the buffers' slots allow (slots():
one row a program for a decode step of up to len(counters) rows), and owns counter p, flag p of
each sender and slot p of every data region:

1. count this program's call: its epoch, one more than the last (a per-program counter in this
   rank's own memory, so a CUDA graph's replays count too);
2. push this rank's rows into slot p of every peer's region of (the epoch's parity, this rank):
   each buffer has a region per parity and sender;
3. signal every peer (store the epoch in the peer's flag of program p and this sender, release:
   the rows land first), then wait until every peer's flag here has reached the epoch (acquire);
4. for each row, sum the ranks' rows in rank order (the peers' from this rank's own buffer,
   where they were pushed; the same bits on every rank), add the residual, store the new
   residual, normalise, store the norm's output.

Large messages (a mixed step's thousands of rows) go the same way: at two ranks a one-shot
exchange moves as many bytes over each link direction as a reduce-scatter and all-gather do,
with one meeting instead of two and the add and norm in the same pass.

Pushed rows, not pulled: a rank's stores to its peers are posted, and what it reads after the
barrier is local, so a call costs one NVLink round trip (the signal's), not two (signal, then
the peers' rows read over the link). No barrier at the end either. A rank writes a peer's
slot of one parity again two epochs later, and it can only be there after that peer has
signalled the epoch between: a peer signals an epoch when its program p starts, which is
after the kernel of the epoch before, and so its reads of that slot, have ended (one stream).
Slot p is program p's whatever a call's row count, so a call with other rows per program
cannot race an earlier one. A peer may be one epoch ahead when a rank waits (it signalled,
passed the barrier and started the next call): its flag then exceeds the epoch, which is why
the wait is for "at least". Every rank runs the same sequence of these kernels with the same rows, so a program's
epoch is the same on every rank. Counters and flags are int64: they never wrap.

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


def flag_count(programs: int, world_size: int) -> int:
    """int64 flags a rank's buffer holds: one per (program, sender)."""
    return programs * world_size


def one_shot_add_rms_norm_ref(parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual): residual += sum(parts) (the sum rounded once to the dtype), then RMSNorm."""
    total = torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
    return add_rms_norm_ref(total, residual, weight, eps), residual


@triton.jit
def _barrier(flags_ptrs, epoch, row, rank, WORLD: tl.constexpr):
    """Signal every peer's program `row` that this rank reached `epoch`, then wait until every
    peer has reached it (or gone past)."""
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flags = tl.load(flags_ptrs + peer).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flags + row * WORLD + rank, epoch, sem="release", scope="sys")
    mine = tl.load(flags_ptrs + rank).to(tl.pointer_type(tl.int64))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            while tl.atomic_add(mine + row * WORLD + peer, 0, sem="acquire", scope="sys") < epoch:
                pass


@triton.jit
def _push_row(x, data_ptrs, parity, rank, region_elems, at, cols, mask, WORLD: tl.constexpr):
    """Store one row of this rank's into every peer's region of (parity, this rank), at `at`."""
    for peer in tl.static_range(WORLD):
        if peer != rank:
            # 16-byte aligned regions (the buffer's and the offsets'): without the hint, scalar stores
            theirs = tl.multiple_of(tl.load(data_ptrs + peer).to(tl.pointer_type(x.dtype)), 16)
            tl.store(theirs + (parity + rank) * region_elems + at + cols, x, mask=mask)


@triton.jit
def _finish_row(x, mine, x_ptr, residual_ptr, weight_ptr, y_ptr, offsets, parity, rank, region_elems, at, cols, mask,
                hidden, eps, WORLD: tl.constexpr):
    """Sum one row over the ranks (the peers' from this rank's own buffer, at `at` of their
    regions; in rank order, so every rank gets the same bits), add the residual, normalise."""
    total = tl.zeros(x.shape, dtype=tl.float32)
    for sender in tl.static_range(WORLD):
        if sender == rank:
            total += x.to(tl.float32)
        else:
            total += tl.load(mine + (parity + sender) * region_elems + at + cols, mask=mask, other=0.0,
                             cache_modifier=".cg").to(tl.float32)
    total = total.to(x.dtype).to(tl.float32)  # the all-reduce's result, as the unfused path rounds it
    y = _add_and_normalise(total, x_ptr, residual_ptr, residual_ptr + offsets, weight_ptr, cols, mask, hidden, eps,
                           True)
    tl.store(y_ptr + offsets, y.to(x.dtype), mask=mask)


@fast_launch
@triton.jit
def _one_shot_add_rms_norm_kernel(x_ptr, data_ptrs, flags_ptrs, counters_ptr, residual_ptr, weight_ptr, y_ptr,
                                  rows, rows_per_program, hidden, rank, region_elems, slot_elems, eps,
                                  WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program p takes rows [p R, p R + R) (R = rows_per_program; the last program fewer) and
    meets its peers' program p once, through counter, flags and slot p (module docstring)."""
    program = tl.program_id(0)
    first = program * rows_per_program
    count = tl.minimum(rows - first, rows_per_program)  # at least 1: the grid has no empty program
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    slot = program.to(tl.int64) * slot_elems
    # Before anything is read or written: x is the projection's output, and the epoch argument
    # (module docstring) needs every earlier kernel of this stream ended, which the wait gives
    # (the projection ahead was launched only after them).
    grid_dependency_wait(PDL)
    # This program alone touches its counter, but the program of this index in an earlier call
    # may have run on another SM: read it from L2 (.cg), never from a stale line of this SM's L1.
    epoch = tl.load(counters_ptr + program, cache_modifier=".cg") + 1
    tl.store(counters_ptr + program, epoch)
    parity = (epoch % 2) * WORLD  # the first of this parity's regions, one per sender
    # The first row stays in registers from its push to its sum (a decode step of few rows has
    # one a program); the others are read again after the barrier.
    offsets = first.to(tl.int64) * hidden + cols
    x_first = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    _push_row(x_first, data_ptrs, parity, rank, region_elems, slot, cols, mask, WORLD)
    for i in range(1, count):
        x = tl.load(x_ptr + offsets + i * hidden, mask=mask, other=0.0)
        _push_row(x, data_ptrs, parity, rank, region_elems, slot + i * hidden, cols, mask, WORLD)
    tl.debug_barrier()  # every thread's part of the rows is pushed before the signal
    _barrier(flags_ptrs, epoch, program, rank, WORLD)
    tl.debug_barrier()
    mine = tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(x_first.dtype)), 16)
    _finish_row(x_first, mine, x_ptr, residual_ptr, weight_ptr, y_ptr, offsets, parity, rank, region_elems, slot,
                cols, mask, hidden, eps, WORLD)
    for i in range(1, count):
        x = tl.load(x_ptr + offsets + i * hidden, mask=mask, other=0.0)
        _finish_row(x, mine, x_ptr, residual_ptr, weight_ptr, y_ptr, offsets + i * hidden, parity, rank, region_elems,
                    slot + i * hidden, cols, mask, hidden, eps, WORLD)


def slots(rows: int, hidden: int, programs: int, region_elems: int) -> tuple[int, int, int]:
    """(rows a program, programs launched, elements of a program's slot in each region) for a
    call of `rows` rows, where the buffers give `programs` counters and flags per sender and
    regions of `region_elems`: the fewest rows a program that `programs` programs allow, no
    program empty. Slot p of every region is program p's; a slot's start is 16-element aligned."""
    if not fits(rows, hidden, programs, region_elems):
        raise ValueError(f"{rows} rows of {hidden} do not fit {programs} slots of {_slot_elems(region_elems, programs)}"
                         " elements")
    per_program = -(-rows // programs)
    return per_program, -(-rows // per_program), _slot_elems(region_elems, programs)


def fits(rows: int, hidden: int, programs: int, region_elems: int) -> bool:
    """Whether slots() takes a call of these rows."""
    return -(-rows // programs) * hidden <= _slot_elems(region_elems, programs)


def _slot_elems(region_elems: int, programs: int) -> int:
    return region_elems // programs // 16 * 16


def one_shot_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                                 data_ptrs: torch.Tensor, flags_ptrs: torch.Tensor, counters: torch.Tensor,
                                 rank: int, region_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual) as one_shot_add_rms_norm_ref of every rank's x, residual updated in place.
    data_ptrs / flags_ptrs: int64 tensors of each rank's data (2 x world regions of region_bytes,
    one after the other: parity 0's per sender, then parity 1's) and flags
    (flag_count(len(counters), world) int64, zero before the first call) in its symmetric buffer;
    counters: this rank's int64 epoch per program (zero before the first call, on this device):
    as many programs at most, each with a slot of every region (slots()). Every rank's calls must
    see the same len(counters) and region_bytes. x: [rows, hidden], contiguous."""
    rows, hidden = x.shape
    assert x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape and rows > 0
    assert region_bytes % 16 == 0 and counters.dtype == torch.int64
    per_program, programs, slot_elems = slots(rows, hidden, counters.numel(), region_bytes // x.element_size())
    y = torch.empty_like(x)
    block = next_power_of_2(hidden)
    _one_shot_add_rms_norm_kernel[(programs,)](x, data_ptrs, flags_ptrs, counters, residual, weight, y, rows,
                                               per_program, hidden, rank, region_bytes // x.element_size(),
                                               slot_elems, eps, WORLD=data_ptrs.numel(), BLOCK=block,
                                               num_warps=norm_warps(block), **pdl(x))
    return y, residual
