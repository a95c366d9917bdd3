"""The HTTP process's side of the sockets: send requests to the router, route text back to them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from lightllm.server.config import ServerConfig
from lightllm.server.io_struct import AbortReq, BatchTextOut, FinishReason, GenerateReq, RouterStats, SamplingParams, TextOut
from lightllm.server.httpserver.metrics import Metrics

logger = logging.getLogger(__name__)


class HttpServerManager:
    def __init__(self, config: ServerConfig, metrics: Metrics):
        self._config = config
        self.metrics = metrics
        self._req_ids = itertools.count()
        self._outputs: dict[int, asyncio.Queue[TextOut]] = {}
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
        if self._receiver is not None:
            self._receiver.cancel()
        self._inbox.close(linger=0)
        self._to_router.close(linger=0)

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
            else:
                logger.error("unexpected message %r", type(msg).__name__)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TextOut]:
        """Yield the request's outputs until its last one. Leaving early (the client went away,
        a timeout) aborts it in the router, which frees its KV tokens."""
        req_id = next(self._req_ids)
        queue: asyncio.Queue[TextOut] = asyncio.Queue()
        self._outputs[req_id] = queue
        self._to_router.send_pyobj(GenerateReq(req_id, prompt_ids, sampling, time.time()))
        finish_reason = None
        try:
            while finish_reason is None:
                out = await queue.get()
                finish_reason = out.finish_reason
                yield out
        finally:
            del self._outputs[req_id]
            # After a stop sequence the router still runs the request: it only learns of it here.
            if finish_reason in (None, FinishReason.STOP):
                self._to_router.send_pyobj(AbortReq(req_id))
