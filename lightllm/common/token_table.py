"""The KV cache as a table of token slots.

Every layer owns one K and one V buffer of shape [size, kv_heads, head_dim] (a layer that shares
an earlier layer's K/V, as Gemma 4's last ones, owns none; the head shape may differ by layer);
a slot index names the same position in all of them. `mem_state[i]` is 1 when slot i is free.

Allocation never waits on the device: the free count is kept exactly on the host (we know
what we hand out and take back), and the slots themselves are picked on the device from the
cumulative sum of `mem_state`.

One more K/V row, `scratch_slot` (= size), lies outside the budget: it is never handed out,
and padding rows of a bucketed decode batch write their K/V there (see
`lightllm/engine/cuda_graph.py`).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class OutOfTokensError(RuntimeError):
    """Raised when more slots are requested than are free."""


class DoubleFreeError(RuntimeError):
    """Raised when a slot that is already free (or listed twice) is freed."""


class TokenTable:
    def __init__(self, size: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, shapes: list[tuple[int, int]] | None = None):
        """`shapes`: each buffer's (kv_heads, head_dim) where they differ (Gemma 4's global layers have
        heads of their own; its KV-sharing layers own no buffer); else num_layers of one shape."""
        if size <= 0:
            raise ValueError(f"token table size must be positive, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.scratch_slot = size
        shapes = shapes or [(kv_heads, head_dim)] * num_layers
        # Zeroed, not just allocated: the pages are taken now, so the process's memory is its
        # working size from the start and does not creep up as slots are first written.
        self.k = [torch.zeros((size + 1, *shape), dtype=dtype, device=self.device) for shape in shapes]
        self.v = [torch.zeros((size + 1, *shape), dtype=dtype, device=self.device) for shape in shapes]
        self.mem_state = torch.ones(size, dtype=torch.int32, device=self.device)
        self.free_count = size
        logger.info("token table: %d slots x %d buffers of (kv heads, dims) %s (%s), %.2f GiB",
                    size, len(shapes), sorted(set(shapes)), dtype, self.nbytes() / 2**30)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def used_count(self) -> int:
        return self.size - self.free_count

    def alloc(self, n: int, contiguous: bool = True) -> torch.Tensor:
        """n free slots (int64, on the device): with `contiguous`, a contiguous run when one
        exists, else the first n free; without, the first n free (one request's decode token
        each: a run buys nothing, and finding one costs a step ten kernels over the whole table)."""
        if n > self.free_count:
            raise OutOfTokensError(f"cannot allocate {n} KV cache tokens: only {self.free_count} "
                                   f"of {self.size} are free")
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        slots = self._pick_slots(n, contiguous)
        # index_fill_ takes the value as a kernel argument; `mem_state[slots] = 0` would copy a
        # CPU scalar to the device, which waits for the step in flight (0.5 ms a decode step, H100)
        self.mem_state.index_fill_(0, slots, 0)
        self.free_count -= n
        return slots

    def _pick_slots(self, n: int, contiguous: bool) -> torch.Tensor:
        cum = torch.cumsum(self.mem_state, 0)
        first_free = torch.searchsorted(cum, torch.arange(1, n + 1, device=self.device, dtype=cum.dtype))
        if not contiguous:
            return first_free
        # free slots in the window [i, i + n) = cum[i + n - 1] - cum[i - 1]
        window = cum[n - 1:] - torch.cat([cum.new_zeros(1), cum[:-n]])
        run = window == n
        start = torch.argmax(run.to(torch.int32))  # first run; 0 when there is none
        run_slots = start + torch.arange(n, device=self.device)
        return torch.where(run.any(), run_slots, first_free)

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the table. Off CUDA, checks that each was in use, once; on CUDA that
        check would wait for the step in flight, so it is left to the CPU tests."""
        if slots.numel() == 0:
            return
        slots = slots.to(device=self.device, dtype=torch.int64)
        if self.device.type != "cuda":
            self._check_in_use(slots)
        self.mem_state.index_fill_(0, slots, 1)
        self.free_count += slots.numel()

    def free_all(self) -> None:
        self.mem_state.fill_(1)
        self.free_count = self.size

    def _check_in_use(self, slots: torch.Tensor) -> None:
        # O(slots), not O(table): a step frees a handful of rejected drafts' slots
        if bool(self.mem_state[slots].any()) or slots.unique().numel() != slots.numel():
            raise DoubleFreeError(f"freeing {slots.numel()} slots of which some are already free "
                                  "or listed twice")
