"""The scheduler: admission, prefill chunks and step plans. CPU bookkeeping only.

Every step runs every decoding request once plus prefill chunks of admitted requests, in
admission order, up to `chunk_budget` prompt tokens. Admission proves that the KV budget holds
whatever happens next (see `peak_token_usage`): an admitted request's whole prompt is reserved
at once, so a partly prefilled request never waits for room.
"""

from __future__ import annotations

import logging

import numpy as np

from lightllm.engine.plan import Chunk, StepPlan, StepResult
from lightllm.engine.request import Req, ReqStatus
from lightllm.server.io_struct import FinishReason, TokenOut

logger = logging.getLogger(__name__)

POLICIES = ("lpt", "fcfs")
# Under "lpt", a request that has waited this many steps is admitted before any younger one.
AGING_STEPS = 256

# A finished request's slots are freed by the plan after the step whose result shows it
# finished: up to two steps after its last scheduled decode when a step is in flight.
FREE_LAG_STEPS = 1


def peak_token_usage(tokens_held: np.ndarray, tokens_left: np.ndarray) -> int:
    """Most KV tokens a batch can ever hold if every request grows by one token a step for
    `tokens_left` more steps and then frees what it holds.

    Sort by tokens left, descending. Request i (1-based) stops after left_i more steps; at that
    moment requests 1..i still run and have each grown by left_i (at most), while i+1..n have
    freed their tokens, so usage <= cumsum(held)_i + i * left_i. Usage only ever drops when a
    request ends, so the peak is the largest of these n values.
    """
    if len(tokens_held) == 0:
        return 0
    order = np.argsort(-tokens_left, kind="stable")
    left = tokens_left[order]
    held_cumsum = np.cumsum(tokens_held[order])
    position = np.arange(1, len(left) + 1)
    return int(np.max(held_cumsum + left * position))


class Scheduler:
    def __init__(self, max_total_token_num: int, chunk_budget: int, max_running: int, policy: str = "lpt"):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.max_total_token_num = max_total_token_num
        self.chunk_budget = chunk_budget
        self.max_running = max_running
        self.policy = policy
        self.waiting: dict[int, Req] = {}  # insertion-ordered: arrival order
        self.running: list[Req] = []  # admission order: prefill chunks follow it
        self._by_id: dict[int, Req] = {}
        self._to_free: list[int] = []
        self._in_steps: dict[int, list[Req]] = {}  # step id -> its requests, until its result is in
        self._next_step = 0

    # ---- requests in and out ----

    def add(self, req: Req) -> None:
        req.arrival_step = self._next_step
        self.waiting[req.req_id] = req
        self._by_id[req.req_id] = req

    def abort(self, req_id: int) -> bool:
        """Drop a request wherever it is; True if it was known and not yet finished."""
        req = self._by_id.pop(req_id, None)
        if req is None:
            return False
        if self.waiting.pop(req_id, None) is None:
            self._end(req)
        req.status = ReqStatus.FINISHED
        return True

    def _end(self, req: Req) -> None:
        """A running request ends: its slots go back with the next plan."""
        self.running.remove(req)
        self._by_id.pop(req.req_id, None)
        req.status = ReqStatus.FINISHED
        if req.prefilled:  # the runner has seen it
            self._to_free.append(req.req_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_free)

    @property
    def tokens_used(self) -> int:
        """KV slots held once the steps scheduled so far have run (prompts count when done)."""
        return sum(req.kv_tokens for req in self.running)

    # ---- planning ----

    def schedule(self) -> StepPlan:
        self._admit()
        plan = StepPlan(self._next_step, free=self._to_free)
        self._to_free = []
        reqs = []
        for req in self.running:
            if req.needs_decode:
                req.decode_steps += 1
                plan.decodes.append(req.req_id)
                reqs.append(req)
        budget = self.chunk_budget
        for req in self.running:
            if budget == 0:
                break
            if req.status is ReqStatus.PREFILLING:
                plan.chunks.append(self._chunk(req, min(budget, req.prompt_left)))
                budget -= len(plan.chunks[-1].token_ids)
                reqs.append(req)
        if not plan.empty:
            self._in_steps[plan.step_id] = reqs
            self._next_step += 1
        return plan

    def _chunk(self, req: Req, n: int) -> Chunk:
        start = req.prefilled
        req.prefilled += n
        last = req.prefilled == req.prompt_len
        chunk = Chunk(req.req_id, req.prompt_ids[start: start + n], start, last,
                      req.sampling if start == 0 else None)
        if last:
            req.status = ReqStatus.DECODING
            req.prompt_ids = []  # the runner has them now
        return chunk

    def _admit(self) -> None:
        """Admit the longest prefix of the waiting queue whose peak KV use fits (binary search:
        adding a request never lowers the peak), so a large request is never overtaken."""
        room = self.max_running - len(self.running)
        if room <= 0 or not self.waiting:  # the common case of a full batch: no sort, no check
            return
        candidates = self._admission_order()[:room]
        held, left = self._reservations(self.running + candidates)
        lo, hi = 0, len(candidates)  # lo fits; find the largest count that fits
        base = len(self.running)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if peak_token_usage(held[: base + mid], left[: base + mid]) <= self.max_total_token_num:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0 and not self.running and candidates[0].kv_cap <= self.max_total_token_num:
            lo = 1  # alone, a request never holds more than its cap: the delay term is moot
        for req in candidates[:lo]:
            del self.waiting[req.req_id]
            req.status = ReqStatus.PREFILLING
            self.running.append(req)

    def _admission_order(self) -> list[Req]:
        """fcfs: arrival order. lpt: longest output budget first, so that long generations start
        early and a burst does not end on a few long requests at batch 1; a request that has
        waited AGING_STEPS steps goes before every younger one, in arrival order (no starvation)."""
        waiting = list(self.waiting.values())
        if self.policy == "fcfs":
            return waiting
        aged = self._next_step - AGING_STEPS
        return sorted(waiting, key=lambda r: (r.arrival_step > aged, -r.max_new_tokens if r.arrival_step > aged else 0))

    def _reservations(self, reqs: list[Req]) -> tuple[np.ndarray, np.ndarray]:
        """(held, left) per request for `peak_token_usage`, in the order given (admission order).

        A prefilling request holds its whole prompt from admission; it starts to grow once its
        last chunk has run, within ceil(prompt tokens still to prefill up to it / chunk_budget)
        steps, so its growth is counted from now with that delay added to its steps left.
        Every request holds its tokens FREE_LAG_STEPS longer than it grows."""
        held = np.empty(len(reqs), dtype=np.int64)
        left = np.empty(len(reqs), dtype=np.int64)
        queued = 0
        for i, req in enumerate(reqs):
            if req.status is ReqStatus.DECODING:
                held[i], delay = req.kv_tokens, 0
            else:
                queued += req.prompt_left
                held[i], delay = req.prompt_len, -(-queued // self.chunk_budget)
            left[i] = req.kv_cap - held[i] + delay + FREE_LAG_STEPS
        return held, left

    # ---- results ----

    def process(self, result: StepResult) -> list[TokenOut]:
        """Turn a step's tokens into outputs; end the requests that finished or failed."""
        reqs = self._in_steps.pop(result.step_id)
        if result.error is not None:
            logger.error("model step %d failed: %s", result.step_id, result.error)
            return [self._fail(req, result.error) for req in reqs if req.status is not ReqStatus.FINISHED]
        outs = []
        for token in result.tokens:
            req = self._by_id.get(token.req_id)
            if req is None:  # ended while this step ran: its extra token is never emitted
                continue
            reason = req.append(token.token_id)
            outs.append(TokenOut(req.req_id, token.token_id, token.logprob, reason))
            if reason is not None:
                self._end(req)
        return outs

    def fail_all(self, error: str) -> list[TokenOut]:
        """Every request in flight or waiting ends with an error (the engine failed)."""
        self._in_steps.clear()
        outs = [self._fail(req, error) for req in list(self.running)]
        for req in list(self.waiting.values()):
            self.abort(req.req_id)
            outs.append(TokenOut(req.req_id, -1, 0.0, FinishReason.ERROR, error=error))
        return outs

    def _fail(self, req: Req, error: str) -> TokenOut:
        self._end(req)
        return TokenOut(req.req_id, -1, 0.0, FinishReason.ERROR, error=error)
