"""Bounds on HTTP connections that uvicorn does not give: the time to receive a whole request
(--request_receive_timeout) and the number of open connections (--max_connections).

uvicorn's HTTP protocols (httptools' and h11's) wait for a request's headers and body for as long
as the client likes: a Content-Length larger than the body, a chunk size that lies, or headers sent
a line at a time hold a socket open forever. An ASGI middleware cannot bound that, since the app
sees a request only once its headers are complete; so the bound lives in the protocol, one timer a
request: armed when the request's first byte comes (or when the connection opens), disarmed once
its body is complete. If it fires first, the client gets 408 and the connection closes.

--max_connections is here too, not uvicorn's limit_concurrency: that one answers 503 to every
request, on every connection, while the count is past it (the clients already served included), and
does nothing to a connection that never completes its headers. Refusing the connection past the
bound at once keeps those already open served and bounds the sockets a slow client can hold.
"""

from __future__ import annotations

import json
import logging
import time

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from lightllm.server.httpserver.errors import error_body

logger = logging.getLogger(__name__)
QUIET_S = 10.0  # a flood of refused or timed-out connections logs a line this often, with a count


class CountedLine:
    """One INFO line, at most once every QUIET_S seconds, saying how many times it happened since."""

    def __init__(self, text: str):
        self.text, self.count, self.logged_at = text, 0, -QUIET_S

    def add(self, *args) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= QUIET_S:
            logger.info(self.text + " (%d since the last such line)", *args, self.count)
            self.count, self.logged_at = 0, now


REFUSED = CountedLine("refused a connection from %s: %d open (--max_connections)")
TIMED_OUT = CountedLine("closed a connection from %s: the request was not received within %g s "
                        "(--request_receive_timeout)")


def raw_response(status: int, reason: str, path: str, message: str, error_type: str,
                 extra_headers: str = "") -> bytes:
    """A whole HTTP/1.1 response with a JSON error body and `Connection: close`, written to the
    socket directly: the request it answers never reached the app."""
    body = json.dumps(error_body(path, message, error_type, status)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra_headers}connection: close\r\n\r\n")
    return head.encode() + body


class GuardedHTTPProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP protocol with a receive timeout a request and a bound on open connections;
    the class attributes are set by `guarded_protocol`."""

    receive_timeout: float
    max_connections: int

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._receive_timer = None
        self._earlier_cycle = None  # the cycle of the request before the one being received
        if len(self.connections) > self.max_connections:
            REFUSED.add(self._client(), len(self.connections) - 1)
            transport.write(raw_response(503, "Service Unavailable", "", "too many open connections; retry later",
                                         "unavailable", "retry-after: 1\r\n"))
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        # uvicorn arms its keep-alive timer when a response ends; bytes while it runs begin a new request.
        if self.timeout_keep_alive_task is not None:
            self._arm()
        super().data_received(data)
        if self._receive_timer is not None and self._received():
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._earlier_cycle = self.cycle
        self._receive_timer = self.loop.call_later(self.receive_timeout, self._receive_timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_receive_timer", None) is not None:
            self._receive_timer.cancel()
            self._receive_timer = None

    def _received(self) -> bool:
        """The request being timed has its headers (a new cycle) and its whole body."""
        return self.cycle is not self._earlier_cycle and not self.cycle.more_body

    def _receive_timed_out(self) -> None:
        self._receive_timer = None
        if self.transport.is_closing() or self._received():
            return
        started = self.cycle is not self._earlier_cycle
        TIMED_OUT.add(self._client(), self.receive_timeout)
        if not (started and self.cycle.response_started):  # the app answered already (a 413): just close
            path = self.cycle.scope["path"] if started else ""
            self.transport.write(raw_response(408, "Request Timeout", path,
                                              f"the request was not received within {self.receive_timeout:g} s "
                                              "(--request_receive_timeout)", "timeout"))
        self.transport.close()  # the app, if it waits for the body, gets http.disconnect

    def _client(self) -> str:
        return "%s:%d" % self.client[:2] if self.client else "?"


def guarded_protocol(receive_timeout: float, max_connections: int) -> type[GuardedHTTPProtocol]:
    """The protocol class to give uvicorn.Config(http=...), with these bounds."""
    return type("GuardedHTTPProtocol", (GuardedHTTPProtocol,),
                {"receive_timeout": receive_timeout, "max_connections": max_connections})
