"""A chat answer's text as the APIs return it: reasoning apart, then tool calls apart from the
content. `AnswerParser` takes the text as it streams and returns events (tool_calls.py); `Answer`
gathers them into the whole message."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightllm.server.chat.reasoning import REASONING_PARSERS
from lightllm.server.chat.tool_calls import FORMATS, CallArgs, CallFormat, CallStart, Text


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
    """`reasoning`: a reasoning parser or None; `tools`: a tool-call parser or None."""

    def __init__(self, reasoning=None, tools=None):
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str) -> list:
        return self._split(self.reasoning.feed(text) if self.reasoning else [Text(text)] if text else [])

    def finish(self) -> list:
        events = self._split(self.reasoning.finish()) if self.reasoning else []
        return events + (self.tools.finish() if self.tools else [])

    def _split(self, texts: list[Text]) -> list:
        if self.tools is None:
            return texts
        out = []
        for text in texts:
            out += [text] if text.reasoning else self.tools.feed(text.text)
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

    def answer_parser(self, prompt_text: str, calls: bool) -> AnswerParser:
        """A parser for one answer to `prompt_text`; `calls`: tool calls are parsed out of it."""
        reasoning = self.reasoning.for_prompt(prompt_text) if self.reasoning else None
        return AnswerParser(reasoning, self.call_format.parser() if calls else None)


def chat_parsers(tool_call_parser: str | None, reasoning_parser: str | None, architecture: str | None,
                 template: str | None) -> ChatParsers:
    """The parsers the flags name; without --tool_call_parser, the format the chat template writes,
    else the model family's."""
    if tool_call_parser is None:
        template = template if isinstance(template, str) else ""
        if "<tool_call>" in template:
            tool_call_parser = "hermes"
        elif "<|python_tag|>" in template or '"parameters"' in template:
            tool_call_parser = "llama3_json"
        else:
            tool_call_parser = "llama3_json" if (architecture or "").startswith("Llama") else "hermes"
    reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
    return ChatParsers(FORMATS[tool_call_parser], reasoning)
