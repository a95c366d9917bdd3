"""The HTTP process's side of the sockets: send requests to the router, route text back to them.

It also keeps what /health reports: the router's heartbeat, and why new requests are refused
once the server shuts down or one of its processes failed (then every open request has already
ended with that error).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from lightllm.server.config import ServerConfig
from lightllm.server.httpserver.metrics import Metrics
from lightllm.server.io_struct import (
    AbortReq,
    BatchTextOut,
    FinishReason,
    GenerateReq,
    RouterFailed,
    RouterHeartbeat,
    RouterStats,
    SamplingParams,
    TextOut,
)

logger = logging.getLogger(__name__)


class ServerUnavailable(Exception):
    """The server takes no new requests (it is shutting down, or a process failed): a 503."""


class HttpServerManager:
    def __init__(self, config: ServerConfig, metrics: Metrics, heartbeat: RouterHeartbeat):
        self._config = config
        self.metrics = metrics
        self._heartbeat = heartbeat
        self._req_ids = itertools.count()
        self._outputs: dict[int, asyncio.Queue[TextOut]] = {}
        self._idle = asyncio.Event()  # set while no request is open
        self._idle.set()
        self._refusing: str | None = None  # why new requests get a 503
        self._receiver: asyncio.Task | None = None

    async def start(self) -> None:
        """Open the sockets inside the running event loop and start routing replies."""
        # Sending never waits (unbounded queue), so a plain socket is fine inside the event loop.
        self._to_router = zmq.Context.instance().socket(zmq.PUSH)
        self._to_router.setsockopt(zmq.SNDHWM, 0)
        self._to_router.connect(self._config.router_address)
        self._inbox = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(self._config.http_address)
        self._receiver = asyncio.create_task(self._receive_forever())

    async def stop(self) -> None:
        """Close the sockets only once the receiver has finished with its own."""
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        self._inbox.close(linger=0)
        self._to_router.close(linger=0)

    @property
    def open_requests(self) -> int:
        return len(self._outputs)

    def health_problem(self) -> str | None:
        """Why the server is unhealthy (None: healthy). Never waits: a busy server answers at once."""
        return self._refusing or self._heartbeat.stalled(self._config.step_timeout)

    def refuse_new(self, reason: str) -> None:
        if self._refusing is None:
            self._refusing = reason

    def fail_all(self, reason: str) -> None:
        """Refuse new requests, and end every open one with `reason` as its error."""
        self.refuse_new(reason)
        for req_id, queue in self._outputs.items():
            queue.put_nowait(TextOut(req_id, -1, "", 0.0, False, 0, FinishReason.ERROR, error=reason))

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
            msg = await self._inbox.recv_pyobj()
            if isinstance(msg, BatchTextOut):
                for out in msg.items:
                    queue = self._outputs.get(out.req_id)
                    if queue is not None:  # else: its client has gone
                        queue.put_nowait(out)
            elif isinstance(msg, RouterStats):
                self.metrics.router = msg
            elif isinstance(msg, RouterFailed):
                logger.error("the router failed: %s; ending %d open requests", msg.error, self.open_requests)
                self.fail_all(msg.error)
            else:
                logger.error("unexpected message %r", type(msg).__name__)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TextOut]:
        """Yield the request's outputs until its last one. Leaving early (the client went away,
        a timeout) aborts it in the router, which frees its KV tokens."""
        if self._refusing is not None:
            raise ServerUnavailable(self._refusing)
        req_id = next(self._req_ids)
        queue: asyncio.Queue[TextOut] = asyncio.Queue()
        self._outputs[req_id] = queue
        self._idle.clear()
        self._to_router.send_pyobj(GenerateReq(req_id, prompt_ids, sampling, time.time()))
        finish_reason = None
        try:
            while finish_reason is None:
                out = await queue.get()
                finish_reason = out.finish_reason
                yield out
        finally:
            del self._outputs[req_id]
            if not self._outputs:
                self._idle.set()
            # After a stop sequence the router still runs the request: it only learns of it here.
            if finish_reason in (None, FinishReason.STOP) and not self._to_router.closed:
                self._to_router.send_pyobj(AbortReq(req_id))
