"""Reasoning in a model's text (--reasoning_parser): Qwen3's `<think>...</think>` before the
answer, returned apart as `reasoning_content` (vLLM's field), whole or as it streams.

Qwen3 opens its answer with `<think>` when it thinks; with enable_thinking false its template
writes an empty think block into the prompt and the answer is plain. Templates of models that
always think end the prompt with `<think>` themselves: then the answer starts inside it
(`started_inside`). An answer that never opens a think block is all content.
"""

from __future__ import annotations

from lightllm.frontend.chat.harmony import HarmonyParser
from lightllm.frontend.chat.tool_calls import StreamParser, Text, _held_back


class Qwen3Reasoning(StreamParser):
    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, started_inside: bool = False):
        self.mode = "reasoning" if started_inside else "start"  # start -> reasoning -> content
        self.buffer = ""
        self.strip_leading = started_inside  # the newline Qwen3 writes after each tag is no text

    @classmethod
    def for_prompt(cls, prompt_text: str) -> Qwen3Reasoning:
        return cls(started_inside=prompt_text.rstrip().endswith(cls.OPEN))

    def finish(self) -> list[Text]:
        out = [Text(self.buffer, reasoning=self.mode == "reasoning")] if self.buffer else []
        self.buffer = ""
        return out

    def _step(self, out: list[Text]) -> bool:
        if self.strip_leading:
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return False
            self.strip_leading = False
        if self.mode == "start":
            head = self.buffer.lstrip()
            if self.OPEN.startswith(head):
                return False  # all of it may yet be the tag
            if head.startswith(self.OPEN):
                self.mode, self.buffer, self.strip_leading = "reasoning", head[len(self.OPEN):], True
            else:
                self.mode = "content"
            return True
        if self.mode == "content":
            out.append(Text(self.buffer))
            self.buffer = ""
            return False
        at = self.buffer.find(self.CLOSE)
        end = at if at >= 0 else len(self.buffer) - _held_back(self.buffer, self.CLOSE)
        # whitespace before the closing tag is no reasoning: kept until more text follows it
        piece = self.buffer[:end].rstrip()
        if piece:
            out.append(Text(piece, reasoning=True))
        if at < 0:
            self.buffer = self.buffer[len(piece):]
            return False
        self.mode, self.buffer, self.strip_leading = "content", self.buffer[at + len(self.CLOSE):], True
        return True


REASONING_PARSERS = {"qwen3": Qwen3Reasoning, "harmony": HarmonyParser}
