"""How a POST body becomes the route's pydantic model, and how its mistakes become 4xx messages.

`JSONBodyRoute` reads the body before FastAPI does: the content type is checked (415), the JSON
is read strictly and within its bounds (json_text.py) and only then does FastAPI validate it
against the model the route function declares, so /openapi.json describes every body while the
errors keep this server's wording.

A body above OFF_LOOP_BYTES is parsed in another process (`ParseProcesses`) and validated on a
thread, so that the event loop goes on answering other requests (and /health) meanwhile. Not on a
thread alone: json.loads holds the GIL throughout, about 0.3 s for a body near the 8 MiB bound,
and the loop with it. What comes back is either a small RequestError or a dict within the bounds
(at most MAX_JSON_KEYS keys), so that unpickling it costs this process little; what holds the GIL
for long in validation is bounded too: unknown top-level fields are named before pydantic makes
an error of each, and an error names at most MAX_CLAUSES fields.

Content types: JSON (`application/json`, `*+json`), none at all, and
`application/x-www-form-urlencoded` when the body is JSON: that is what `curl -d '{...}'` sends
without `-H 'Content-Type: application/json'`, the way most people first try an API. Anything
else (text/plain, multipart, xml, a form that is not JSON) gets 415.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from lightllm.frontend.errors import RequestError
from lightllm.server.httpserver.json_text import MAX_CLAUSES, NotJSON, parse_json, shown, start_parse_process
from lightllm.utils.process import start_signals_blocked

logger = logging.getLogger(__name__)

CURL_FORM_TYPE = "application/x-www-form-urlencoded"


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def check_content_type(media: str) -> None:
    if media in ("", "application/json", CURL_FORM_TYPE) or media.endswith("+json"):
        return
    raise RequestError(f"Content-Type {media!r} is not supported: send a JSON body (application/json)", 415)


# Bodies larger than this are parsed in a parse process. 64 KiB of JSON parse in 0.3 ms on the loop
# (a 2-core CPU, 2026-12-02), about what a trip to a process and back costs; a body near the 8 MiB
# bound takes 0.3-0.4 s, which on a thread held the GIL, and so the loop: a 2-token /generate beside
# three such bodies took 0.71-1.10 s against 0.18 s idle, and 0.22-0.23 s parsed in processes.
OFF_LOOP_BYTES = 64 << 10
# Big bodies parsed at once; more wait their turn. A process holds a body's objects while it parses
# it (70 MB RSS after a 600k-key body).
PARSE_PROCESSES = 2


class ParseProcesses:
    """The processes that run json_text.parse_json on big bodies, started at the first one (a server
    that never sees one never pays for them) and again after one is killed."""

    def __init__(self):
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, body: bytes, known: frozenset[str] | None) -> dict:
        pool = self._running_pool()
        try:
            with start_signals_blocked():  # submit may start a process (start_parse_process unblocks them)
                future = pool.submit(parse_json, body, known)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:  # a parse process died (the kernel's OOM killer, for one)
            if self._pool is pool:  # not a newer pool, started after this one broke
                logger.warning("a JSON parse process died; the next big body starts new ones")
                self.close()
            raise RequestError("the server's JSON parser stopped while it read this body; send it again", 503) from None

    def _running_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
            self._pool = ProcessPoolExecutor(PARSE_PROCESSES, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=start_parse_process, initargs=(os.getpid(), level))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


# one set a process: the routes of every app share it
PARSERS = ParseProcesses()


def checked_media(content_type: str | None) -> str:
    media = media_type(content_type)
    check_content_type(media)
    return media


async def read_json(media: str, body: bytes, known: frozenset[str] | None = None) -> dict:
    """The body as a dict, from a parse process when it is big; a form that is not JSON is a 415."""
    try:
        if len(body) > OFF_LOOP_BYTES:
            return await PARSERS.parse(body, known)
        return parse_json(body, known)
    except NotJSON:
        if media == CURL_FORM_TYPE:  # a real form, not curl -d '{...}'
            raise RequestError(f"an {CURL_FORM_TYPE} body must hold JSON: send a JSON body (application/json)",
                               415) from None
        raise


class ReadRequest(Request):
    """A request whose body was read and parsed already; FastAPI takes `json()` as the body."""

    def __init__(self, request: Request, body: bytes, data: dict):
        # FastAPI parses only a body labelled JSON; the client's own label was checked (checked_media).
        headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
        super().__init__({**request.scope, "headers": [*headers, (b"content-type", b"application/json")]},
                         request.receive)
        self._raw, self._data = body, data

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> dict:
        return self._data


def known_fields(model) -> frozenset[str] | None:
    """The top-level fields of a body model that forbids others (None: it takes any)."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)) or model.model_config.get("extra") != "forbid":
        return None
    return frozenset(name for key, info in model.model_fields.items() for name in (key, info.alias) if name)


class JSONBodyRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()
        known = known_fields(self.body_field.field_info.annotation) if self.body_field else None

        def validate(data: dict) -> None:
            if self.body_field is not None:  # FastAPI validates it again, on the loop: quick once valid
                _, errors = self.body_field.validate(data, {}, loc=("body",))
                if errors:
                    raise RequestError(describe_errors(errors))

        async def read_then_handle(request: Request) -> Response:
            body = await request.body()
            data = await read_json(checked_media(request.headers.get("content-type")), body, known)
            if len(body) > OFF_LOOP_BYTES:
                await asyncio.to_thread(validate, data)
            return await handler(ReadRequest(request, body, data))

        return read_then_handle


ERROR_RESPONSES = {
    400: {"description": "the body is not valid: the error says which field and why"},
    413: {"description": "the body is larger than --max_request_body_bytes"},
    415: {"description": "the body is not JSON"},
}


def add_json_route(app: FastAPI, path: str, endpoint) -> None:
    """A POST route whose body is the pydantic model that `endpoint` declares."""
    app.router.add_api_route(path, endpoint, methods=["POST"], route_class_override=JSONBodyRoute,
                             responses=ERROR_RESPONSES)


# ---- pydantic's errors as one message ----

UNION_MEMBER_NAMES = {"str", "int", "float", "bool", "none", "list", "dict"}


def _field_path(loc) -> str:
    """('body', 'messages', 0, 'content', 'list[TextPart]', 0) -> messages[0].content[0]: a union's
    member names (pydantic puts them in the path) are left out."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in UNION_MEMBER_NAMES:
            path += f".{part}" if path else part
    return path


def describe_errors(errors: list[dict]) -> str:
    """One clause per field, for the first MAX_CLAUSES fields; a union's members each add what they
    expected. The errors past those are counted, not read: there may be hundreds of thousands."""
    clauses: dict[str, list[str]] = {}
    more = 0
    for seen, error in enumerate(errors):
        where, kind = _field_path(error.get("loc", ())), error.get("type")
        if where not in clauses and len(clauses) == MAX_CLAUSES:
            more = len(errors) - seen
            break
        if kind == "extra_forbidden":
            text = "unknown field"
        elif kind == "missing":
            text = "required"
        else:
            text = f"{error.get('msg', 'invalid')}, got {shown(error.get('input'))}"
        if text not in clauses.setdefault(where, []):
            clauses[where].append(text)
    described = "; ".join(f"'{where}': {' or '.join(texts)}" for where, texts in clauses.items())
    return described + (f"; and {more} more error{'s' if more > 1 else ''}" if more else "")
