"""Request rows: `req_to_token[row, i]` is the KV slot of the request's i-th token.

With `padding_row`, one more row (index max_reqs) is never handed out: padding rows of a
bucketed decode batch point there (see `lightllm/engine/cuda_graph.py`).
"""

from __future__ import annotations

import torch


class OutOfRowsError(RuntimeError):
    """Raised when every request row is taken."""


class ReqTable:
    def __init__(self, max_reqs: int, max_req_total_len: int, device: torch.device | str,
                 padding_row: bool = False):
        self.max_reqs = max_reqs
        self.max_req_total_len = max_req_total_len
        self.padding_row = max_reqs if padding_row else None
        rows = max_reqs + int(padding_row)
        self.req_to_token = torch.zeros((rows, max_req_total_len), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_reqs - 1, -1, -1))  # pop() hands out row 0 first
        self._used = set()

    @property
    def free_count(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise OutOfRowsError(f"all {self.max_reqs} request rows are in use")
        row = self._free_rows.pop()
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._used:
            raise ValueError(f"request row {row} is not in use")
        self._used.remove(row)
        self._free_rows.append(row)
