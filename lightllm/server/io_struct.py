"""Every message that crosses a process boundary.

HTTP process -> router:        GenerateReq, AbortReq, LoraLoad, LoraUnload, FlushCache (to every --dp replica)
router -> detokenizer:         GenerateReq (forwarded once, before its first token, without its prompt or
                               compiled grammar), BatchTokenOut,
                               AbortReq (forwarded, so that the detokenizer drops the request)
detokenizer -> HTTP process:   BatchTextOut
router -> HTTP process:        RouterStats (after the router's state changed), RouterFailed (its last word)
router -> HTTP process (shared memory): RouterHeartbeat, read by /health
router -> model workers (rpyc): StepPlan / StepResult as plain tuples (see lightllm/engine/plan.py)
children -> main process (start-up pipe): ProcessReady, RouterReady

Only these small dataclasses are pickled across a socket. GenerateReq, TokenOut (inside
BatchTokenOut), SamplingParams and FinishReason are the engine's own types, defined in
lightllm/engine/request.py: the server carries them, the engine never imports the server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lightllm.engine.request import FinishReason, TokenOut, pickled_as_columns


@dataclass
class AbortReq:
    req_id: int


@dataclass
class FlushCache:
    """Drop every prefix-cache entry that no running request holds, from every tier."""


@dataclass
class LoraLoad:
    """Serve the LoRA adapter at `path` (checked by the HTTP process) under the new id `lora_id`."""

    lora_id: int
    path: str


@dataclass
class LoraUnload:
    lora_id: int


@pickled_as_columns(TokenOut, 3)  # req_id, token_id, logprob
@dataclass
class BatchTokenOut:
    items: list[TokenOut]


@dataclass
class TextOut:
    req_id: int
    token_id: int
    text: str  # the new text this token adds (may be "" while a UTF-8 sequence is incomplete)
    logprob: float
    special: bool
    count_output_tokens: int
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Set with FinishReason.ERROR when the server stopped taking work rather than the request failing
    # (the HTTP process ends its open requests so when a drain runs out): a 503, to retry in this many seconds.
    retry_after: int | None = None
    cached_tokens: int = 0  # as TokenOut: on the first token
    queue_time: float = 0.0  # as TokenOut
    # As TokenOut, with each token's text: (token, text, logprob)
    top_logprobs: list[tuple[int, str, float]] | None = None
    prompt_logprobs: list[tuple[float, int, list[tuple[int, str, float]]]] | None = None


@pickled_as_columns(TextOut, 6)  # req_id .. count_output_tokens
@dataclass
class BatchTextOut:
    items: list[TextOut]


@dataclass
class RouterStats:
    waiting_reqs: int
    running_reqs: int
    tokens_used: int  # KV slots running requests need (their own and the cached ones they use)
    max_total_token_num: int
    prefix_cached_tokens: int = 0  # KV slots the prefix cache holds (evicted when room is needed)
    prefix_queried_tokens: int = 0  # counters since start: prompt tokens looked up in the cache
    prefix_hit_tokens: int = 0  # ... and found there
    replica: int = 0  # which engine (--dp) reports
    prompt_computed_tokens: int = 0  # counter: prompt tokens computed in steps (cache hits are not)
    prefix_host_tokens: int = 0  # tokens the prefix cache's host tier holds
    prefix_host_hit_tokens: int = 0  # counter: of prefix_hit_tokens, those loaded back from the host (or disk) tier
    prefix_disk_hit_tokens: int = 0  # counter: of those, from the disk tier
    # Speculative decoding, counters since start: verified draft runs, their drafts, the drafts
    # accepted, and per draft position how often it was accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple = ()
    num_preemptions: int = 0  # counter: running requests preempted for more urgent ones (priority policy)
    # LoRA serving: the engine ids of the adapters that running and waiting requests run under
    # (sorted, each once; the base model, 0, left out)
    lora_running: tuple = ()
    lora_waiting: tuple = ()


@dataclass
class ProcessReady:
    name: str


@dataclass
class RouterReady:
    max_total_token_num: int  # the real figure, sized by the rank-0 model runner
    model_info: dict  # ModelRunner.info: architecture, dtype, vocab_size, eos_token_ids, ...


@dataclass
class RouterFailed:
    error: str  # why the router stops (a model worker died, the engine raised): every open request ends with it


class RouterHeartbeat:
    """When the router's loop last turned, and when the step it is inside began (0: none).

    Shared memory the router writes and /health reads, so that a health check never waits on the
    loop it checks. Each value is one aligned double (no lock needed), and time.monotonic() is
    one clock for every process of the machine (CLOCK_MONOTONIC on Linux).
    """

    INTERVAL = 1.0  # seconds an idle router sleeps at most before its loop turns anyway
    TURN_TIMEOUT = 5.0  # seconds without a turn, outside a step, after which the loop counts as stuck

    def __init__(self, context):
        self._values = context.RawArray("d", 2)  # turned_at, step_started_at
        self.turned()

    def turned(self) -> None:
        self._values[0], self._values[1] = time.monotonic(), 0.0

    def step_started(self) -> None:
        self._values[1] = time.monotonic()

    def stalled(self, step_timeout: float) -> str | None:
        """Why the loop looks stuck, or None while it turns (or is inside a step shorter than `step_timeout`)."""
        now = time.monotonic()
        step_started_at = self._values[1]  # first: the router writes turned_at before clearing it
        turned_at = self._values[0]
        if step_started_at and now - step_started_at > step_timeout:
            return f"one engine step has run for {now - step_started_at:.0f} s (--step_timeout {step_timeout:g})"
        if not step_started_at and now - turned_at > self.TURN_TIMEOUT:
            return f"the router's loop has not turned for {now - turned_at:.0f} s"
        return None
