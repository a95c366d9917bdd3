"""Admission: which waiting requests may join the running batch. Pure CPU bookkeeping."""

from __future__ import annotations

import numpy as np

from lightllm.server.router.req import Req


def peak_token_usage(tokens_held: np.ndarray, tokens_left: np.ndarray) -> int:
    """Most KV tokens a batch can ever hold if every request runs to its max_new_tokens.

    Sort by tokens left, descending. Request i (1-based) finishes after left_i more steps; at that
    moment requests 1..i still run and have each grown by left_i, while i+1..n have finished and
    freed their tokens, so usage = cumsum(held)_i + i * left_i. Usage only ever drops when a
    request finishes, so the peak is the largest of these n values.
    """
    if len(tokens_held) == 0:
        return 0
    order = np.argsort(-tokens_left, kind="stable")
    left = tokens_left[order]
    held_cumsum = np.cumsum(tokens_held[order])
    position = np.arange(1, len(left) + 1)
    return int(np.max(held_cumsum + left * position))


class ReqQueue:
    """Waiting requests in arrival order, and the admission check for the next prefill."""

    def __init__(self, max_total_token_num: int, batch_max_tokens: int, running_max_req_size: int):
        self.max_total_token_num = max_total_token_num
        self.batch_max_tokens = batch_max_tokens
        self.running_max_req_size = running_max_req_size
        self._waiting: dict[int, Req] = {}  # insertion-ordered: FIFO

    def __len__(self) -> int:
        return len(self._waiting)

    def append(self, req: Req) -> None:
        self._waiting[req.req_id] = req

    def remove(self, req_id: int) -> Req | None:
        return self._waiting.pop(req_id, None)

    def admit(self, running: list[Req]) -> list[Req]:
        """Take waiting requests, oldest first, while the batch still fits; stop at the first that
        does not, so that a large request is never overtaken (no starvation)."""
        held = [req.tokens_held for req in running]
        left = [req.tokens_left for req in running]
        # A candidate enters the check as it will be right after its prefill step, which gives it
        # its first token while the running requests stand still; from then on all grow together.
        admitted: list[Req] = []
        prefill_tokens = 0
        for req in self._waiting.values():
            if len(running) + len(admitted) + 1 > self.running_max_req_size:
                break
            if prefill_tokens + req.prompt_len > self.batch_max_tokens:
                break
            held.append(req.prompt_len + 1)
            left.append(req.max_new_tokens - 1)
            if peak_token_usage(np.array(held), np.array(left)) > self.max_total_token_num:
                break
            admitted.append(req)
            prefill_tokens += req.prompt_len
        for req in admitted:
            del self._waiting[req.req_id]
        return admitted
