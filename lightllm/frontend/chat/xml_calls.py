"""Tool calls in the XML form of Qwen3.5, Qwen3-Next and Qwen3-Coder (--tool_call_parser qwen3_xml):

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is raw text (the newline after its opening tag and the one before its closing tag are
layout, not value), typed by the tool's schema: a string stays as written, a number, a boolean,
null, an object or an array is read as JSON; a value that does not read as its type stays text.
A call's arguments stream as JSON text: a string value as the model writes it, any other once
its closing tag is read, so that the deltas join into exactly the whole answer's arguments.
A block that does not open with a readable `<function=NAME>` is content.
"""

from __future__ import annotations

import json
import re

from lightllm.frontend.chat.tool_calls import (CallArgs, CallFormat, CallStart, StreamParser, Text, _content,
                                             _held_back, forced_calls, new_call_id)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# A value ends at its closing tag; a missing one (a known slip of these models) ends it at the next
# parameter or the function's end. A block's closing tag is text there (code about tool calls holds it).
VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)
NAME = re.compile(r"[^\s<>]+")


def schema_types(schema) -> set[str]:
    """The JSON types a schema admits (its `type`, or those of its anyOf/oneOf; an enum's values')."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        types |= schema_types(branch)
    if not types and isinstance(schema.get("enum"), list):
        types = {"string" if isinstance(v, str) else "json" for v in schema["enum"]}
    return types


def typed_value(text: str, types: set[str]):
    """`text` as one of `types` other than string when it reads as one; else text itself (a string,
    a value that does not read as its type, or no schema)."""
    if text == "null" and "null" in types:
        return None
    if types - {"string"}:
        value = _loads(text.strip() if "boolean" not in types else text.strip().lower())
        if value is not None and _is_one_of(value, types):
            return value
    return text


def _is_one_of(value, types: set[str]) -> bool:
    checks = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
              "array": lambda v: isinstance(v, list), "json": lambda v: True}
    return any(checks.get(kind, lambda v: False)(value) for kind in types)


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _tag_may_follow(rest: str) -> bool:
    """`rest` may yet grow into a tag of a call's body (a parameter's with its name, or an end)."""
    if any(tag.startswith(rest) for tag in (PARAMETER, CLOSE, FUNCTION_END)):
        return True
    return rest.startswith(PARAMETER) and NAME.fullmatch(rest, len(PARAMETER)) is not None


class XmlCall:
    """One call's function, read parameter by parameter; `events` are what is new of it."""

    def __init__(self, index: int, name: str, schema):
        self.index, self.id, self.name = index, new_call_id(), name
        properties = schema.get("properties") if isinstance(schema, dict) else None
        self.properties = properties if isinstance(properties, dict) else {}
        self.params = 0
        self.param: str | None = None  # the open parameter's name
        self.raw = ""  # its value so far
        self.sent = 0  # characters of a streamed string value sent

    def start(self) -> list:
        return [CallStart(self.index, self.id, self.name), CallArgs(self.index, "{")]

    def open_param(self, name: str) -> list:
        self.param, self.raw, self.sent = name, "", 0
        head = ("" if not self.params else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        self.params += 1
        return [CallArgs(self.index, head + ('"' if self._streams() else ""))]

    def _streams(self) -> bool:
        """A value that can only be text is sent as it comes; one that may read as another type waits."""
        return not schema_types(self.properties.get(self.param)) - {"string"}

    def value(self, text: str) -> list:
        """More of the open value; a string sends what no closing tag can yet take back (the
        layout newline before it)."""
        self.raw += text
        if not self._streams():
            return []
        body = self._body(self.raw)
        safe = len(body) - 1 if body.endswith("\n") else len(body)  # the layout newline, maybe
        return self._send(body[:safe])

    def close_param(self) -> list:
        body = self._body(self.raw)
        body = body[:-1] if body.endswith("\n") else body
        if self._streams():
            out = self._send(body) + [CallArgs(self.index, '"')]
        else:
            types = schema_types(self.properties.get(self.param))
            out = [CallArgs(self.index, json.dumps(typed_value(body, types), ensure_ascii=False))]
        self.param = None
        return [e for e in out if e.text]

    def end(self) -> list:
        return (self.close_param() if self.param is not None else []) + [CallArgs(self.index, "}")]

    @staticmethod
    def _body(raw: str) -> str:
        return raw[1:] if raw.startswith("\n") else raw

    def _send(self, body: str) -> list:
        piece = body[self.sent:]
        if self.sent > len(body) or not piece:
            return []
        self.sent = len(body)
        return [CallArgs(self.index, json.dumps(piece, ensure_ascii=False)[1:-1])]


class XmlCallParser(StreamParser):
    """The parser of tool_calls.py's interface; `schemas`: each function's parameters (by name)."""

    def __init__(self, schemas: dict | None = None):
        self.schemas = schemas or {}
        self.buffer = ""
        self.pending = ""  # whitespace after the last content, dropped if a call follows
        self.mode = "text"  # text -> head -> body (-> value) -> text
        self.block = ""  # the open block's text, content again when it is no call
        self.call: XmlCall | None = None
        self.calls = 0

    def _step(self, out: list) -> bool:
        return {"text": self._text, "head": self._head, "body": self._body, "value": self._value}[self.mode](out)

    def finish(self) -> list:
        out: list = []
        if self.mode == "value":
            out += self.call.value(self.buffer)
        if self.call is not None:
            self._end_call(out)
        elif self.mode == "head":
            _content(self, self.block + self.buffer, out)
        elif self.buffer:
            _content(self, self.buffer, out)
        if self.pending and not self.calls:
            out.append(Text(self.pending))
        self.buffer = self.pending = self.block = ""
        self.mode = "text"
        return out

    def _text(self, out: list) -> bool:
        at = self.buffer.find(OPEN)
        if at < 0:
            keep = _held_back(self.buffer, OPEN)
            _content(self, self.buffer[:len(self.buffer) - keep], out)
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        _content(self, self.buffer[:at], out)
        self.block, self.buffer, self.mode = OPEN, self.buffer[at + len(OPEN):], "head"
        return True

    def _head(self, out: list) -> bool:
        """`<function=NAME>` after the block's opening tag, else the block is content."""
        rest = self.buffer.lstrip()
        if FUNCTION.startswith(rest):
            return False
        head = re.match(re.escape(FUNCTION) + r"([^\s<>]*)(>?)", rest)
        if head is not None and not head[2] and head.end() == len(rest):
            return False  # the name goes on
        if head is None or not head[2] or not head[1]:
            _content(self, self.block, out)  # no call: its text, and what follows is read afresh
            self.block, self.mode = "", "text"
            return True
        self.buffer = rest[head.end():]
        self.call, self.block, self.mode = XmlCall(self.calls, head[1], self.schemas.get(head[1])), "", "body"
        self.calls, self.pending = self.calls + 1, ""
        out += self.call.start()
        return True

    def _body(self, out: list) -> bool:
        """Between parameters: a parameter's tag, the function's end, the block's end; other text is no value."""
        rest = self.buffer.lstrip()
        if rest.startswith(CLOSE):
            self.buffer = rest[len(CLOSE):]
            self._end_call(out)
            return True
        param = NAME.match(rest, len(PARAMETER)) if rest.startswith(PARAMETER) else None
        if param is not None and rest.startswith(">", param.end()):
            self.buffer, self.mode = rest[param.end() + 1:], "value"
            out += self.call.open_param(param[0])
            return True
        if rest.startswith(FUNCTION_END):
            self.buffer = rest[len(FUNCTION_END):]
            return True
        if _tag_may_follow(rest):
            self.buffer = rest
            return False
        self.buffer = rest[1:]  # stray text inside a call is skipped
        return True

    def _value(self, out: list) -> bool:
        ends = [(at, tag) for tag in VALUE_ENDS if (at := self.buffer.find(tag)) >= 0]
        if not ends:
            keep = max(_held_back(self.buffer, tag) for tag in VALUE_ENDS)
            out += self.call.value(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        at, tag = min(ends)
        out += self.call.value(self.buffer[:at]) + self.call.close_param()
        self.buffer = self.buffer[at + (len(tag) if tag == PARAMETER_END else 0):]
        self.mode = "body"
        return True

    def _end_call(self, out: list) -> None:
        out += self.call.end()
        self.call, self.mode = None, "text"


def write_call(name: str, arguments: dict | str) -> str:
    """A call as these models write it (for a history their chat template cannot render)."""
    if isinstance(arguments, str):
        arguments = _loads(arguments) if isinstance(_loads(arguments), dict) else {}
    params = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
                     f"\n</parameter>\n" for key, value in arguments.items())
    return f"{OPEN}\n{FUNCTION}{name}>\n{params}{FUNCTION_END}\n{CLOSE}"


class XmlCallFormat(CallFormat):
    """The format's writer and forced grammar; a forced call's arguments are xgrammar's qwen_xml
    style of the function's schema (values typed as the parser reads them)."""

    arguments_style = "qwen_xml"

    def write(self, name: str, arguments: dict | str) -> str:
        return write_call(name, arguments)

    def new_parser(self, schemas: dict | None = None):
        return XmlCallParser(schemas)

    def forced_grammar(self, functions: list[tuple[str, dict]], parallel: bool,
                       max_new_tokens: int | None = None) -> str:
        tags = [{"type": "tag", "begin": f"{OPEN}\n{FUNCTION}{name}>\n", "content": arguments,
                 "end": f"\n{FUNCTION_END}\n{CLOSE}"} for name, arguments in functions]
        return forced_calls(tags, self.separator, parallel)


XML_FORMAT = XmlCallFormat(XmlCallParser, OPEN + "\n", "", "\n" + CLOSE, "\n")
