"""A stand-in for the HTTP process's engine manager, for testing the routes without an engine."""

from __future__ import annotations

import asyncio

from lightllm.engine.request import FinishReason
from lightllm.server.io_struct import TextOut


class ScriptedEngine:
    """HttpServerManager's part that the routes use: each request's answer is `self.text`, a few
    characters per output; the prompts it was given are kept."""

    def __init__(self):
        self.text = ""
        self.prompts: list[list[int]] = []

    def check_queue(self, count: int = 1) -> None:
        pass

    def backlog(self, req_id: int) -> int:
        return 0  # each output is made when the stream asks for it: none ever waits

    async def generate(self, prompt_ids, sampling, *, bounded=True, lora_id=0, cache_salt="", priority=0):
        self.prompts.append(prompt_ids)
        pieces = [self.text[i:i + 3] for i in range(0, len(self.text), 3)] or [""]
        for n, piece in enumerate(pieces, 1):
            await asyncio.sleep(0)
            yield TextOut(0, n, piece, 0.0, False, n, FinishReason.EOS if n == len(pieces) else None)
