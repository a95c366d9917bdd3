"""A bound on request bodies, enforced before the route reads them (ASGI middleware).

A body larger than the bound gets 413 with the usual JSON error: at once when Content-Length
announces it, otherwise as soon as the bytes received pass it, so a huge body is never held
in memory. The route's JSON shape is kept (OpenAI's under /v1/, TGI's elsewhere).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from lightllm.server.httpserver.errors import error_body


class BodyTooLarge(Exception):
    pass


def too_large_response(path: str, max_bytes: int) -> JSONResponse:
    message = f"request body is larger than {max_bytes} bytes (--max_request_body_bytes)"
    return JSONResponse(error_body(path, message, "validation", 413), status_code=413)


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large_response(scope["path"], self.max_bytes)(scope, receive, send)
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await too_large_response(scope["path"], self.max_bytes)(scope, receive, send)
