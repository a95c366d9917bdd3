"""The prefix cache's host tier: evicted nodes' KV in host memory, one runner's (one rank's shard).

The pool is allocated once, at start: `[capacity, record]`, token-major, a token's record the
concatenation of what its slot holds on the device: every KV buffer's K, then every V, each
flattened to its own heads x head size (Gemma 4's global layers have more than its sliding ones),
then any other buffer indexed by slot (an EAGLE-3 head's or an MTP layer's feature of the token,
which the target wrote when it computed the token and no later step recomputes). Records hold
the buffers' bytes as words of one integer type (`record_unit`: an fp8 KV beside a bf16 feature
is one record), so that a run of tokens is one contiguous block of every layer's K and V
(page-locked on CUDA, at its exact size: `pinned_empty`, so copies are DMA and leave the host
thread; the start logs how long that took). Its room is handed out in runs of tokens (first
fit, merged on free); a node holds a list of runs, so splitting a node splits its list and
copies nothing.

Offload gathers the token-granular slots of every layer of a batch of nodes (a step's evictions)
into a contiguous staging tensor on the device (STAGING_TOKENS at a time), then copies it to the
nodes' runs, adjacent runs merged: one large copy a run. Load copies a batch of nodes' runs to a
staging tensor and scatters it into fresh slots. A batch costs the same few launches a buffer as
one node (a step reloading a 12-turn chat's history moves about ten nodes; node by node, the 64
buffers of an 8B model cost about 1 ms of host time each, as long as the device's step). On CUDA
both copies run on a copy stream: an offload's copy waits for the gather (on the step's stream)
and overlaps what follows; a load's scatter, and so the next forward, waits for its copy. The host
side never touches the data, and both directions use the one copy stream, so a run freed by a load
and reused by an offload is read before it is overwritten.

CPU bookkeeping of the room lives in the radix tree (lightllm/common/radix_cache.py): every rank
applies the same ops in the same order, so every rank's runs are the same.
"""

from __future__ import annotations

import logging
import os
import time
import weakref

import torch

logger = logging.getLogger(__name__)

Runs = list[tuple[int, int]]  # (first token, tokens)

# Most tokens one staging tensor holds: 64 MiB for an 8B model in bf16 (128 KiB a token), so the
# transient device memory of a copy stays small beside the step's while each copy stays large.
STAGING_TOKENS = 512


def cut(runs: Runs, n: int) -> tuple[Runs, Runs]:
    """(the runs of the first n tokens, the runs of the rest)."""
    head, rest, done = [], list(runs), 0
    while done < n:
        start, length = rest.pop(0)
        take = min(length, n - done)
        head.append((start, take))
        if take < length:
            rest.insert(0, (start + take, length - take))
        done += take
    return head, rest


def merged(runs: Runs) -> Runs:
    """The same tokens in the same order, each run that starts where the one before ends joined to it."""
    out: Runs = []
    for start, length in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def pinned_empty(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly `shape`. torch's pinned allocator rounds a request up to
    a power of two (--host_kv_cache_gb 24 would lock 32 GiB) and its cudaHostAlloc faults the pages
    in on one thread; here torch's threads fault them in (zero_) and CUDA then locks them. Falls
    back to the pinned allocator where registering fails."""
    data = torch.zeros(shape, dtype=dtype)
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(data.data_ptr(), data.numel() * data.element_size(), 0)
    if int(error) != 0:  # cudaSuccess
        logger.warning("cudaHostRegister failed (%s): the host KV pool comes from torch's pinned allocator", error)
        del data
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    weakref.finalize(data, cudart.cudaHostUnregister, data.data_ptr())  # before its memory goes back
    return data


class HostPoolFullError(RuntimeError):
    """More host tokens were asked for than are free (the tree's bookkeeping is off)."""


def record_widths(buffers: list[torch.Tensor]) -> list[int]:
    """The bytes of one slot of each buffer, in a record's order."""
    return [t[0].numel() * t.element_size() for t in buffers]


def record_unit(buffers: list[torch.Tensor]) -> torch.dtype:
    """The widest integer type that every buffer's slot and start is a whole number of: the pool's
    records and copies are in it (8-byte words for a model's K and V, whatever their dtype; no
    dtype's own copy kernel is needed: the CPU has none for fp8)."""
    return next(unit for unit in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if all(width % unit.itemsize == 0 for width in record_widths(buffers))
                and all(t.storage_offset() * t.element_size() % unit.itemsize == 0 for t in buffers))


def _words(t: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """A buffer [slots, ...] as [slots, words of `unit`], a view (a load writes through it)."""
    return t.view(t.shape[0], -1).view(unit)


class HostKVPool:
    def __init__(self, capacity: int, buffers: list[torch.Tensor], device: torch.device, path: str | None = None):
        """`buffers`: the device buffers a slot's record is made of, each [slots, ...] (every layer's
        K, then every V, then any other per-slot buffer); the offloads and loads pass buffers of the
        same widths in the same order. `path`: the disk tier's pool, a file mapped there (removed at
        once: it lives as long as the process), whose copies run on the current stream."""
        self.capacity = capacity
        self.device = device
        self.widths = record_widths(buffers)  # bytes of each buffer in a record
        self.unit = record_unit(buffers)
        self.unit_widths = [width // self.unit.itemsize for width in self.widths]
        shape = (capacity, sum(self.unit_widths))
        cuda = device.type == "cuda" and path is None
        started = time.monotonic()
        if cuda:
            self.data = pinned_empty(shape, self.unit)
        elif path is None:
            self.data = torch.zeros(shape, dtype=self.unit)  # resident from the start, as a pinned pool is
        else:
            self.data = torch.from_file(path, shared=True, size=shape[0] * shape[1], dtype=self.unit).view(shape)
            os.unlink(path)
        self.free_runs: Runs = [(0, capacity)] if capacity else []  # sorted by start, never adjacent
        self.free_count = capacity
        self.nodes: dict[int, Runs] = {}  # prefix-cache node id -> its runs, in token order
        self.stream = torch.cuda.Stream(device) if cuda else None
        logger.info("%s KV pool: %d tokens, %.2f GiB%s in %.1f s", "host" if path is None else f"disk ({path})",
                    capacity, self.data.numel() * self.data.element_size() / 2**30, " (pinned)" if cuda else "",
                    time.monotonic() - started)

    # ---- room ----

    def alloc(self, n: int) -> Runs:
        """n tokens of room: one run when one is long enough (first fit), else the first runs."""
        if n > self.free_count:
            raise HostPoolFullError(f"host KV pool: {n} tokens asked, {self.free_count} free")
        for i, (start, length) in enumerate(self.free_runs):
            if length >= n:
                self.free_runs[i: i + 1] = [(start + n, length - n)] if length > n else []
                self.free_count -= n
                return [(start, n)]
        out, left = [], n
        while left:
            start, length = self.free_runs[0]
            take = min(length, left)
            out.append((start, take))
            self.free_runs[0:1] = [(start + take, length - take)] if length > take else []
            left -= take
        self.free_count -= n
        return out

    def free(self, runs: Runs) -> None:
        merged: Runs = []
        for start, length in sorted(self.free_runs + runs):
            if merged and merged[-1][0] + merged[-1][1] > start:
                raise HostPoolFullError(f"host KV pool: run ({start}, {length}) freed twice")
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.free_runs = merged
        self.free_count += sum(length for _, length in runs)

    # ---- nodes (the tree's ops) ----

    def offload(self, nodes: list[tuple[int, torch.Tensor]], buffers: list[torch.Tensor]) -> None:
        """Copy each (node id, slots)'s slots of every buffer (as at construction: every layer's K,
        then every V, then the rest) into fresh room for the node; the slots may be reused by
        anything launched after this call."""
        self._check(buffers)
        runs: Runs = []
        for node_id, slots in nodes:
            self.nodes[node_id] = self.alloc(len(slots))
            runs += self.nodes[node_id]
        index, rest = torch.cat([slots for _, slots in nodes]).to(torch.int64), runs
        for first in range(0, len(index), STAGING_TOKENS):
            part = index[first: first + STAGING_TOKENS]
            piece, rest = cut(rest, len(part))
            staging = torch.cat([_words(t, self.unit).index_select(0, part) for t in buffers], dim=1)  # [n, record]
            self._copy(merged(piece), staging, to_host=True)

    def load(self, nodes: list[tuple[int, torch.Tensor]], buffers: list[torch.Tensor]) -> None:
        """Copy each (node id, slots)'s records into those slots of every buffer and free the nodes'
        room; whatever is launched after this call on the current stream sees it."""
        self._check(buffers)
        runs = [run for node_id, _ in nodes for run in self.nodes.pop(node_id)]
        index, rest = torch.cat([slots for _, slots in nodes]).to(torch.int64), runs
        for first in range(0, len(index), STAGING_TOKENS):
            part = index[first: first + STAGING_TOKENS]
            piece, rest = cut(rest, len(part))
            staging = torch.empty((len(part), *self.data.shape[1:]), dtype=self.data.dtype, device=self.device)
            self._copy(merged(piece), staging, to_host=False)
            for t, piece in zip(buffers, staging.split(self.unit_widths, dim=1)):
                _words(t, self.unit).index_copy_(0, part, piece)
        self.free(runs)

    def take_from(self, node_id: int, other: HostKVPool) -> None:
        """Node `node_id` moves from `other`'s room to fresh room here (host pool to disk pool)."""
        if other.stream is not None:
            other.stream.synchronize()  # read on the host: its offloads in flight must have landed
        runs = other.nodes.pop(node_id)
        mine, rest = self.alloc(sum(n for _, n in runs)), runs
        for start, length in mine:
            piece, rest = cut(rest, length)
            for s, n in piece:  # run to run, no staging: both are host memory
                self.data[start: start + n] = other.data[s: s + n]
                start += n
        other.free(runs)
        self.nodes[node_id] = mine

    def split(self, node_id: int, at: int, upper_id: int) -> None:
        self.nodes[upper_id], self.nodes[node_id] = cut(self.nodes.pop(node_id), at)

    def drop(self, node_id: int) -> None:
        self.free(self.nodes.pop(node_id))

    def reset(self) -> None:
        self.nodes.clear()
        self.free_runs = [(0, self.capacity)] if self.capacity else []
        self.free_count = self.capacity

    def _check(self, buffers: list[torch.Tensor]) -> None:
        widths = record_widths(buffers)
        if widths != self.widths:  # (a buffer whose bytes are no whole words of the unit fails its view)
            raise ValueError(f"host KV pool: buffers of {widths} bytes a slot, its records of {self.widths}")

    def _copy(self, runs: Runs, staging: torch.Tensor, to_host: bool) -> None:
        """staging (device, contiguous) <-> the runs of the pool, one copy a run."""
        if self.stream is None:
            self._copy_runs(runs, staging, to_host)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # to host: the gather is done; to device: staging is allocated
        with torch.cuda.stream(self.stream):
            self._copy_runs(runs, staging, to_host)
        staging.record_stream(self.stream)
        if not to_host:
            compute.wait_stream(self.stream)

    def _copy_runs(self, runs: Runs, staging: torch.Tensor, to_host: bool) -> None:
        offset = 0
        for start, length in runs:
            host, dev = self.data[start: start + length], staging[offset: offset + length]
            (host if to_host else dev).copy_(dev if to_host else host, non_blocking=self.stream is not None)
            offset += length
