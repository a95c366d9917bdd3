"""The router's rpyc path to a model worker: same results as an in-process runner, and its cost."""

import logging
import statistics
import time

import pytest
import torch

from lightllm.server.io_struct import SamplingParams
from lightllm.server.router.model_infer.model_runner import ModelRunner
from lightllm.server.router.model_infer.worker import ModelWorkers
from lightllm.tools.bench_model import write_bench_model

logger = logging.getLogger(__name__)
RUNNER_ARGS = dict(max_total_token_num=2048, max_req_total_len=256, running_max_req_size=16)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny"))


@pytest.fixture(scope="module")
def workers(tiny_dir):
    workers = ModelWorkers(tp=1, log_level="info")
    workers.load(model_dir=tiny_dir, world_size=1, **RUNNER_ARGS)
    yield workers
    workers.shutdown()


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def test_worker_matches_in_process_runner_and_report_overhead(workers, tiny_dir):
    torch.set_num_threads(1)  # as the worker runs on a 2-core machine: compare like with like
    runner = ModelRunner(tiny_dir, world_size=1, **RUNNER_ARGS)
    batch = [(i, [10 + i, 20, 30 + 7 * i], SamplingParams(max_new_tokens=64, stop_sequences=["x"])) for i in range(8)]
    ids = [i for i, _, _ in batch]
    assert list(workers.prefill(batch)) == runner.prefill(batch)
    steps = [(list(workers.decode(ids)), runner.decode(ids)) for _ in range(10)]
    assert all(remote == local for remote, local in steps)

    ping = median_seconds(workers.ping, 300)
    remote, local = [], []
    for _ in range(40):  # interleaved, so that load from elsewhere hits both alike
        remote.append(median_seconds(lambda: workers.decode(ids), 1))
        local.append(median_seconds(lambda: runner.decode(ids), 1))
    remote, local = statistics.median(remote), statistics.median(local)
    logger.info(
        "router -> rpyc -> worker: no-op round trip %.0f us; decode of %d requests %.2f ms via the worker, "
        "%.2f ms in process (overhead %.0f us per step)",
        ping * 1e6, len(ids), remote * 1e3, local * 1e3, (remote - local) * 1e6,
    )
    assert ping < 0.01, "an rpyc round trip should take well under 10 ms on loopback"
    workers.free(ids)
    runner.free(ids)
    assert workers.stats()["tokens_used"] == 0


def test_runner_errors_come_back_as_exceptions(workers):
    with pytest.raises(Exception, match="unknown"):
        workers.decode([12345])
    workers.ping()  # the worker keeps serving
