"""How many KV tokens fit: measured at start-up by running the largest step once.

After the weights load, every rank runs the largest step the scheduler can plan (`largest_step`:
the full running batch decoding beside a whole chunk budget of prompt tokens, every row sampled
with top-k/top-p/penalties and logprobs, every prompt token with prompt logprobs) on a token
table just large enough for it, and measures the memory in use at its peak (`PeakMemory`). The
KV budget is what is left of `mem_fraction` of the memory (`memory_limit`) beside that peak:

    budget_bytes = total * mem_fraction - (in use before the step + the step's peak growth [+ graphs])

GPU: total and free from `torch.cuda.mem_get_info`, the peak from the caching allocator's
`max_memory_allocated`. CPU: the host's RAM (psutil: total and available, so other processes
count as in use and the cache never makes the host swap), the peak as the growth of the
process's resident set (its high-water mark, reset before the step).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import psutil
import torch

from lightllm.engine.plan import Chunk, StepPlan
from lightllm.engine.request import SamplingParams
from lightllm.utils.process import return_free_heap

logger = logging.getLogger(__name__)

PROFILE_LOGPROBS = 20  # the most top logprobs the API lets a request ask for (MAX_LOGPROBS)
# Every sampling path at once: penalties, logprobs, prompt logprobs (scored a slice at a time,
# sampling.PROMPT_LOGITS_BYTES), the watermark's green lists and the filtered draw (sorts,
# softmax, cumsums, the counter-hash uniforms: many copies of a block of rows' logits,
# sampling.DRAW_LOGITS_BYTES), except on the CPU, where that draw and the green lists over a full
# batch of 1,024 rows take a minute (the random_uniform reference and the sort) and would hold up
# every start; a CPU serves a few tokens a second, so batches of that size with sampling on are
# not what it runs.
PROFILE_SAMPLING = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, typical_p=0.95,
                                  repetition_penalty=1.1, presence_penalty=0.1, max_new_tokens=2,
                                  top_logprobs=PROFILE_LOGPROBS, prompt_logprobs=PROFILE_LOGPROBS, watermark=True)
PROFILE_SAMPLING_CPU = dataclasses.replace(PROFILE_SAMPLING, do_sample=False, watermark=False)

def memory_info(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes the device has: the GPU's memory, or the host's RAM for the CPU.
    Tests patch this to set a memory limit."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    ram = psutil.virtual_memory()
    return ram.total, ram.available


class PeakMemory:
    """`with PeakMemory(device) as peak:` ...; then `peak.bytes` is the most memory in use during
    the block beyond what was in use at its start."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            _reset_peak_rss()
            self._start = psutil.Process().memory_info().rss
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = max(_peak_rss(), psutil.Process().memory_info().rss)
        self.bytes = max(0, peak - self._start)


def _reset_peak_rss() -> None:
    """Linux: set the high-water mark of the resident set (VmHWM) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        logger.warning("cannot reset the peak RSS: the profile step's peak is read after it, a lower bound")


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def largest_step(max_running: int, chunk_budget: int, max_prompt_len: int, vocab_size: int,
                 sampling: SamplingParams = PROFILE_SAMPLING) -> list[StepPlan]:
    """Two plans: the first starts the requests that decode in the second, the largest step the
    scheduler can plan: every request row busy, as many of them decoding as leave rows for the
    prompt chunks that fill the chunk budget (each chunk at most `max_prompt_len` tokens)."""
    chunks = min(max_running, math.ceil(chunk_budget / max_prompt_len))
    decodes = max_running - chunks
    prompt_tokens = min(chunk_budget, chunks * max_prompt_len)
    token = iter(range(1 << 62))
    setup = [Chunk(i, [next(token) % vocab_size], 0, True, sampling) for i in range(decodes)]
    sizes = [prompt_tokens // chunks + (i < prompt_tokens % chunks) for i in range(chunks)]
    prompts = [Chunk(decodes + i, [next(token) % vocab_size for _ in range(n)], 0, True, sampling)
               for i, n in enumerate(sizes)]
    first = [StepPlan(-1, [], setup, sync=True)] if setup else []
    return first + [StepPlan(-2, list(range(decodes)), prompts, sync=True)]


@dataclass
class MemoryBudget:
    """What the profile found on one rank, in bytes."""

    total: int  # the device's memory (GPU) or the host's RAM (CPU)
    in_use: int  # before the profile step (weights, the runtime, other processes), and
    peak: int  # the profile step's growth beyond it at its peak
    graphs: int  # kept for CUDA graphs (estimated before they are captured)
    mem_fraction: float

    @property
    def limit(self) -> int:
        return int(self.total * self.mem_fraction)

    def tokens(self, token_bytes: int, fixed_bytes: int = 0) -> int:
        """KV tokens that fit beside the peak (and `fixed_bytes` the KV takes whatever its tokens)."""
        return max(0, (self.limit - self.in_use - self.peak - self.graphs - fixed_bytes) // token_bytes)

    def describe(self, device: torch.device) -> str:
        what = "GPU memory" if device.type == "cuda" else "host RAM"
        graphs = f" + {_gib(self.graphs)} for CUDA graphs" if self.graphs else ""
        return (f"{_gib(self.limit)} (--mem_fraction {self.mem_fraction:g} of {_gib(self.total)} {what}) less "
                f"{_gib(self.in_use)} in use before the profile step + {_gib(self.peak)} at its peak{graphs}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


# The prefix cache's state snapshots take at most this share of the memory left beside the states
# of the running requests; the KV budget is measured after both are allocated.
STATE_MEMORY_SHARE = 0.5


def state_slots(slot_bytes: int, wanted: int, device: torch.device, mem_fraction: float, ratio: float = 1.0) -> int:
    """Request rows (each with its recurrent state, `slot_bytes`) to allocate: `wanted`, or fewer
    where their states would take more than ratio / (1 + ratio) of the memory left
    (--mamba_full_memory_ratio: the states' share against the rest's)."""
    total, free = memory_info(device)
    share = ratio / (1 + ratio)
    room = (total * mem_fraction - (total - free)) * share
    fits = int(room // slot_bytes) - 1  # one slot more serves the padding row
    if fits < 1:
        raise ValueError(f"no memory left for the recurrent state of one request ({slot_bytes / 2**20:.1f} MiB)")
    if fits < wanted:
        logger.warning("running requests capped at %d (of --running_max_req_size %d): their recurrent states, "
                       "%.1f MiB each, take %.3g of the memory left (--mamba_full_memory_ratio %g)", fits, wanted,
                       slot_bytes / 2**20, share, ratio)
    return min(wanted, fits)


def snapshot_slots(slot_bytes: int, wanted: int, device: torch.device, mem_fraction: float) -> int:
    """Slots of the prefix cache's state snapshots to allocate (after the state pool): `wanted`, or
    as many as fit in STATE_MEMORY_SHARE of the memory then left (0: none, the cache is off)."""
    total, free = memory_info(device)
    fits = max(0, int((total * mem_fraction - (total - free)) * STATE_MEMORY_SHARE // slot_bytes))
    if fits < wanted:
        logger.warning("state snapshots capped at %d (of --state_snapshot_slots %d), %.1f MiB each",
                       fits, wanted, slot_bytes / 2**20)
    return min(wanted, fits)


CPU_DEFAULT_TOKENS = 16384  # the most a CPU runner takes unless given more


def token_budget(runner, requested: int | None, chunk_budget: int, mem_fraction: float, graph_bytes: int) -> int:
    """The runner's KV budget: what fits beside the largest step's peak, the same on every rank
    (the smallest); one given by hand must fit. On the CPU at most CPU_DEFAULT_TOKENS unless
    given: the host is shared, and a larger cache buys a CPU server nothing."""
    found = profile(runner, chunk_budget, mem_fraction, graph_bytes)
    device = runner.device
    per_token, fixed = runner.kv_bytes()
    fits = runner.tp.min_int(found.tokens(per_token, fixed), device)
    where = f"{found.describe(device)}, {per_token} B a token" + (f" and {_gib(fixed)} besides" if fixed else "")
    if requested is not None:
        if requested > fits:
            raise ValueError(f"--max_total_token_num {requested} does not fit: at most {fits} tokens fit in {where}; "
                             "give at most that, or a larger --mem_fraction")
        logger.info("max_total_token_num: %d as given (at most %d fit in %s)", requested, fits, where)
        return requested
    tokens = min(fits, CPU_DEFAULT_TOKENS) if device.type == "cpu" else fits
    if tokens < 2:
        raise ValueError(f"no memory left for the KV cache: {where}")
    logger.info("max_total_token_num: %d (%d fit in %s)", tokens, fits, where)
    return tokens


def profile(runner, chunk_budget: int, mem_fraction: float, graph_bytes: int) -> MemoryBudget:
    """Run the largest step on a token table just large enough for it; measure its peak."""
    device = runner.device
    sampling = PROFILE_SAMPLING_CPU if device.type == "cpu" else PROFILE_SAMPLING
    plans = largest_step(runner.req_table.max_reqs, chunk_budget, runner.max_req_total_len,
                         runner.config.vocab_size, sampling)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks cached while loading would read as used
    total, free = memory_info(device)
    runner.token_table = runner.new_token_table(sum(p.num_tokens for p in plans))
    start = time.perf_counter()
    with PeakMemory(device) as peak:
        # Where serving runs them: on the CPU the device thread, which in an in-process runner
        # allocates from a heap of its own (a model worker has one heap: use_one_heap).
        for plan in plans:
            runner.step(plan)
    runner.reset()
    runner.token_table = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        return_free_heap()
    # What the step left in use outside its buffers counts too: kernels loaded on first use,
    # communicators, heap pages not given back.
    free = min(free, memory_info(device)[1])
    logger.info("profile step (%d decodes, %d prompt tokens) in %.1f s: %.2f GiB at its peak",
                len(plans[-1].decodes), plans[-1].num_tokens - len(plans[-1].decodes),
                time.perf_counter() - start, peak.bytes / 2**30)
    return MemoryBudget(total, total - free, peak.bytes, graph_bytes, mem_fraction)
