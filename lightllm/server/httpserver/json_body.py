"""How a POST body becomes the route's pydantic model, and how its mistakes become 4xx messages.

`JSONBodyRoute` reads the body before FastAPI does: the content type is checked (415), the JSON
is read strictly (no NaN or Infinity, no lone UTF-16 surrogates, an object at the top) and only
then does FastAPI validate it against the model the route function declares, so /openapi.json
describes every body while the errors keep this server's wording.

Content types: JSON (`application/json`, `*+json`), none at all, and
`application/x-www-form-urlencoded` when the body is JSON: that is what `curl -d '{...}'` sends
without `-H 'Content-Type: application/json'`, the way most people first try an API. Anything
else (text/plain, multipart, xml, a form that is not JSON) gets 415.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute

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


def parse_json(body: bytes) -> dict:
    data = load_json(body, "request body")
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    try:  # JSON may escape lone UTF-16 surrogates ("\ud800"), which no tokenizer can take
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("request body holds text that is not valid Unicode (a lone surrogate such as "
                           "\\ud800)") from None
    return data


def read_json(content_type: str | None, body: bytes) -> dict:
    media = media_type(content_type)
    check_content_type(media)
    try:
        return parse_json(body)
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


class JSONBodyRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def read_then_handle(request: Request) -> Response:
            body = await request.body()
            return await handler(ReadRequest(request, body, read_json(request.headers.get("content-type"), body)))

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


def shown(value) -> str:
    text = repr(value)
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
    """One clause per field; a union's members each add what they expected."""
    clauses: dict[str, list[str]] = {}
    for error in errors:
        where, kind = _field_path(error.get("loc", ())), error.get("type")
        if kind == "extra_forbidden":
            text = "unknown field"
        elif kind == "missing":
            text = "required"
        else:
            text = f"{error.get('msg', 'invalid')}, got {shown(error.get('input'))}"
        if text not in clauses.setdefault(where, []):
            clauses[where].append(text)
    return "; ".join(f"'{where}': {' or '.join(texts)}" for where, texts in clauses.items())
