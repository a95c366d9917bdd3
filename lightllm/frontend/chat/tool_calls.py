"""Tool calls in a model's text: parsed out as they stream, written back for a history, and
forced with a grammar.

Two formats, picked with --tool_call_parser:
- hermes: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call, as
  Qwen2.5 and Qwen3 (and Hermes) write them;
- llama3_json: the whole answer is `{"name": "f", "parameters": {...}}` (calls joined by "; ",
  after an optional <|python_tag|>), as Llama 3.1 writes them.

A parser takes the text as it is generated (`feed`, then `finish`) and returns events: Text,
CallStart (the call's id and name) and CallArgs (more of its arguments, raw JSON text). An
object's arguments are streamed as the model writes them, so the deltas of one call join into
exactly the arguments of the whole answer. Whitespace next to a call is not content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass
class Text:
    text: str
    reasoning: bool = False


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    index: int
    text: str


# The head of a call object, up to its arguments' value; Llama 3.1 names them "parameters".
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could start `tag` (kept until the next delta says)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class CallObject:
    """One call written as a JSON object, fed as it grows. A scanner of strings and brackets
    finds where the arguments' value and the object end."""

    def __init__(self, index: int):
        self.index, self.id = index, new_call_id()
        self.text = ""
        self.depth, self.in_string, self.escaped = 0, False, False
        self.closed = False
        self.broken = False  # a '<' outside a string: no JSON, the text of a tag that follows
        self.back_to_one: list[int] = []  # positions just past a bracket that closed to depth 1
        self.args_start: int | None = None  # where the arguments' value begins (once the head is read)
        self.sent = 0  # characters of the arguments sent
        self.started = False

    def feed(self, text: str) -> int:
        """Take `text` up to the object's closing brace (or a '<' outside a string, which no JSON
        holds: a closing tag); returns how many characters it took."""
        taken = len(text)
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == "<":
                taken, self.broken = i, True
                break
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self.back_to_one.append(len(self.text) + i + 1)
                if self.depth <= 0:
                    taken, self.closed = i + 1, True
                    break
        self.text += text[:taken]
        return taken

    def events(self) -> list:
        """The call's start once its name is known, then whatever of its arguments is new."""
        out = []
        if not self.started:
            head = CALL_HEAD.match(self.text)
            if head is None or head.end() >= len(self.text):
                return out
            self.started, self.args_start = True, head.end()
            out.append(CallStart(self.index, self.id, json.loads(f'"{head.group(1)}"')))
        if self.text[self.args_start] in "{[":  # other values are sent whole, by finish()
            end = next((p for p in self.back_to_one if p > self.args_start), len(self.text))
            piece = self.text[self.args_start + self.sent:end]
            if piece:
                self.sent += len(piece)
                out.append(CallArgs(self.index, piece))
        return out

    def finish(self) -> list | None:
        """The rest of the call's events; None when the text is no call and nothing was sent."""
        out = self.events()
        if self.started and self.text[self.args_start] in "{[":
            return out
        whole = _loads(self.text)
        if not self.started:
            if not (isinstance(whole, dict) and isinstance(whole.get("name"), str)):
                return None
            self.started = True
            out.append(CallStart(self.index, self.id, whole["name"]))
        args = whole.get("arguments", whole.get("parameters", {})) if isinstance(whole, dict) else None
        if args is None:  # unreadable: the raw rest of the object
            text = self.text[self.args_start:].rstrip().removesuffix("}").rstrip() if self.args_start else "{}"
        else:
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.append(CallArgs(self.index, text))
        return out


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


class StreamParser:
    """A parser fed text as it streams: the text waits in `buffer` and `_step` takes what it can
    of it into `out`, returning False when the rest must wait for more text."""

    buffer: str

    def feed(self, text: str) -> list:
        self.buffer += text
        out: list = []
        while self.buffer and self._step(out):
            pass
        return out

    def _step(self, out: list) -> bool:
        raise NotImplementedError


class HermesParser(StreamParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.buffer = ""
        self.pending = ""  # whitespace after the last content, dropped if a call follows
        self.call: CallObject | None = None
        self.raw = ""  # the current block's text
        self.not_json = False  # the current block does not start with an object
        self.calls = 0

    def _step(self, out: list) -> bool:
        return self._inside(out) if self.call else self._outside(out)

    def finish(self) -> list:
        out: list = []
        if self.call is not None:
            if not (self.call.closed or self.call.broken or self.not_json):
                self._feed_call(out)
            self.raw, self.buffer = self.raw + self.buffer, ""
            self._end_call(out, closed=False)
        elif self.buffer:
            _content(self, self.buffer, out)
        if self.pending and not self.calls:
            out.append(Text(self.pending))
        self.buffer = self.pending = ""
        return out

    def _outside(self, out: list) -> bool:
        at = self.buffer.find(self.OPEN)
        if at < 0:
            keep = _held_back(self.buffer, self.OPEN)
            _content(self, self.buffer[:len(self.buffer) - keep], out)
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        _content(self, self.buffer[:at], out)
        self.buffer = self.buffer[at + len(self.OPEN):]
        self.call, self.raw, self.not_json = CallObject(self.calls), "", False
        return True

    def _inside(self, out: list) -> bool:
        """A block's object is read by its scanner (a closing tag inside a string is text); the
        block ends at the closing tag after it."""
        call = self.call
        if not (call.closed or call.broken or self.not_json):
            self._feed_call(out)
            if not (call.closed or call.broken or self.not_json):
                return False
        at = self.buffer.find(self.CLOSE)
        end = at if at >= 0 else len(self.buffer) - _held_back(self.buffer, self.CLOSE)
        self.raw, self.buffer = self.raw + self.buffer[:end], self.buffer[end:]
        if at < 0:
            return False
        self.buffer = self.buffer[len(self.CLOSE):]
        self._end_call(out, closed=True)
        return True

    def _feed_call(self, out: list) -> None:
        text, call = self.buffer, self.call
        if not call.text:
            text = text.lstrip()
            if text and text[0] != "{":
                self.not_json = True
                return
        taken = call.feed(text)
        self.raw += self.buffer[:len(self.buffer) - len(text) + taken]
        self.buffer = text[taken:]
        out += call.events()

    def _end_call(self, out: list, closed: bool) -> None:
        events = self.call.finish() if self.call.text else None
        if events is None:  # not a call: the block stays text
            _content(self, self.OPEN + self.raw + (self.CLOSE if closed else ""), out)
        else:
            out += events
            self.calls, self.pending = self.calls + 1, ""
        self.call = None


def _content(parser, text: str, out: list) -> None:
    """Content, less trailing whitespace, kept in `pending` until the next text or call says."""
    if not text:
        return
    text = parser.pending + text
    body = text.rstrip()
    parser.pending = text[len(body):]
    if body:
        out.append(Text(body))


class Llama3JsonParser(StreamParser):
    """Calls only when the answer starts with one (after whitespace and <|python_tag|>); from the
    first text that is not a call on, everything is content."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self):
        self.buffer = ""
        self.mode = "start"  # start -> calls -> text
        self.call: CallObject | None = None
        self.skipped = ""  # what came before the current call's object (whitespace, separators)
        self.calls = 0

    def finish(self) -> list:
        out: list = []
        if self.call is not None:
            self._end_call(out)
        if self.buffer and not (self.calls and self.buffer.isspace()):
            out.append(Text(self.buffer))
        self.buffer = ""
        return out

    def _step(self, out: list) -> bool:
        if self.mode == "text":
            out.append(Text(self.buffer))
            self.buffer = ""
            return False
        if self.call is not None:
            self.buffer = self.buffer[self.call.feed(self.buffer):]
            out += self.call.events()
            if not (self.call.closed or self.call.broken):
                return False
            self._end_call(out)
            return True
        rest = self.buffer.lstrip()
        if self.mode == "calls":
            rest = rest.lstrip(";").lstrip()
        elif rest.startswith(self.PYTHON_TAG):
            rest = rest[len(self.PYTHON_TAG):].lstrip()
        if not rest or (self.mode == "start" and self.PYTHON_TAG.startswith(rest)):
            return False  # only whitespace (or a partial tag) so far
        if rest[0] != "{":
            self.mode = "text"
            return True
        self.mode, self.call = "calls", CallObject(self.calls)
        self.skipped, self.buffer = self.buffer[:len(self.buffer) - len(rest)], rest
        return True

    def _end_call(self, out: list) -> None:
        events = self.call.finish()
        if events is None:  # not a call: it and all after it are text
            self.mode, self.buffer = "text", self.skipped + self.call.text + self.buffer
        else:
            out += events
            self.calls += 1
        self.call = None


@dataclass(frozen=True)
class CallFormat:
    """How one format writes a call: `begin` {"name": ..., `args_key`: {...}} `end`, calls joined by `separator`."""

    parser: type
    begin: str
    args_key: str
    end: str
    separator: str
    arguments_style = "json"  # how a forced call's arguments are written (xgrammar's JSONSchemaFormat style)
    arguments_separators = (", ", ": ")  # a forced call's JSON arguments': json.dumps' one line, as templates write

    def write(self, name: str, arguments: dict | str) -> str:
        """A call as the model writes it (for a history its chat template cannot render)."""
        call = json.dumps({"name": name, self.args_key: arguments}, ensure_ascii=False)
        return f"{self.begin}{call}{self.end}"

    @property
    def example(self) -> str:
        return self.write("NAME", {"ARGUMENT": "VALUE"})

    def new_parser(self, schemas: dict | None = None):
        """A parser of one answer; `schemas` (each function's parameters) go to formats that type by them."""
        return self.parser()

    def forced_grammar(self, functions: list[tuple[str, dict]], parallel: bool,
                       max_new_tokens: int | None = None) -> str:
        """An xgrammar structural tag (JSON text) that admits only calls of `functions` ((name, the
        arguments' structural-tag format: forced_call_grammar)), at least one, at most one unless
        `parallel`. `max_new_tokens`: the answer's budget, for a format that lets the model reason first."""
        tags = [{"type": "tag", "begin": f'{self.begin}{{"name": {json.dumps(name)}, "{self.args_key}": ',
                 "content": arguments, "end": "}" + self.end} for name, arguments in functions]
        return forced_calls(tags, self.separator, parallel)


def forced_calls(tags: list[dict], separator: str, parallel: bool) -> str:
    """The structural tag of one call's `tags`, at least one, at most one unless `parallel`."""
    return json.dumps({"type": "structural_tag", "format": calls_format(tags, separator, parallel)})


def calls_format(tags: list[dict], separator: str, parallel: bool) -> dict:
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": not parallel}

