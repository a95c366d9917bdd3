"""A request as the engine core sees it: counters, a status, and its stop criteria.

Counts are of what has been *scheduled*, not what has come back: with one step in flight the
scheduler learns a step's tokens one step later, and the KV budget must cover what runs.
"""

from __future__ import annotations

import enum

from lightllm.server.io_struct import FinishReason, GenerateReq, SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # admitted: its whole prompt is reserved, chunks still to run
    DECODING = "decoding"  # its last chunk is scheduled; one decode a step from now on
    FINISHED = "finished"


class Req:
    def __init__(self, msg: GenerateReq, eos_token_ids: frozenset[int]):
        self.req_id = msg.req_id
        self.prompt_ids = msg.prompt_ids
        self.sampling: SamplingParams = msg.sampling
        self.arrival_time = msg.arrival_time
        self.prompt_len = len(msg.prompt_ids)
        self.max_new_tokens = msg.sampling.max_new_tokens
        self.prefilled = 0  # prompt tokens scheduled (or taken from the prefix cache)
        self.cached = 0  # prompt tokens taken from the prefix cache (final at its first chunk)
        self.started = False  # its first chunk is scheduled: the runner holds a row for it
        # The deepest prefix-cache node it holds a reference on: positions [0, node.depth) of its
        # KV are the cache's slots, the rest its own. None without the cache (or nothing cached).
        self.node = None
        self.grows_cache = True  # each chunk goes into the cache; off once one duplicated cached tokens
        self.output_ids: list[int] = []  # tokens received back
        self.decode_steps = 0  # decode steps scheduled; each writes one KV token
        self.arrival_step = 0  # the scheduler's step count when it arrived
        self.status = ReqStatus.WAITING
        self.queue_time = 0.0  # seconds from arrival until its first chunk was scheduled
        # Prompt logprobs need every position's logits: such a request computes its whole prompt.
        self.uses_cache = msg.sampling.prompt_logprobs is None
        self._eos_token_ids = frozenset() if msg.sampling.ignore_eos else eos_token_ids
        self._stop_token_ids = frozenset(msg.sampling.stop_token_ids)

    @property
    def kv_tokens(self) -> int:
        """KV slots this request holds once every step scheduled so far has run."""
        return self.prefilled + self.decode_steps

    @property
    def output_count(self) -> int:
        return len(self.output_ids)

    @property
    def shared(self) -> int:
        """Positions of its KV held by prefix-cache nodes (not its own)."""
        return 0 if self.node is None else self.node.depth

    @property
    def kv_cap(self) -> int:
        """Most KV slots it can ever hold: its last token is sampled, never fed back."""
        return self.prompt_len + self.max_new_tokens - 1

    @property
    def prompt_left(self) -> int:
        return self.prompt_len - self.prefilled

    @property
    def needs_decode(self) -> bool:
        """Decoding, and the steps scheduled so far do not yet sample max_new_tokens tokens.
        A request that hit EOS in the step in flight still gets one more (never emitted)."""
        return self.status is ReqStatus.DECODING and 1 + self.decode_steps < self.max_new_tokens

    def append(self, token_id: int) -> FinishReason | None:
        """Count one generated token; return why the request ends, if it does."""
        assert self.status in (ReqStatus.PREFILLING, ReqStatus.DECODING), self.status
        self.output_ids.append(token_id)
        if token_id in self._eos_token_ids:
            return FinishReason.EOS
        if token_id in self._stop_token_ids:
            return FinishReason.STOP
        if self.output_count >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Req({self.req_id}, prompt={self.prefilled}/{self.prompt_len}, "
                f"out={self.output_count}/{self.max_new_tokens}, {self.status.value})")
