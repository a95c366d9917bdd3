"""gpt-oss's harmony format in a model's text (--reasoning_parser harmony, the default for gpt-oss):
each message of the answer is a header, `<|message|>`, its text and an end token:

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

(the recipient may also stand before the channel: `<|start|>assistant to=functions.NAME<|channel|>...`).
The analysis channel is reasoning (`reasoning_content`), a message to `functions.NAME` a tool call
whose arguments are its text, anything else (final, a commentary preamble) content. The prompt
ends with `<|start|>assistant` (the chat template's), so the answer starts at its first header.
The tags are special tokens: the chat routes keep them in the text for this parser
(`ChatParsers.keeps_special_tokens`), which takes them out. Text that never opens a header is
content, as a model that does not write harmony writes it.

A forced call (tool_choice required or a function's name) is held to harmony's own layout by
`HarmonyCallFormat.forced_grammar`: an optional analysis message, then the calls, their arguments
compact JSON (no whitespace between tokens, gpt-oss's own layout). Its tags are
matched as text, which xgrammar matches both with the tags' special tokens (gpt-oss's tokenizer,
where <|call|> is also a stop token) and with a tokenizer that spells them out.
"""

from __future__ import annotations

import json
import re

from lightllm.frontend.chat.tool_calls import (CallArgs, CallFormat, CallStart, StreamParser, Text, _held_back,
                                             calls_format, new_call_id)

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
HEADER_START = ("<|start|>", "<|channel|>")
RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
NEXT_MESSAGE = "<|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>"
CALL_END = "<|call|>"
# A forced call's reasoning takes at most this many tokens, and at most half of the answer's
# max_new_tokens, so that the call always has room; tags that would end it early are kept out of it.
REASONING_MAX_TOKENS = 1024
REASONING_EXCLUDES = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|return|>"]


class HarmonyParser(StreamParser):
    def __init__(self):
        self.mode = "start"  # start -> header -> message -> header ...; or content (no harmony at all)
        self.buffer = ""
        self.kind = "content"  # the current message's: reasoning, content or call
        self.calls = 0

    @classmethod
    def for_prompt(cls, prompt_text: str) -> HarmonyParser:
        return cls()

    def finish(self) -> list:
        """The rest: an unfinished message's text as its kind; an unfinished header is dropped."""
        out: list = []
        if self.mode in ("message", "content") and self.buffer:
            self._emit(self.buffer, out)
        elif self.mode == "start" and self.buffer:
            out.append(Text(self.buffer))
        self.buffer = ""
        return out

    def _step(self, out: list) -> bool:
        if self.mode == "start":
            head = self.buffer.lstrip()
            if any(tag.startswith(head) for tag in HEADER_START):
                return False  # all of it may yet be a header's first tag
            self.mode = "header" if head.startswith(HEADER_START) else "content"
            return True
        if self.mode == "content":
            out.append(Text(self.buffer))
            self.buffer = ""
            return False
        if self.mode == "header":
            return self._header(out)
        return self._message(out)

    def _header(self, out: list) -> bool:
        at = self.buffer.find(MESSAGE)
        if at < 0:
            return False
        header, self.buffer = self.buffer[:at], self.buffer[at + len(MESSAGE):]
        recipient, channel = RECIPIENT.search(header), CHANNEL.search(header)
        if recipient:
            self.kind = "call"
            out.append(CallStart(self.calls, new_call_id(), recipient.group(1)))
        else:
            self.kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        self.mode = "message"
        return True

    def _message(self, out: list) -> bool:
        ends = [(self.buffer.find(tag), tag) for tag in ENDS if tag in self.buffer]
        if not ends:
            keep = max(_held_back(self.buffer, tag) for tag in ENDS)
            self._emit(self.buffer[:len(self.buffer) - keep], out)
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        at, tag = min(ends)
        self._emit(self.buffer[:at], out)
        if self.kind == "call":
            self.calls += 1
        self.buffer, self.mode = self.buffer[at + len(tag):], "header"
        return True

    def _emit(self, text: str, out: list) -> None:
        if not text:
            return
        if self.kind == "call":
            out.append(CallArgs(self.calls, text))
        else:
            out.append(Text(text, reasoning=self.kind == "reasoning"))


def call_header(name: str) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"


class HarmonyCallFormat(CallFormat):
    """gpt-oss's calls, written and forced in harmony. With the harmony reasoning parser the calls
    come out of it (the channels hold them); the call parser over the content it leaves (final and
    preamble text, no headers) passes that on as it is. Arguments are compact JSON, as gpt-oss
    writes them (harmony's own examples: `{"location":"Tokyo"}`)."""

    arguments_separators = (",", ":")

    def write(self, name: str, arguments: dict | str) -> str:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False,
                                                                         separators=self.arguments_separators)
        return f"{call_header(name)}{text}{CALL_END}"

    def new_parser(self, schemas: dict | None = None):
        return HarmonyParser()

    def forced_grammar(self, functions: list[tuple[str, dict]], parallel: bool,
                       max_new_tokens: int | None = None) -> str:
        """After the prompt's `<|start|>assistant`: an analysis message or none, then the calls,
        each its own message; the analysis as long as `max_new_tokens` leaves room for (module doc)."""
        tags = [{"type": "tag", "begin": call_header(name), "content": arguments, "end": CALL_END}
                for name, arguments in functions]
        calls = calls_format(tags, NEXT_MESSAGE, parallel)
        budget = REASONING_MAX_TOKENS if max_new_tokens is None else min(REASONING_MAX_TOKENS, max_new_tokens // 2)
        if budget <= 0:
            return json.dumps({"type": "structural_tag", "format": calls})
        reasoning = {"type": "tag", "begin": ANALYSIS, "end": "<|end|>" + NEXT_MESSAGE,
                     "content": {"type": "any_text", "max_tokens": budget, "excludes": REASONING_EXCLUDES}}
        both = {"type": "sequence", "elements": [{"type": "optional", "content": reasoning}, calls]}
        return json.dumps({"type": "structural_tag", "format": both})


HARMONY_FORMAT = HarmonyCallFormat(HarmonyParser, call_header("NAME"), "", CALL_END, NEXT_MESSAGE)
