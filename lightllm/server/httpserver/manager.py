"""The HTTP process's side of the sockets: send requests to the router, route text back to them.

It also keeps what /health reports: the router's heartbeat, and why new requests are refused
once the server shuts down or one of its processes failed (then every open request has already
ended with that error). And it bounds the queue: a request that would make more than
--max_queued_requests open requests wait for their first token is refused at once (QueueFull,
a 429), before it reaches the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from lightllm.engine.request import FinishReason, GenerateReq, SamplingParams
from lightllm.frontend.errors import RequestError
from lightllm.server.config import ServerConfig
from lightllm.server.httpserver.dp_routing import ReplicaRouter
from lightllm.server.httpserver.metrics import Metrics
from lightllm.server.io_struct import (
    AbortReq,
    FlushCache,
    BatchTextOut,
    LoraLoad,
    LoraUnload,
    RouterFailed,
    RouterHeartbeat,
    RouterStats,
    TextOut,
)

logger = logging.getLogger(__name__)


# Seconds a client turned away by a stopping server waits: about one health-check period of a load
# balancer, after which it sends the retry to another replica (or to this one, restarted).
UNAVAILABLE_RETRY_AFTER = 5


class ServerUnavailable(Exception):
    """The server takes no new requests (it is shutting down, or a process failed), or it ended an open
    one as it stopped: a 503 that asks to try again (elsewhere) in `retry_after` seconds."""

    status_code, error_type = 503, "unavailable"

    def __init__(self, message: str, retry_after: int = UNAVAILABLE_RETRY_AFTER):
        super().__init__(message)
        self.retry_after = retry_after


class QueueFull(Exception):
    """--max_queued_requests requests wait already: a 429 that asks to come back in `retry_after` seconds."""

    status_code, error_type = 429, "queue_full"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


MAX_RETRY_AFTER = 60  # seconds
QUEUE_EXITS_KEPT = 64  # the recent first tokens that Retry-After's rate is measured over
RECEIVE_AT_ONCE = 256  # most detokenizer messages routed to the streams before any of them runs


class HttpServerManager:
    def __init__(self, config: ServerConfig, metrics: Metrics, heartbeats: list[RouterHeartbeat],
                 host_cache_tokens: list[int] | None = None):
        self._config = config
        self.metrics = metrics
        self._heartbeats = heartbeats  # one per --dp replica
        # Load of each replica: KV tokens its open requests may take (prompt + max_new_tokens),
        # known here at once, unlike the routers' reports, which lag.
        self._load = [0] * config.dp
        self._replicas = ReplicaRouter(config.dp, config.dp_routing)
        self._host_cache_tokens = host_cache_tokens or [0] * config.dp  # each replica's host and disk tiers
        self._req_ids = itertools.count()
        self._outputs: dict[int, asyncio.Queue[TextOut]] = {}
        self._queued: set[int] = set()  # open requests without their first output yet
        self._queue_exits: deque[float] = deque(maxlen=QUEUE_EXITS_KEPT)  # when the last ones got it
        metrics.queued.set_function(lambda: len(self._queued))
        self._idle = asyncio.Event()  # set while no request is open
        self._idle.set()
        self._refusing: str | None = None  # why new requests get a 503
        self._receiver: asyncio.Task | None = None

    async def start(self) -> None:
        """Open the sockets inside the running event loop and start routing replies."""
        # Sending never waits (unbounded queue), so a plain socket is fine inside the event loop.
        self._to_routers = []
        for address in self._config.router_addresses:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(address)
            self._to_routers.append(sock)
        self._inbox = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(self._config.http_address)
        self._inbox_now = zmq.Socket.shadow(self._inbox)  # the same socket, read without waiting
        self._receiver = asyncio.create_task(self._receive_forever())

    async def stop(self) -> None:
        """Close the sockets only once the receiver has finished with its own."""
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        self._inbox.close(linger=0)
        for sock in self._to_routers:
            sock.close(linger=0)

    @property
    def open_requests(self) -> int:
        return len(self._outputs)

    def check_queue(self, count: int = 1) -> None:
        """Raise QueueFull if `count` more requests would make more than --max_queued_requests wait
        for their first output (RequestError if `count` alone is more)."""
        limit = self._config.max_queued_requests
        if count > limit:
            raise RequestError(f"{count} requests at once can never be queued: --max_queued_requests is {limit}")
        excess = len(self._queued) + count - limit
        if excess > 0:
            raise QueueFull(f"the server is busy: {len(self._queued)} requests wait for their first token "
                            f"(--max_queued_requests={limit}); retry later", self._retry_after(excess))

    def _retry_after(self, excess: int) -> int:
        """Seconds until `excess` queued requests have had their first output, at the rate the last
        QUEUE_EXITS_KEPT had theirs; 1 to MAX_RETRY_AFTER."""
        exits = self._queue_exits
        span = exits[-1] - exits[0] if len(exits) > 1 else 0.0
        if span <= 0:
            return 1
        return min(MAX_RETRY_AFTER, max(1, math.ceil(excess * span / (len(exits) - 1))))

    def health_problem(self) -> str | None:
        """Why the server is unhealthy (None: healthy). Never waits: a busy server answers at once."""
        if self._refusing is not None:
            return self._refusing
        for replica, heartbeat in enumerate(self._heartbeats):
            stalled = heartbeat.stalled(self._config.step_timeout)
            if stalled is not None:
                return stalled if len(self._heartbeats) == 1 else f"replica {replica}: {stalled}"
        return None

    def _pick_replica(self, prompt_ids: list[int]) -> int:
        """By --dp_routing (dp_routing.py), from each replica's share of its KV budget that its open
        requests may take."""
        if len(self._load) == 1:
            return 0
        budget = [stats.max_total_token_num for stats in self.metrics.routers]
        loads = [load / tokens for load, tokens in zip(self._load, budget)]
        return self._replicas.pick(prompt_ids, loads, [b + h for b, h in zip(budget, self._host_cache_tokens)])

    def refuse_new(self, reason: str) -> None:
        if self._refusing is None:
            self._refusing = reason

    def fail_all(self, reason: str) -> None:
        """A process failed: refuse new requests, and end every open one with `reason` as its error (a 500)."""
        self._end_all(reason, retry_after=None)

    def end_all_unavailable(self, reason: str) -> None:
        """The server stops: refuse new requests, and end every open one as unavailable (a 503 with
        Retry-After), since the request itself did nothing wrong and may succeed elsewhere."""
        self._end_all(reason, retry_after=UNAVAILABLE_RETRY_AFTER)

    def _end_all(self, reason: str, retry_after: int | None) -> None:
        self.refuse_new(reason)
        for req_id, queue in self._outputs.items():
            queue.put_nowait(TextOut(req_id, -1, "", 0.0, False, 0, FinishReason.ERROR, error=reason,
                                     retry_after=retry_after))

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is open; False if some still are after `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def _receive_forever(self) -> None:
        while True:
            messages = [await self._inbox.recv_pyobj()]
            # And whatever else has come, before any stream runs: a server behind its streams then
            # hands each stream every step it is behind at once, which it writes in one go
            # (Generation.event_stream), instead of one step a pass of the event loop.
            with contextlib.suppress(zmq.Again):
                while len(messages) < RECEIVE_AT_ONCE:
                    messages.append(self._inbox_now.recv_pyobj(zmq.NOBLOCK))
            for msg in messages:
                self._route(msg)

    def _route(self, msg) -> None:
        """One message from the detokenizer: outputs to their streams, stats, a failure."""
        if isinstance(msg, BatchTextOut):
            for out in msg.items:
                queue = self._outputs.get(out.req_id)
                if queue is not None:  # else: its client has gone
                    queue.put_nowait(out)
                if out.req_id in self._queued:
                    self._queued.remove(out.req_id)
                    self._queue_exits.append(time.monotonic())
        elif isinstance(msg, RouterStats):
            self.metrics.report(msg)
        elif isinstance(msg, RouterFailed):
            logger.error("the router failed: %s; ending %d open requests", msg.error, self.open_requests)
            self.fail_all(msg.error)
        else:
            logger.error("unexpected message %r", type(msg).__name__)

    def backlog(self, req_id: int) -> int:
        """Outputs of request `req_id` received from the detokenizer and not yet taken by its stream."""
        queue = self._outputs.get(req_id)
        return 0 if queue is None else queue.qsize()

    def send_all(self, msg: LoraLoad | LoraUnload | FlushCache) -> None:
        """A LoRA adapter loaded or unloaded, or the prefix cache flushed, on every replica (before
        any request sent after it: each router reads its socket in order)."""
        for to_router in self._to_routers:
            to_router.send_pyobj(msg)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *,
                       bounded: bool = True, lora_id: int = 0, cache_salt: str = "",
                       priority: int = 0) -> AsyncIterator[TextOut]:
        """Yield the request's outputs until its last one. Leaving early (the client went away,
        a timeout) aborts it in the router, which frees its KV tokens. `bounded`: refused with
        QueueFull when the queue is full (the /health probe is not)."""
        if self._refusing is not None:
            raise ServerUnavailable(self._refusing)
        if bounded:
            self.check_queue()
        req_id = next(self._req_ids)
        queue: asyncio.Queue[TextOut] = asyncio.Queue()
        self._outputs[req_id] = queue
        self._queued.add(req_id)
        self._idle.clear()
        replica, cost = self._pick_replica(prompt_ids), len(prompt_ids) + sampling.max_new_tokens
        self._load[replica] += cost
        self.metrics.routed.labels(str(replica)).inc()
        to_router = self._to_routers[replica]
        to_router.send_pyobj(GenerateReq(req_id, prompt_ids, sampling, time.time(), lora_id, cache_salt, priority))
        finish_reason = None
        try:
            while finish_reason is None:
                out = await queue.get()
                finish_reason = out.finish_reason
                yield out
        finally:
            del self._outputs[req_id]
            self._queued.discard(req_id)
            self._load[replica] -= cost
            if not self._outputs:
                self._idle.set()
            # After a stop sequence the router still runs the request: it only learns of it here.
            if finish_reason in (None, FinishReason.STOP) and not to_router.closed:
                to_router.send_pyobj(AbortReq(req_id))
