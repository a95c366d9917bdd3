"""The router process: receive requests, admit them, run prefill or decode, emit tokens.

It sleeps on its socket (and on the workers' exit) whenever nothing waits or runs.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import zmq

from lightllm.server.config import ServerConfig
from lightllm.server.io_struct import (
    AbortReq,
    BatchTokenOut,
    FinishReason,
    GenerateReq,
    RouterReady,
    RouterStats,
    TokenOut,
)
from lightllm.server.router.model_infer.worker import ModelWorkers, WorkerDied, describe_error
from lightllm.server.router.req import Req, ReqStatus
from lightllm.server.router.req_queue import ReqQueue
from lightllm.server.router.stats import ThroughputLog
from lightllm.utils.process import init_child_process

logger = logging.getLogger(__name__)

STATS_PUBLISH_INTERVAL = 0.05  # seconds between RouterStats messages while busy


class RouterManager:
    def __init__(self, config: ServerConfig, workers: ModelWorkers, max_total_token_num: int, eos_token_ids):
        self._workers = workers
        self._eos_token_ids = frozenset(eos_token_ids)
        self._max_total_token_num = max_total_token_num
        self._max_wait_steps = config.router_max_wait_tokens
        self._queue = ReqQueue(max_total_token_num, config.prefill_token_budget, config.running_max_req_size)
        self._running: list[Req] = []
        self._steps_since_admit = 0
        self._throughput = None if config.disable_log_stats else ThroughputLog(config.log_stats_interval)
        self._stats_dirty = False  # something changed since the last RouterStats
        self._last_publish = 0.0
        self._tokens_used = 0
        self._open_sockets(config)

    def _open_sockets(self, config: ServerConfig) -> None:
        context = zmq.Context.instance()
        self._inbox = context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(config.router_address)
        self._to_detokenizer = context.socket(zmq.PUSH)
        self._to_detokenizer.setsockopt(zmq.SNDHWM, 0)
        self._to_detokenizer.connect(config.detokenization_address)
        self._to_http = context.socket(zmq.PUSH)
        self._to_http.setsockopt(zmq.SNDHWM, 0)
        self._to_http.connect(config.http_address)
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        for sentinel in self._workers.sentinels:
            self._poller.register(sentinel, zmq.POLLIN)  # readable once the worker has exited

    def serve_forever(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        """One turn of the loop: wait (only when idle), receive, one model step, report."""
        self._wait_for_work()
        self._receive()
        self._step()
        self._publish_stats()
        if self._throughput is not None:
            self._throughput.maybe_log(len(self._running), len(self._queue), self._tokens_used, self._max_total_token_num)

    @property
    def idle(self) -> bool:
        return not self._busy

    @property
    def _busy(self) -> bool:
        return bool(self._running) or len(self._queue) > 0

    def _wait_for_work(self) -> None:
        """Block until a message arrives (or, when busy, just check); fail if a worker died."""
        timeout_ms = 0 if self._busy else self._idle_timeout_ms()
        events = dict(self._poller.poll(timeout_ms))
        if any(sentinel in events for sentinel in self._workers.sentinels):
            raise WorkerDied(self._workers.dead_worker_message() or "a model worker exited")

    def _idle_timeout_ms(self) -> int | None:
        """None (sleep until a message) unless a throughput log is still due."""
        due = self._throughput.seconds_until_due() if self._throughput is not None else None
        return None if due is None else max(0, int(due * 1000) + 1)

    def _receive(self) -> None:
        while True:
            try:
                msg = self._inbox.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            if isinstance(msg, GenerateReq):
                self._queue.append(Req(msg, self._eos_token_ids))
            elif isinstance(msg, AbortReq):
                self._abort(msg.req_id)
            else:
                logger.error("unexpected message %r", type(msg).__name__)
            self._stats_dirty = True

    def _abort(self, req_id: int) -> None:
        """The client went away, or the detokenizer ended the request on a stop sequence."""
        if self._queue.remove(req_id) is not None:
            return
        req = next((r for r in self._running if r.req_id == req_id), None)
        if req is None:
            return  # already finished
        self._running.remove(req)
        self._to_detokenizer.send_pyobj(AbortReq(req_id))
        self._free([req])

    def _step(self) -> None:
        new = self._admit()
        if new:
            self._prefill(new)
        elif self._running:
            self._decode()

    def _admit(self) -> list[Req]:
        if not len(self._queue) or (self._running and self._steps_since_admit < self._max_wait_steps):
            return []
        self._steps_since_admit = 0
        return self._queue.admit(self._running)

    def _prefill(self, new: list[Req]) -> None:
        for req in new:
            req.status = ReqStatus.RUNNING
            self._to_detokenizer.send_pyobj(GenerateReq(req.req_id, [], req.sampling, req.arrival_time))
        self._running += new
        batch = [(req.req_id, req.prompt_ids, req.sampling) for req in new]
        self._run_batch(new, lambda: self._workers.prefill(batch))
        if self._throughput is not None:
            self._throughput.count(prompt_tokens=sum(req.prompt_len for req in new), generated_tokens=len(new))
        for req in new:
            req.prompt_ids = []  # the runner has them now

    def _decode(self) -> None:
        self._steps_since_admit += 1
        batch = list(self._running)
        self._run_batch(batch, lambda: self._workers.decode([req.req_id for req in batch]))
        if self._throughput is not None:
            self._throughput.count(prompt_tokens=0, generated_tokens=len(batch))

    def _run_batch(self, batch: list[Req], step) -> None:
        """Run one step; emit a token per request; free those that finished."""
        try:
            results = step()
        except WorkerDied:
            raise
        except Exception as exc:  # the runner refused or failed this batch: fail it, keep serving
            self._fail(batch, exc)
            return
        outs, finished = [], []
        for req, (token_id, logprob) in zip(batch, results):
            reason = req.append(token_id)
            outs.append(TokenOut(req.req_id, token_id, logprob, reason))
            if reason is not None:
                finished.append(req)
        self._to_detokenizer.send_pyobj(BatchTokenOut(outs))
        self._stats_dirty = True  # every step changes the tokens in use
        self._finish(finished)

    def _fail(self, batch: list[Req], exc: Exception) -> None:
        logger.exception("model step failed for requests %s", [req.req_id for req in batch])
        outs = [TokenOut(req.req_id, -1, 0.0, FinishReason.ERROR, error=describe_error(exc)) for req in batch]
        self._to_detokenizer.send_pyobj(BatchTokenOut(outs))
        for req in batch:  # one at a time: a failed prefill may have registered only some of them
            self._finish([req], log_errors=False)

    def _finish(self, reqs: list[Req], log_errors: bool = True) -> None:
        if not reqs:
            return
        finished = set(id(req) for req in reqs)
        self._running = [req for req in self._running if id(req) not in finished]
        self._free(reqs, log_errors)

    def _free(self, reqs: list[Req], log_errors: bool = True) -> None:
        for req in reqs:
            req.status = ReqStatus.FINISHED
        self._stats_dirty = True
        try:
            self._workers.free([req.req_id for req in reqs])
        except WorkerDied:
            raise
        except Exception:
            if log_errors:
                logger.exception("freeing requests %s failed", [req.req_id for req in reqs])

    def _publish_stats(self) -> None:
        """Tell the HTTP process (for /metrics) after a change: at most every 50 ms while busy,
        and at once when the router becomes idle, so that an idle server reports 0 tokens."""
        now = time.monotonic()
        if not self._stats_dirty or (self._busy and now - self._last_publish < STATS_PUBLISH_INTERVAL):
            return
        tokens_used = self._workers.stats()["tokens_used"]
        stats = RouterStats(len(self._queue), len(self._running), tokens_used, self._max_total_token_num)
        self._to_http.send_pyobj(stats)
        self._stats_dirty, self._last_publish = False, now
        self._tokens_used = tokens_used


def start_router_process(config: ServerConfig, ready_pipe, parent_pid: int) -> None:
    """Entry of the router process: start the model workers, report RouterReady, serve."""
    init_child_process(parent_pid, config.log_level)
    workers = ModelWorkers(config.tp, config.log_level)
    try:
        max_total_token_num, info = load_model(workers, config)
        manager = RouterManager(config, workers, max_total_token_num, info["eos_token_ids"])
        ready_pipe.send(RouterReady(max_total_token_num, info))
        logger.info("router ready (pid %d): max_total_token_num %d", os.getpid(), max_total_token_num)
        manager.serve_forever()
    except WorkerDied as exc:
        logger.error("%s; the router stops", exc)
        sys.exit(1)
    finally:
        workers.shutdown()


def load_model(workers: ModelWorkers, config: ServerConfig) -> tuple[int, dict]:
    try:
        return workers.load(
            model_dir=config.model_dir,
            max_total_token_num=config.max_total_token_num,
            max_req_total_len=config.max_req_total_len,
            running_max_req_size=config.running_max_req_size,
            data_type=config.data_type,
            load_format=config.load_format,
            cuda_graph=not config.disable_cuda_graph,
            world_size=config.tp,
            nccl_port=config.nccl_port,
        )
    except WorkerDied:
        raise
    except Exception as exc:  # the model directory or the flags are wrong: say so, once
        logger.debug("model loading failed", exc_info=True)
        logger.error("cannot load the model from %s: %s", config.model_dir, describe_error(exc))
        sys.exit(1)
