"""A chat answer's text as the APIs return it: reasoning apart, then tool calls apart from the
content. `AnswerParser` takes the text as it streams and returns events (tool_calls.py); `Answer`
gathers them into the whole message."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightllm.server.chat.tool_calls import CallArgs, CallStart, Text


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
