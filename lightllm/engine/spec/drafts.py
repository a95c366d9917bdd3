"""Draft sources: what proposes the tokens a request's next step verifies.

A source sees each request's tokens as they become known (`start` with the prompt, `extend` with
generated tokens, `finish` when it ends) and `propose(req_id, k)` returns up to k tokens that
would continue them. Every source here proposes point masses (one token per position, no
probabilities): verification then accepts a draft exactly when the target samples it, which is
rejection sampling against a point mass (lightllm/engine/spec/controller.py uses them; the model
runner verifies). They run in the scheduler's process, on the host, and must be cheap: O(k) a
proposal and O(1) amortized a token, whatever the request's length.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol

from lightllm.engine.spec.config import SpeculativeConfig


class DraftSource(Protocol):
    def start(self, req_id: int, prompt_ids: Sequence[int]) -> None: ...

    def extend(self, req_id: int, token_ids: Sequence[int]) -> None: ...

    def propose(self, req_id: int, k: int) -> list[int]: ...

    def finish(self, req_id: int) -> None: ...


def make_draft_source(config: SpeculativeConfig, vocab_size: int) -> DraftSource:
    if config.method == "ngram":
        return NgramDraft(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixDraft(**config.options)
    module, _, name = config.method.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(vocab_size=vocab_size, **config.options)
