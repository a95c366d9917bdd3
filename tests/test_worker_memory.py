"""A CPU model worker's memory comes back to one idle level, however many steps of whatever shapes ran.

Under steady load the worker's idle RSS wandered (CPU, 2026-11-25, efedf3f;
docs/benchmarks-history.md): its device thread allocated from a glibc arena of its own, whose free top malloc_trim never returns, so
the idle level depended on where that arena's top happened to be. Here a worker process runs busy
periods of random steps (prompts of 1-255 tokens, decodes, top and prompt logprobs, releases), each
followed by idle, and its RSS once idle must be the same after every period. With the device
thread's arena (before use_one_heap) the idle level wandered over 20-40 MiB across eight periods.

Set aside: MKL's own pool of GEMM buffers, which keeps what each new matrix size needed (bounded:
in one process it stopped at +33 MiB after about 130 random steps, a few MiB at a time); the worker
here runs with MKL_DISABLE_FAST_MM, so that what is measured is the C heap. A longer first period
is left out too: it pays once for what steps use first (code and caches that the profile step at
start did not reach)."""

import random

import psutil
import pytest

from lightllm.engine.config import EngineConfig
from lightllm.engine.plan import Chunk, Release, StepPlan
from lightllm.engine.workers import ModelWorkers
from lightllm.engine.request import SamplingParams
from lightllm.tools.bench_model import write_bench_model
from lightllm.tools.default_model import update_json

MAX_RUNNING = 16
CHUNK_BUDGET = 256
WARM_UP_STEPS = 40
PERIODS = 8
STEPS_PER_PERIOD = 15
IDLE_SPREAD_MIB = 4


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = write_bench_model(tmp_path_factory.mktemp("wide"), "tiny")
    update_json(path / "config.json", hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=8, head_dim=64)
    with pytest.MonkeyPatch.context() as env:  # the worker process inherits it
        env.setenv("MKL_DISABLE_FAST_MM", "1")
        workers = ModelWorkers(tp=1, log_level="info")
    workers.load(EngineConfig(model_dir=str(path), max_total_token_num=8192, max_req_total_len=512,
                              running_max_req_size=MAX_RUNNING, chunked_prefill_size=CHUNK_BUDGET, load_format="dummy"))
    yield workers
    workers.shutdown()


class RandomLoad:
    """Plans as a scheduler might send them: requests start with a prompt chunk, decode, end."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.running: dict[int, int] = {}  # req id -> tokens it holds
        self.req_ids, self.step_ids = iter(range(1 << 30)), iter(range(1 << 30))

    def step(self) -> StepPlan:
        rng = self.rng
        ended = [r for r in self.running if rng.random() < 0.25 or self.running[r] > 500]
        for r in ended:
            del self.running[r]
        decodes = list(self.running)
        chunks, budget = [], CHUNK_BUDGET
        while len(decodes) + len(chunks) < MAX_RUNNING and budget > 1 and rng.random() < 0.7:
            n = rng.randrange(1, budget)
            budget -= n
            params = SamplingParams(do_sample=rng.random() < 0.5, top_p=0.9, top_logprobs=rng.choice([0, 5]),
                                    prompt_logprobs=rng.choice([None, None, 3]))
            chunks.append(Chunk(next(self.req_ids), [rng.randrange(1000) for _ in range(n)], 0, True, params))
        for r in decodes:
            self.running[r] += 1
        self.running.update((c.req_id, len(c.token_ids) + 1) for c in chunks)
        return StepPlan(next(self.step_ids), decodes, chunks, [Release(r) for r in ended], sync=True)

    def end_all(self) -> StepPlan:
        """No step to run, only releases: an idle worker gives its free memory back."""
        plan = StepPlan(next(self.step_ids), ops=[Release(r) for r in self.running], sync=True)
        self.running.clear()
        return plan


def rss_mib(workers: ModelWorkers) -> float:
    return psutil.Process(workers.processes[0].pid).memory_info().rss / 2**20


def test_idle_worker_rss_is_the_same_after_every_busy_period(worker):
    load = RandomLoad(random.randrange(1 << 30))
    idle = []
    for steps in [WARM_UP_STEPS] + [STEPS_PER_PERIOD] * PERIODS:
        for _ in range(steps):
            worker.step(load.step())
        worker.step(load.end_all())  # idle: the worker gives its free memory back
        assert worker.stats()["tokens_used"] == 0
        idle.append(rss_mib(worker))
    idle = idle[1:]
    assert max(idle) - min(idle) <= IDLE_SPREAD_MIB, f"idle RSS after each busy period: {[round(m) for m in idle]} MiB"
