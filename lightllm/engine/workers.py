"""Model workers: one process per tensor-parallel rank, each an rpyc service around its ModelRunner.

The engine core reaches each worker over a socketpair (no port to choose) and calls every rank
at once, then waits for all; rank 0's answer is used. One `step` call a step: it carries the
plan and brings back the previous step's tokens. rpyc would pass lists by reference, making
every element access a round trip, so plans and results cross as plain tuples (`plan.py`).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket

import rpyc
from rpyc.core.stream import SocketStream

from lightllm.engine.core import WorkerDied
from lightllm.engine.plan import StepPlan, StepResult, plan_from_wire, plan_to_wire, result_from_wire, result_to_wire
from lightllm.utils.process import init_child_process, stop_processes

logger = logging.getLogger(__name__)

RPYC_CONFIG = {"allow_pickle": False, "sync_request_timeout": None}


def to_wire(value):
    """Lists and dicts as (nested) tuples, which rpyc copies by value."""
    if isinstance(value, dict):
        return tuple((key, to_wire(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(to_wire(item) for item in value)
    return value


class ModelWorkerService(rpyc.Service):
    """Runs in the worker process; one instance per connection (there is one)."""

    runner = None

    def exposed_load(self, runner_kwargs: tuple) -> tuple:
        import torch

        from lightllm.engine.model_runner import ModelRunner  # torch: worker only

        kwargs = dict(runner_kwargs)
        if not torch.cuda.is_available():
            # Leave a core to the router, detokenizer and HTTP processes, which work on every step:
            # an OpenMP thread descheduled by them stalls the whole step (measured: 64 tokens of
            # the default model in 74 s with 2 threads on 2 cores, 3.9 s with 1).
            cores = max(1, (os.cpu_count() or 1) - 1)
            torch.set_num_threads(max(1, cores // kwargs.get("world_size", 1)))
        self.runner = ModelRunner(**kwargs)
        return self.runner.max_total_token_num, to_wire(self.runner.info)

    def exposed_step(self, plan: tuple) -> tuple:
        return tuple(result_to_wire(r) for r in self.runner.step(plan_from_wire(plan)))

    def exposed_stats(self) -> tuple:
        return to_wire(self.runner.stats())

    def exposed_ping(self) -> None:
        """A no-op: measures the router <-> worker round trip."""


def run_model_worker(sock: socket.socket, parent_pid: int, log_level: str) -> None:
    """Entry of a worker process: serve the router until it hangs up."""
    init_child_process(parent_pid, log_level)
    # Nothing to tidy up here, and SystemExit inside rpyc's serve loop ends in a noisy traceback.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logger.info("model worker started (pid %d)", os.getpid())
    conn = rpyc.connect_stream(SocketStream(sock), service=ModelWorkerService, config=RPYC_CONFIG)
    conn.serve_all()


class ModelWorkers:
    """The router's handle on every rank."""

    METHODS = ("load", "step", "stats", "ping")

    def __init__(self, tp: int, log_level: str):
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        self._conns: list[rpyc.Connection] = []
        for rank in range(tp):
            mine, theirs = socket.socketpair()
            process = context.Process(
                target=run_model_worker,
                args=(theirs, os.getpid(), log_level),
                name=f"model_worker_{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.processes.append(process)
            self._conns.append(rpyc.connect_stream(SocketStream(mine), config=RPYC_CONFIG))
        # Attribute look-ups on a remote object are round trips: do them once.
        self._methods = {
            name: [rpyc.async_(getattr(conn.root, name)) for conn in self._conns] for name in self.METHODS
        }

    def load(self, **runner_kwargs) -> tuple[int, dict]:
        calls = self._methods["load"]
        pending = [call(to_wire({**runner_kwargs, "tp_rank": rank})) for rank, call in enumerate(calls)]
        max_total_token_num, info = self._gather(pending)
        return max_total_token_num, {key: list(v) if isinstance(v, tuple) else v for key, v in info}

    def step(self, plan: StepPlan) -> list[StepResult]:
        return [result_from_wire(r) for r in self._call_all("step", plan_to_wire(plan))]

    def stats(self) -> dict:
        return dict(self._gather([self._methods["stats"][0]()]))  # read-only: rank 0 is enough

    def ping(self) -> None:
        self._call_all("ping")

    def _call_all(self, name: str, *args):
        return self._gather([call(*args) for call in self._methods[name]])

    def _gather(self, pending: list):
        """Wait for every rank (they run concurrently); raise the first error; return rank 0's value."""
        try:
            for result in pending:
                result.wait()
        except (EOFError, OSError) as exc:
            if any(conn.closed for conn in self._conns) or self.dead_worker_message():
                raise WorkerDied(self.dead_worker_message(timeout=2.0) or f"lost a model worker: {exc!r}") from exc
            raise
        values = [result.value for result in pending]
        return values[0]

    @property
    def sentinels(self) -> list[int]:
        return [process.sentinel for process in self.processes]

    def dead_worker_message(self, timeout: float = 0.0) -> str | None:
        """Describe the first worker that has exited (waiting up to `timeout` for one to)."""
        ended = multiprocessing.connection.wait(self.sentinels, timeout)
        for rank, process in enumerate(self.processes):
            if process.sentinel in ended:
                process.join(1.0)  # its sentinel closes a moment before it can be reaped
                return f"model worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def shutdown(self) -> None:
        for conn in self._conns:
            conn.close()  # a worker's serve_all ends when its connection closes
        stop_processes(self.processes)
