"""A request as the router sees it: counters, a status, and its stop criteria."""

from __future__ import annotations

import enum

from lightllm.server.io_struct import FinishReason, GenerateReq, SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"  # prefilled: holds KV slots in the model runner
    FINISHED = "finished"


class Req:
    def __init__(self, msg: GenerateReq, eos_token_ids: frozenset[int]):
        self.req_id = msg.req_id
        self.prompt_ids = msg.prompt_ids
        self.sampling: SamplingParams = msg.sampling
        self.arrival_time = msg.arrival_time
        self.prompt_len = len(msg.prompt_ids)
        self.max_new_tokens = msg.sampling.max_new_tokens
        self.output_count = 0
        self.status = ReqStatus.WAITING
        self._eos_token_ids = frozenset() if msg.sampling.ignore_eos else eos_token_ids

    @property
    def tokens_held(self) -> int:
        """KV tokens this request may hold now (an upper bound: the last token's KV comes later)."""
        return self.prompt_len + self.output_count

    @property
    def tokens_left(self) -> int:
        """Tokens it may still add before max_new_tokens ends it."""
        return self.max_new_tokens - self.output_count

    def append(self, token_id: int) -> FinishReason | None:
        """Count one generated token; return why the request ends, if it does."""
        assert self.status is ReqStatus.RUNNING, self.status
        self.output_count += 1
        if token_id in self._eos_token_ids:
            return FinishReason.EOS
        if self.output_count >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Req({self.req_id}, prompt={self.prompt_len}, out={self.output_count}/{self.max_new_tokens}, "
            f"{self.status.value})"
        )
