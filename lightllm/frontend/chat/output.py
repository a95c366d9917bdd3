"""A chat answer's text as the APIs return it: reasoning apart, then tool calls apart from the
content. `AnswerParser` takes the text as it streams and returns events (tool_calls.py); `Answer`
gathers them into the whole message."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightllm.frontend.chat.harmony import HARMONY_FORMAT, HarmonyParser
from lightllm.frontend.chat.reasoning import REASONING_PARSERS
from lightllm.frontend.chat.tool_calls import CallArgs, CallFormat, CallStart, HermesParser, Llama3JsonParser, Text
from lightllm.frontend.chat.xml_calls import XML_FORMAT

FORMATS = {
    "hermes": CallFormat(HermesParser, "<tool_call>\n", "arguments", "\n</tool_call>", "\n"),
    "llama3_json": CallFormat(Llama3JsonParser, "", "parameters", "", "; "),
    "qwen3_xml": XML_FORMAT,
    "harmony": HARMONY_FORMAT,  # gpt-oss's, with its reasoning parser (not a --tool_call_parser choice)
}


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Answer:
    content: str = ""
    reasoning: str = ""
    calls: list[Call] = field(default_factory=list)

    def add(self, events: list) -> None:
        for event in events:
            if isinstance(event, Text):
                if event.reasoning:
                    self.reasoning += event.text
                else:
                    self.content += event.text
            elif isinstance(event, CallStart):
                self.calls.append(Call(event.id, event.name))
            else:
                self.calls[event.index].arguments += event.text


class AnswerParser:
    """`reasoning`: a reasoning parser or None; `tools`: a tool-call parser, or None where the answer
    has no calls (tool_choice none): then a call the reasoning parser reads (harmony's message to a
    function) is dropped, as it is addressed to the function and not the user."""

    def __init__(self, reasoning=None, tools=None):
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str) -> list:
        return self._split(self.reasoning.feed(text) if self.reasoning else [Text(text)] if text else [])

    def finish(self) -> list:
        events = self._split(self.reasoning.finish()) if self.reasoning else []
        return events + (self.tools.finish() if self.tools else [])

    def _split(self, texts: list) -> list:
        if self.tools is None:
            return [text for text in texts if isinstance(text, Text)]
        out = []
        for text in texts:  # a reasoning parser's calls (harmony's) pass as they are
            out += [text] if not isinstance(text, Text) or text.reasoning else self.tools.feed(text.text)
        return out

    def parse(self, text: str) -> Answer:
        answer = Answer()
        answer.add(self.feed(text) + self.finish())
        return answer


def merge_events(events: list) -> list:
    """Neighbouring events of one kind as one (one delta per output token)."""
    merged: list = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, Text) and isinstance(last, Text) and last.reasoning == event.reasoning:
            merged[-1] = Text(last.text + event.text, event.reasoning)
        elif isinstance(event, CallArgs) and isinstance(last, CallArgs) and last.index == event.index:
            merged[-1] = CallArgs(event.index, last.text + event.text)
        else:
            merged.append(event)
    return merged


@dataclass(frozen=True)
class ChatParsers:
    """The server's tool-call format and reasoning parser (None: reasoning stays in the text)."""

    call_format: CallFormat
    reasoning: type | None = None
    tool_call_parser: str = ""  # the call format's name, for /info

    @property
    def keeps_special_tokens(self) -> bool:
        """The answer's text must keep its special tokens: the reasoning parser reads them (harmony)."""
        return self.reasoning is HarmonyParser

    def prompt_tools(self, tools: list, choice: str) -> list:
        """The tools the prompt lists: under tool_choice none, none to a model that answers in harmony
        (its developer message offers each tool as callable, and gpt-oss calls one whatever the
        request says; the call would be dropped, leaving an empty answer), else all of them."""
        return [] if choice == "none" and self.reasoning is HarmonyParser else tools

    def answer_parser(self, prompt_text: str, calls: bool, functions: list | None = None) -> AnswerParser:
        """A parser for one answer to `prompt_text`; `calls`: tool calls are parsed out of it;
        `functions`: the request's (name, parameters) definitions, which type a call's values."""
        reasoning = self.reasoning.for_prompt(prompt_text) if self.reasoning else None
        schemas = {f.name: f.parameters for f in functions or ()}
        return AnswerParser(reasoning, self.call_format.new_parser(schemas) if calls else None)


def chat_parsers(tool_call_parser: str | None, reasoning_parser: str | None, architecture: str | None,
                 template: str | None) -> ChatParsers:
    """The parsers the flags name; without --tool_call_parser, harmony's calls with harmony's
    channels, else the format the chat template writes, else the model family's."""
    if reasoning_parser is None and architecture == "GptOssForCausalLM":
        reasoning_parser = "harmony"  # gpt-oss always answers in harmony's channels
    if reasoning_parser is None and (architecture or "").startswith("Qwen3_5"):
        reasoning_parser = "qwen3"  # its template opens <think> in the prompt: no text of it is an answer
    if tool_call_parser is None:
        tool_call_parser = "harmony" if reasoning_parser == "harmony" else default_call_format(architecture, template)
    reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
    return ChatParsers(FORMATS[tool_call_parser], reasoning, tool_call_parser)


def default_call_format(architecture: str | None, template: str | None) -> str:
    """The format the chat template writes, else the model family's."""
    template = template if isinstance(template, str) else ""
    if "<function=" in template:
        return "qwen3_xml"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    architecture = architecture or ""
    return "llama3_json" if architecture.startswith("Llama") else "qwen3_xml" if architecture.startswith("Qwen3_5") \
        else "hermes"


@dataclass
class Block:
    """One part of an answer as /v1/responses (an output item) and /v1/messages (a content block)
    return it: "text", "reasoning" or "call" (`text` holds its arguments); `position`: its index."""

    kind: str
    position: int
    text: str = ""
    call_id: str = ""
    name: str = ""


class Blocks:
    """Events -> blocks, one open at a time: ("start", block), ("delta", block, text), ("stop", block)."""

    def __init__(self):
        self.blocks: list[Block] = []
        self.open: Block | None = None

    def feed(self, events: list) -> list[tuple]:
        out: list[tuple] = []
        for event in events:
            if isinstance(event, Text):
                kind = "reasoning" if event.reasoning else "text"
                if self.open is None or self.open.kind != kind:
                    self._start(Block(kind, len(self.blocks)), out)
                self._delta(event.text, out)
            elif isinstance(event, CallStart):
                self._start(Block("call", len(self.blocks), call_id=event.id, name=event.name), out)
            else:  # a call's arguments follow its start, before any other event
                self._delta(event.text, out)
        return out

    def close(self) -> list[tuple]:
        out = [("stop", self.open)] if self.open is not None else []
        self.open = None
        return out

    def _start(self, block: Block, out: list) -> None:
        out += self.close()
        self.blocks.append(block)
        self.open = block
        out.append(("start", block))

    def _delta(self, text: str, out: list) -> None:
        self.open.text += text
        out.append(("delta", self.open, text))


def answer_blocks(parser: AnswerParser, text: str) -> list[Block]:
    """A whole answer's blocks: the same as its stream's."""
    blocks = Blocks()
    blocks.feed(parser.feed(text) + parser.finish())
    return blocks.blocks
