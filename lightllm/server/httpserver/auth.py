"""--api_key: every route but OPEN_PATHS needs `Authorization: Bearer KEY` (ASGI middleware), and so
does /health with a `generate` parameter, which runs a generation.

The check runs before anything reads the body, so a client without the key costs nothing but
its headers. A request without the right key gets 401 with a `WWW-Authenticate: Bearer` header
and the usual JSON error (OpenAI's shape under /v1/). The keys are compared in constant time, as
digests of equal length, so that neither their content nor their length shows in the timing.
Neither the server's key nor a presented one is ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from urllib.parse import parse_qsl

from starlette.responses import JSONResponse

from lightllm.server.httpserver.errors import error_body

logger = logging.getLogger(__name__)

# Probes and scrapers carry no key; none of these tells anything about the requests served.
OPEN_PATHS = frozenset({"/health", "/info", "/metrics", "/version"})
SCHEME = b"bearer "


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header (the scheme in any case), or of an
    `x-api-key: TOKEN` header (what Anthropic's clients send), else None."""
    for name, value in headers:
        if name == b"authorization" and value[:len(SCHEME)].lower() == SCHEME:
            return value[len(SCHEME):].strip()
        if name == b"x-api-key":
            return value.strip()
    return None


def needs_key(scope) -> bool:
    """Whether the request must carry the key. /health with a `generate` parameter does, whatever
    its value: reading "1", "true", "on", ... as FastAPI does would be a second parser to keep in step
    with it. The query is split as Starlette splits it."""
    if scope["path"] not in OPEN_PATHS:
        return True
    query = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
    return scope["path"] == "/health" and any(name == "generate" for name, _ in query)


def unauthorized_response(path: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(path, message, "authentication", 401), status_code=401, headers={"WWW-Authenticate": "Bearer"})


class ApiKeyAuth:
    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = _digest(api_key.encode("utf-8"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not needs_key(scope):
            return await self.app(scope, receive, send)
        key = presented_key(scope["headers"])
        if key is not None and hmac.compare_digest(_digest(key), self._expected):
            return await self.app(scope, receive, send)
        why = "no 'Authorization: Bearer' header" if key is None else "the API key is not valid"
        logger.debug("refused %s %s: %s", scope["method"], scope["path"], why)
        message = f"{why}: this server needs 'Authorization: Bearer <its --api_key>'"
        await unauthorized_response(scope["path"], message)(scope, receive, send)
