"""How a POST body becomes the route's pydantic model, and how its mistakes become 4xx messages.

`JSONBodyRoute` reads the body before FastAPI does: the content type is checked (415), the JSON
is read strictly (no NaN or Infinity, no lone UTF-16 surrogates, an object at the top) and only
then does FastAPI validate it against the model the route function declares, so /openapi.json
describes every body while the errors keep this server's wording.

A body above OFF_LOOP_BYTES is parsed and validated on a thread, so that the event loop goes on
answering other requests (and /health) meanwhile; what holds the GIL for long is bounded instead:
a body holds at most MAX_JSON_KEYS object keys in all, unknown top-level fields are named before
pydantic makes an error of each, and an error names at most MAX_CLAUSES fields.

Content types: JSON (`application/json`, `*+json`), none at all, and
`application/x-www-form-urlencoded` when the body is JSON: that is what `curl -d '{...}'` sends
without `-H 'Content-Type: application/json'`, the way most people first try an API. Anything
else (text/plain, multipart, xml, a form that is not JSON) gets 415.
"""

from __future__ import annotations

import asyncio
import json
import reprlib
from itertools import islice

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from lightllm.frontend.errors import RequestError


CURL_FORM_TYPE = "application/x-www-form-urlencoded"


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def check_content_type(media: str) -> None:
    if media in ("", "application/json", CURL_FORM_TYPE) or media.endswith("+json"):
        return
    raise RequestError(f"Content-Type {media!r} is not supported: send a JSON body (application/json)", 415)


class NotJSON(RequestError):
    """The text does not parse as JSON at all (a real form body, for one)."""


# Arrays and objects inside one another. Deeper JSON overflows Python's recursion limit in json.loads
# (a RecursionError) or later in json.dumps and xgrammar; no body or schema a client means nests this deep.
MAX_JSON_DEPTH = 128


# Object keys in a whole body, at all depths. pydantic makes an error, and FastAPI a dict, for each
# unknown key, and a 400 that named 600k keys took 6.9 s on the event loop (2-core CPU, 2026-12-02);
# a request with 128 tools, each with a schema of a hundred keys, holds about 13k.
MAX_JSON_KEYS = 1 << 16
# Bodies larger than this are parsed and validated on a thread. 64 KiB of JSON parse in 0.3 ms (a
# 2-core CPU, 2026-12-02); a thread hop costs 0.1 ms idle, but up to a switch interval of waiting
# for the GIL (5 ms) when the loop is busy, so smaller bodies stay on the loop. json.loads itself
# holds the GIL, on a thread too: --max_request_body_bytes bounds that (8 MiB: about 0.3 s).
OFF_LOOP_BYTES = 64 << 10
MAX_CLAUSES = 5  # fields an error names; the rest are counted


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def json_depth(value) -> int:
    """How many arrays and objects `value` holds inside one another; level by level, since a
    recursive walk would hit the recursion limit itself."""
    depth, level = 0, [value]
    while level := [v for v in level if isinstance(v, (dict, list))]:
        depth += 1
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]
    return depth


def load_json(text: str | bytes, what: str):
    """`text` read strictly as JSON; a RequestError (400) that names `what` and the problem otherwise."""
    too_deep = f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} deep"
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise RequestError(too_deep) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        # The last one ends "; use sys.set_int_max_str_digits() ...": advice for us, not the client.
        raise NotJSON(f"{what} is not valid JSON: {str(exc).split('; use sys.')[0]}") from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise RequestError(too_deep)
    return data


def json_key_count(value) -> int:
    """Keys of every object in `value`, level by level as json_depth walks."""
    count, level = 0, [value]
    while level := [v for v in level if isinstance(v, (dict, list))]:
        count += sum(len(v) for v in level if isinstance(v, dict))
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]
    return count


def check_fields(data: dict, known: frozenset[str] | None) -> None:
    """Many unknown top-level fields, a few named, before pydantic makes an error of each (a few
    are left to pydantic, which names them beside the body's other mistakes)."""
    if known is None or len(data) <= MAX_CLAUSES:
        return
    unknown = [name for name in data if name not in known]
    if len(unknown) > MAX_CLAUSES:
        named = "; ".join(f"{shown(name)}: unknown field" for name in unknown[:MAX_CLAUSES])
        raise RequestError(f"{named}; and {len(unknown) - MAX_CLAUSES} more unknown fields")


def parse_json(body: bytes, known: frozenset[str] | None = None) -> dict:
    """`known`: the top-level fields a body may hold (None: any)."""
    data = load_json(body, "request body")
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    check_fields(data, known)
    if (keys := json_key_count(data)) > MAX_JSON_KEYS:
        raise RequestError(f"request body holds {keys} object keys, more than {MAX_JSON_KEYS}")
    try:  # JSON may escape lone UTF-16 surrogates ("\ud800"), which no tokenizer can take
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("request body holds text that is not valid Unicode (a lone surrogate such as "
                           "\\ud800)") from None
    return data


def read_json(content_type: str | None, body: bytes, known: frozenset[str] | None = None) -> dict:
    media = media_type(content_type)
    check_content_type(media)
    try:
        return parse_json(body, known)
    except NotJSON:
        if media == CURL_FORM_TYPE:  # a real form, not curl -d '{...}'
            raise RequestError(f"an {CURL_FORM_TYPE} body must hold JSON: send a JSON body (application/json)",
                               415) from None
        raise


class ReadRequest(Request):
    """A request whose body was read and parsed already; FastAPI takes `json()` as the body."""

    def __init__(self, request: Request, body: bytes, data: dict):
        # FastAPI parses only a body labelled JSON; the client's own label was checked by read_json.
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

        def read_and_validate(content_type: str | None, body: bytes) -> dict:
            data = read_json(content_type, body, known)
            if self.body_field is not None:  # FastAPI validates it again, on the loop: quick once valid
                _, errors = self.body_field.validate(data, {}, loc=("body",))
                if errors:
                    raise RequestError(describe_errors(errors))
            return data

        async def read_then_handle(request: Request) -> Response:
            body = await request.body()
            content_type = request.headers.get("content-type")
            if len(body) > OFF_LOOP_BYTES:
                data = await asyncio.to_thread(read_and_validate, content_type, body)
            else:
                data = read_json(content_type, body, known)
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

MAX_SHOWN_CHARS = 60
UNION_MEMBER_NAMES = {"str", "int", "float", "bool", "none", "list", "dict"}


class BriefRepr(reprlib.Repr):
    """repr() that stops after a few items of each container: the input of an error may be an
    object of 600k keys, whose whole repr takes seconds. Dicts keep their order (reprlib sorts them)."""

    def __init__(self):
        super().__init__()
        self.maxdict = self.maxlist = self.maxtuple = 8
        self.maxstring = self.maxother = self.maxlong = MAX_SHOWN_CHARS

    def repr_dict(self, x, level):
        if not x or level <= 0:
            return "{}" if not x else "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in islice(x.items(), self.maxdict)]
        return "{" + ", ".join(items + ["..."] * (len(x) > self.maxdict)) + "}"


_BRIEF = BriefRepr()


def shown(value) -> str:
    text = _BRIEF.repr(value) if isinstance(value, (dict, list, tuple)) else repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "..."


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
