"""A per-step timeline of the device, for finding where it idles (`--step_trace PATH`).

Each launched step records when the device began and finished it (CUDA events on the GPU; on
the CPU the device thread's clock around the step), how long the host took to launch it, and
its shape. Lines go to a JSON-lines file in batches, once the device has passed them:

    {"step": 12, "decodes": 250, "chunk_tokens": 3846, "chunks": 9, "graph": false,
     "decode_context": 98310, "chunk_context": 4410, "launch_ms": 24.1, "launch_cpu_ms": 23.8,
     "gc_ms": 0.0, "launched_ms": 5020.7, "start_ms": 5021.3, "end_ms": 5130.8}

`decode_context` and `chunk_context` are the KV tokens the step's attention reads: the decodes'
lengths and the chunked requests' lengths after the step (its prefix and chunk), summed.
`launch_cpu_ms` is the launching thread's CPU time over the launch (`time.thread_time`): far
below `launch_ms`, the thread was held up without running (a lock, the GIL, a blocking driver
call, the scheduler); `gc_ms` is the time Python's garbage collector ran during the launch.
`new_kernels` and `new_kernel_ms` are the launches in it whose Triton specialisation was new to
the process and their host time (Triton compiling, or loading from its cache; kernels/_triton.py,
CUDA only), and where there are any, `new_kernel_names`, their kernels. `compiles` counts every
kernel Triton compiled during the launch, ours and other libraries' (flash-linear-attention's and
their autotuners' candidates: Triton's post-compile hook, where Triton has one), with `compiled`,
their distinct names; absent where there were none. Eager steps on CUDA also
carry the caching allocator's counts so far: `device_allocs`, the blocks it had to take from the
driver (cudaMalloc), and `alloc_retries`, the allocations it could only serve after freeing its
cached blocks (cudaFree, which waits for the device). On CUDA a launch that took page-locked host
memory from the driver (torch's pinned allocator grows its pool: cudaHostAlloc, which may wait for
the device) has `pinned_allocs`, the blocks, and `pinned_alloc_ms`, the time in those calls. A
step whose plan carried ops (releases, the prefix cache's inserts, evictions, and its tiers'
offloads and loads) has `ops` and `ops_ms`, the host time they took before its launch began.
A launch in which its thread gave up the CPU has `blocked`, the times it did (voluntary context
switches: it waited on a lock, the GIL, a driver call or a page), and one from which the kernel's
scheduler took the CPU has `preempted` (involuntary switches: other threads or processes wanted its
core), with `major_faults` where it read pages from disk (Linux: getrusage of the thread); which of
them a launch far longer than its `launch_cpu_ms` has says what held it.
`syncs` names the lines (`folder/file.py:line`, once each time) at which the launch waited for
the device (a blocking copy, a read of a device value), as torch's sync debug mode reports them
on CUDA during the launch; absent where there were none. `sync` marks a step whose result the
engine waited for before planning the next (a step with drafts, or run without overlap);
`collected` counts the times the engine collected the step in flight just before this one
(speculative decoding does before a step it expects to have drafts).

`start_ms` and `end_ms` (the device's) and `launched_ms` (the host's clock when it had launched
the step) are on one clock per process, ms since the trace began: the device's marks count from
an event recorded on an idle device at that moment. The first line also carries `origin_unix_s`,
that moment on the wall clock (time.time()), so that a client's send times can be placed on the
trace's clock, and `origin_perf_s`, on `time.perf_counter()`'s, which the engine's own lines
(PATH.host, `core.HostTrace`) are on. `received_ms` is when the runner was handed the step's plan,
`returned_ms` when it handed the step's result back (a sync step's in the same call): with the
next step's `received_ms`, they split the host's turnaround after a sync step. `forwarded_ms` is
when the launch had the forward launched (a graph replayed), before sampling's kernels.

The device idled before a step by `start_ms - previous end_ms`: the time between the previous
step's end and the moment the host had this one launched. A step whose `launched_ms` is past its
`start_ms` reached the device before its launch was done, so its `end_ms - start_ms` holds up to
that much waiting for the host. `test/benchmark/engine/step_trace.py` summarises a file.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import time
import warnings

import torch

from lightllm.kernels._triton import COMPILES, NEW_SPECIALISATIONS, count_compiles

FLUSH_EVERY = 64  # steps between writes: the events of a step in flight are not ready yet
# torch's warning for each host wait on the device while torch.cuda.set_sync_debug_mode("warn") is on
SYNC_MESSAGE = "called a synchronizing CUDA operation"


# the calling thread's own counts where Linux gives them, else the process's
_RUSAGE_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def _switches() -> tuple[int, int, int]:
    """(voluntary context switches, involuntary ones, major page faults) of the calling thread so far."""
    usage = resource.getrusage(_RUSAGE_WHO)
    return usage.ru_nvcsw, usage.ru_nivcsw, usage.ru_majflt


class StepTrace:
    def __init__(self, path: str, device: torch.device):
        self.file = open(path, "a", buffering=1 << 16)
        self.cuda = device.type == "cuda"
        self.device = device
        self._ref = None
        if self.cuda:
            torch.cuda.synchronize(device)  # the reference event then fires at once: one origin for both clocks
        self._t0, self._origin_unix = time.perf_counter(), time.time()
        if self.cuda:
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
        self._pending: list[dict] = []
        self._gc_ms, self._gc_start = 0.0, None
        self.collections = 0  # steps in flight the engine collected (an empty sync plan) since the last launch
        gc.callbacks.append(self._on_gc)
        count_compiles()
        self._pinned = self.cuda and hasattr(torch.cuda, "host_memory_stats")  # torch's pinned allocator's counts
        # the lines at which a launch waited for the device (None: no launch under way)
        self._syncs: list[str] | None = None
        warnings.filterwarnings("always", message=SYNC_MESSAGE)  # each time, not once a line
        self._showwarning, warnings.showwarning = warnings.showwarning, self._on_warning

    def _on_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if self._syncs is not None and SYNC_MESSAGE in str(message):
            self._syncs.append(f"{os.path.basename(os.path.dirname(filename))}/{os.path.basename(filename)}:{lineno}")
            return
        self._showwarning(message, category, filename, lineno, file, line)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self._gc_ms += (time.perf_counter() - self._gc_start) * 1000
            self._gc_start = None

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return (time.perf_counter() - self._t0) * 1000

    def begin(self, received: float | None = None) -> dict:
        """Call before the step's first device work, with when the runner was handed the step's plan
        (perf_counter); returns the record `end` completes."""
        self._syncs = []
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        record = {} if received is None else {"received_ms": round((received - self._t0) * 1000, 3)}
        return record | {"host_start": time.perf_counter(), "cpu_start": time.thread_time(), "gc_start": self._gc_ms,
                         "new_start": {"launches": NEW_SPECIALISATIONS["launches"], "ms": NEW_SPECIALISATIONS["ms"]},
                         "compiles_start": COMPILES["count"], "pinned_start": self._pinned_counts(),
                         "switches_start": _switches(), "start": self._mark()}

    def forwarded(self, record: dict) -> None:
        """The step's forward is launched (its graph replayed): what is left of the launch is sampling's."""
        record["forwarded_ms"] = round((time.perf_counter() - self._t0) * 1000, 3)

    def _pinned_counts(self) -> tuple[int, float]:
        """(blocks torch's pinned allocator has taken from the driver, ms in those calls) so far."""
        if not self._pinned:
            return 0, 0.0
        stats = torch.cuda.host_memory_stats()
        return stats.get("num_host_alloc", 0), stats.get("host_alloc_time.total", 0) / 1000.0

    def end(self, record: dict, step_id: int, decodes: int, chunk_tokens: int, chunks: int, graph: bool,
            decode_context: int, chunk_context: int, drafts: int = 0, sync: bool = False, ops: int = 0,
            ops_ms: float = 0.0) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        if self._syncs:
            record["syncs"] = self._syncs
        self._syncs = None
        if drafts:
            record["drafts"] = drafts
        if sync:
            record["sync"] = True
        if self.collections:
            record["collected"], self.collections = self.collections, 0
        if ops:  # the plan's ops, applied before `begin`: their host time is not in launch_ms
            record.update(ops=ops, ops_ms=round(ops_ms, 3))
        record.update(step=step_id, decodes=decodes, chunk_tokens=chunk_tokens, chunks=chunks, graph=graph,
                      decode_context=decode_context, chunk_context=chunk_context,
                      launch_ms=(now - record.pop("host_start")) * 1000,
                      launch_cpu_ms=round((cpu - record.pop("cpu_start")) * 1000, 3),
                      gc_ms=round(self._gc_ms - record.pop("gc_start"), 3),
                      new_kernels=NEW_SPECIALISATIONS["launches"] - record["new_start"]["launches"],
                      new_kernel_ms=round(NEW_SPECIALISATIONS["ms"] - record.pop("new_start")["ms"], 3),
                      launched_ms=round((now - self._t0) * 1000, 3), end=self._mark())
        if record["new_kernels"]:
            record["new_kernel_names"] = NEW_SPECIALISATIONS["kernels"][-record["new_kernels"]:]
        (allocs, alloc_ms), (allocs_before, alloc_ms_before) = self._pinned_counts(), record.pop("pinned_start")
        if allocs > allocs_before:
            record.update(pinned_allocs=allocs - allocs_before, pinned_alloc_ms=round(alloc_ms - alloc_ms_before, 3))
        for name, now_count, before in zip(("blocked", "preempted", "major_faults"), _switches(),
                                           record.pop("switches_start")):
            if now_count > before:
                record[name] = now_count - before
        compiled = COMPILES["count"] - record.pop("compiles_start")
        if compiled:  # every library's kernels, autotuning's candidates included
            record.update(compiles=compiled, compiled=sorted(set(list(COMPILES["kernels"])[-compiled:])))
        if self.cuda and not graph:  # a dict of every allocator statistic: eager steps only, a few of them
            stats = torch.cuda.memory_stats(self.device)
            record.update(device_allocs=stats.get("num_device_alloc", 0),
                          alloc_retries=stats.get("num_alloc_retries", 0))
        self._pending.append(record)
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def accepted(self, step_id: int, tokens: int) -> None:
        """The drafts of step `step_id` that verification accepted (known once its tokens are back)."""
        for record in reversed(self._pending):
            if record.get("step") == step_id:
                record["accepted"] = tokens
                return

    def returned(self, step_ids: list[int]) -> None:
        """The results of steps `step_ids` go back to the engine now."""
        now, ids = round((time.perf_counter() - self._t0) * 1000, 3), set(step_ids)
        for record in self._pending:
            if record.get("step") in ids:
                record["returned_ms"] = now

    def flush(self, wait: bool = False) -> None:
        """Write the steps the device has finished (all of them with `wait`)."""
        done = 0
        for record in self._pending:
            if self.cuda:
                if wait:
                    record["end"].synchronize()
                elif not record["end"].query():
                    break
                start, end = (self._ref.elapsed_time(record["start"]), self._ref.elapsed_time(record["end"]))
            else:
                start, end = record["start"], record["end"]
            line = {k: v for k, v in record.items() if k not in ("start", "end")}
            line.update(start_ms=round(start, 3), end_ms=round(end, 3), launch_ms=round(line["launch_ms"], 3))
            if self._origin_unix is not None:  # the first line written
                line["origin_unix_s"], self._origin_unix = self._origin_unix, None
                line["origin_perf_s"] = round(self._t0, 6)
            self.file.write(json.dumps(line) + "\n")
            done += 1
        del self._pending[:done]
        self.file.flush()

    def close(self) -> None:
        if self.file.closed:
            return
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if warnings.showwarning == self._on_warning:
            warnings.showwarning = self._showwarning
        self.flush(wait=True)
        self.file.close()
