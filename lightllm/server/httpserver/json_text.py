"""A request body read strictly as JSON, within the bounds that keep reading it cheap.

Strict: no NaN or Infinity, no lone UTF-16 surrogates, an object at the top, at most
MAX_JSON_DEPTH levels and MAX_JSON_KEYS object keys; many unknown top-level fields are named a
few at a time. The processes that parse big bodies (json_body.py) import it and nothing else of
the server: it imports only the standard library and two small modules.
"""

from __future__ import annotations

import json
import os
import reprlib
from itertools import islice

from lightllm.frontend.errors import RequestError
from lightllm.utils.process import init_child_process


class NotJSON(RequestError):
    """The text does not parse as JSON at all (a real form body, for one)."""


# Arrays and objects inside one another. Deeper JSON overflows Python's recursion limit in json.loads
# (a RecursionError) or later in json.dumps and xgrammar; no body or schema a client means nests this deep.
MAX_JSON_DEPTH = 128
# Object keys in a whole body, at all depths. pydantic makes an error, and FastAPI a dict, for each
# unknown key, and a 400 that named 600k keys took 6.9 s on the event loop (2-core CPU, 2026-12-02);
# a request with 128 tools, each with a schema of a hundred keys, holds about 13k.
MAX_JSON_KEYS = 1 << 16
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


# Below the engine's processes, as the grammar compiler: on a machine of few cores a parse takes
# what the engine's steps leave, and only the request it parses waits.
PARSER_NICENESS = 10


def start_parse_process(parent_pid: int, log_level: str) -> None:
    """The first call in a process that parses bodies (json_body.ParseProcesses)."""
    init_child_process(parent_pid, log_level)
    os.setpriority(os.PRIO_PROCESS, 0, PARSER_NICENESS)


MAX_SHOWN_CHARS = 60


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
