"""The router process: a thin shell that feeds the engine core from ZeroMQ and sends its tokens on.

It sleeps on its socket (and on the workers' exit) whenever the engine has nothing to do, waking
once a second to mark its heartbeat for /health. If a worker dies or the engine raises, it tells
the HTTP process why (RouterFailed: every open request ends with that error) and exits.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import sys
import time

import zmq

from lightllm.engine.build import EngineStartError, build_engine, load_model, start_workers
from lightllm.engine.core import EngineCore, WorkerDied, describe_error
from lightllm.engine.request import GenerateReq
from lightllm.engine.workers import ModelWorkers
from lightllm.server.config import ServerConfig
from lightllm.server.io_struct import (
    AbortReq,
    BatchTokenOut,
    FlushCache,
    LoraLoad,
    LoraUnload,
    RouterFailed,
    RouterHeartbeat,
    RouterReady,
    RouterStats,
)
from lightllm.server.router.stats import ThroughputLog
from lightllm.utils.process import freeze_startup_heap, init_child_process

logger = logging.getLogger(__name__)

STATS_PUBLISH_INTERVAL = 0.05  # seconds between RouterStats messages while busy
FAILURE_LINGER_MS = 2000  # how long the exiting router tries to deliver RouterFailed


class RouterManager:
    def __init__(self, config: ServerConfig, core: EngineCore, sentinels: list[int] = (),
                 heartbeat: RouterHeartbeat | None = None, replica: int = 0):
        self.core = core
        self.replica = replica
        self._heartbeat = heartbeat or RouterHeartbeat(multiprocessing)  # nobody reads it in the simulator
        # The main process started this clock before the model loaded, which may take longer than
        # TURN_TIMEOUT: without this, /health would call the loop stuck until its first turn.
        self._heartbeat.turned()
        self._max_total_token_num = core.scheduler.max_total_token_num
        self._serves_loras = config.lora_slots > 0
        self._throughput = None if config.disable_log_stats else ThroughputLog(config.log_stats_interval)
        self._stats_dirty = False  # something changed since the last RouterStats
        self._last_publish = 0.0
        self._sentinels = list(sentinels)
        # Outputs not yet sent to the detokenizer. While busy a turn's outputs go out during the
        # next turn's step (`while_waiting`, which the model workers call once they have its plan):
        # a step with drafts waits for its result, so sending them before planning the next would
        # hold up its launch. `_carried`: this turn's step sent the earlier ones.
        self._unsent: list = []
        self._carried = False
        self._open_sockets(config)

    def _open_sockets(self, config: ServerConfig) -> None:
        context = zmq.Context.instance()
        self._inbox = context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(config.router_addresses[self.replica])
        self._to_detokenizer = context.socket(zmq.PUSH)
        self._to_detokenizer.setsockopt(zmq.SNDHWM, 0)
        self._to_detokenizer.connect(config.detokenization_address)
        self._to_http = context.socket(zmq.PUSH)
        self._to_http.setsockopt(zmq.SNDHWM, 0)
        self._to_http.connect(config.http_address)
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        for sentinel in self._sentinels:
            self._poller.register(sentinel, zmq.POLLIN)  # readable once the worker has exited

    def close(self) -> None:
        """linger=0: the peers may be gone already, and a socket with unsent messages and the
        default linger would hold the process at exit."""
        for sock in (self._inbox, self._to_detokenizer, self._to_http):
            sock.close(linger=0)

    def report_failure(self, error: str) -> None:
        """The router's last word to the HTTP process, which ends every open request with it."""
        self._to_http.send_pyobj(RouterFailed(error))
        self._to_http.close(linger=FAILURE_LINGER_MS)

    def serve_forever(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        """One turn of the loop: wait (only when idle), receive, one engine step, emit."""
        trace = self.core.host_trace
        if trace is not None:
            trace.next()
            trace.mark("turn")
        self._wait_for_work()
        self._receive()
        self._heartbeat.step_started()
        computed = self.core.scheduler.prompt_computed_tokens
        self._carried = False
        outs = self.core.step()
        self._heartbeat.turned()
        if outs:
            self._unsent += outs
            self._stats_dirty = True
        if self._throughput is not None and (outs or self.core.scheduler.prompt_computed_tokens != computed):
            self._throughput.count(generated_tokens=len(outs))  # a prompt's chunks keep the window open too
        if not self._carried or self.idle:  # no step carried the earlier ones, or none will carry these
            self.while_waiting()
        if trace is not None:
            trace.mark("sent")
            if self.idle:  # whole on disk while idle: the stop signal ends the process without atexit
                trace.next()
                trace.file.flush()

    def while_waiting(self) -> None:
        """Send the outputs not yet sent, and the stats when due."""
        self._carried = True
        self._send_outputs()
        self._publish_stats()

    def _send_outputs(self) -> None:
        if self._unsent:
            self._to_detokenizer.send_pyobj(BatchTokenOut(self._unsent))
            self._unsent = []

    @property
    def idle(self) -> bool:
        return not self.core.has_work

    def _wait_for_work(self) -> None:
        """Block until a message arrives (or, when busy, just check); fail if a worker died."""
        timeout_ms = self._idle_timeout_ms() if self.idle else 0
        events = dict(self._poller.poll(timeout_ms))
        if any(sentinel in events for sentinel in self._sentinels):
            raise WorkerDied("a model worker exited")

    def _idle_timeout_ms(self) -> int:
        """Until the next heartbeat, or sooner if a throughput log is due."""
        due = RouterHeartbeat.INTERVAL
        if self._throughput is not None:
            self._throughput.maybe_log(self._stats())
            log_due = self._throughput.seconds_until_due()
            due = due if log_due is None else min(due, log_due)
        return max(0, int(due * 1000) + 1)

    def _receive(self) -> None:
        while True:
            try:
                msg = self._inbox.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._send_outputs()  # the detokenizer hears of the request's earlier tokens first
            if isinstance(msg, GenerateReq):
                # The detokenizer hears of a request before its first token, and of its abort; it
                # has no use for the compiled grammar (up to megabytes).
                sampling = dataclasses.replace(msg.sampling, compiled_grammar=b"")
                self._to_detokenizer.send_pyobj(GenerateReq(msg.req_id, [], sampling, msg.arrival_time))
                refused = self.core.add(msg)
                if refused:
                    self._to_detokenizer.send_pyobj(BatchTokenOut(refused))
                if self._throughput is not None:
                    self._throughput.count(generated_tokens=0)  # opens the window: prefill follows
            elif isinstance(msg, AbortReq):
                if self.core.abort(msg.req_id):
                    self._to_detokenizer.send_pyobj(msg)
            elif isinstance(msg, LoraLoad):
                self.core.load_lora(msg.lora_id, msg.path)
            elif isinstance(msg, LoraUnload):
                ended = self.core.drop_lora(msg.lora_id)
                if ended:
                    self._to_detokenizer.send_pyobj(BatchTokenOut(ended))
            elif isinstance(msg, FlushCache):
                freed = self.core.scheduler.flush_cache()  # the frees ride on the next plan
                logger.info("prefix cache flushed: %d tokens freed on the device", freed)
            else:
                logger.error("unexpected message %r", type(msg).__name__)
            self._stats_dirty = True

    def _publish_stats(self) -> None:
        """Tell the HTTP process (for /metrics) after a change: at most every 50 ms while busy,
        and at once when the router becomes idle, so that an idle server reports 0 tokens."""
        now = time.monotonic()
        busy = not self.idle
        if not self._stats_dirty or (busy and now - self._last_publish < STATS_PUBLISH_INTERVAL):
            return
        stats = self._stats()
        self._to_http.send_pyobj(stats)
        self._stats_dirty, self._last_publish = False, now
        if self._throughput is not None:
            self._throughput.maybe_log(stats)

    def _stats(self) -> RouterStats:
        scheduler = self.core.scheduler
        stats = RouterStats(len(scheduler.waiting), len(scheduler.running), scheduler.tokens_used,
                            self._max_total_token_num, scheduler.cached_tokens, scheduler.prefix_queried_tokens,
                            scheduler.prefix_hit_tokens, self.replica, scheduler.prompt_computed_tokens)
        stats.num_preemptions = scheduler.num_preemptions
        if scheduler.cache is not None:
            stats.prefix_host_tokens = scheduler.cache.host_tokens
            stats.prefix_host_hit_tokens = scheduler.prefix_host_hit_tokens
            stats.prefix_disk_hit_tokens = scheduler.prefix_disk_hit_tokens
        spec = scheduler.speculator
        if spec is not None:
            stats.spec_drafts, stats.spec_draft_tokens = spec.num_drafts, spec.num_draft_tokens
            stats.spec_accepted_tokens, stats.spec_accepted_per_pos = spec.num_accepted_tokens, tuple(spec.accepted_per_pos)
        if self._serves_loras:
            stats.lora_running = _adapters(scheduler.running)
            stats.lora_waiting = _adapters(scheduler.waiting.values())
        return stats


def _adapters(reqs) -> tuple:
    """The LoRA adapters `reqs` run under, sorted, each once (the base model left out)."""
    return tuple(sorted({r.lora_id for r in reqs} - {0}))


def start_router_process(config: ServerConfig, ready_pipe, parent_pid: int, heartbeat: RouterHeartbeat,
                         replica: int = 0) -> None:
    """Entry of a router process (one per --dp replica): start its model workers, report
    RouterReady, serve."""
    init_child_process(parent_pid, config.log_level)
    try:
        workers = start_workers(config, replica)
    except EngineStartError as exc:  # the nodes did not join: the main process sees the router exit
        logger.error("%s; the router stops", exc)
        sys.exit(1)
    try:
        max_total_token_num, info = load_model(workers, config, replica)
        core = build_engine(config.for_replica(replica), workers, max_total_token_num, info)
        manager = RouterManager(config, core, workers.sentinels, heartbeat, replica)
        workers.while_waiting = manager.while_waiting
        freeze_startup_heap()
        ready_pipe.send(RouterReady(max_total_token_num, info))
        logger.info("router ready (pid %d): max_total_token_num %d", os.getpid(), max_total_token_num)
        serve(manager, workers)
    except WorkerDied as exc:  # while loading: the main process sees the router exit before it is ready
        logger.error("%s; the router stops", workers.dead_worker_message(timeout=2.0) or exc)
        sys.exit(1)
    except EngineStartError as exc:
        logger.error("%s", exc)
        sys.exit(1)
    finally:
        workers.shutdown()


def serve(manager: RouterManager, workers: ModelWorkers) -> None:
    """Serve until the stop signal or a failure, which the HTTP process hears of first."""
    try:
        manager.serve_forever()
    except WorkerDied as exc:
        error = workers.dead_worker_message(timeout=2.0) or str(exc)
        logger.error("%s; the router stops", error)
        manager.report_failure(error)
        sys.exit(1)
    except Exception as exc:
        logger.exception("the router failed")
        manager.report_failure(f"the router failed: {describe_error(exc)}")
        sys.exit(1)
    finally:
        manager.close()
