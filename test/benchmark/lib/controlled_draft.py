"""A draft source for benchmarks only, whose acceptance is set by hand: `alpha`.

Dummy weights make any real draft's acceptance meaningless, so speculation is measured with a
draft that knows the answer. The oracle is the target's own greedy output for each prompt, from
a plain run of the same requests (JSON lines {"prompt_ids": [...], "output_ids": [...]}, written
by `write_oracle`). `propose(req_id, k)` returns the oracle's next k tokens after the tokens the
request has generated so far, each replaced by a wrong one with probability 1 - alpha. Under
greedy verification a step then accepts j leading drafts with probability alpha^j (1 - alpha)
(j < k): on average alpha (1 - alpha^k) / (1 - alpha) tokens besides the one the step decodes.

Which positions are wrong is fixed per (seed, prompt, position): a position proposed again (a
step without drafts, a retry) gets the same draft, and for one seed the wrong positions at a
lower alpha include those at a higher one. A prompt not in the oracle, a request whose output has
left the oracle's (the target's numerics changed with the batch), or one past the oracle's end
gets no drafts.

    --speculative_config '{"method": "benchmark.lib.controlled_draft:ControlledDraft",
                           "oracle": "oracle.jsonl", "alpha": 0.8, "num_speculative_tokens": 4}'

The server's router process must import it: PYTHONPATH holds the repository and its test/.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class _Track:
    """One request: its drafts by output position, how many tokens it has generated, and whether
    they are still the oracle's."""

    truth: list[int]
    drafts: list[int]
    position: int = 0
    diverged: bool = False


class ControlledDraft:
    def __init__(self, vocab_size: int, oracle: str | Path, alpha: float, seed: int = 0):
        if not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha is a probability in [0, 1], got {alpha}")
        if vocab_size < 2:
            raise ValueError("a wrong token needs a vocabulary of at least 2")
        self.alpha = float(alpha)
        self._answers = {tuple(prompt): (list(output), corrupted(output, self.alpha, vocab_size, seed, prompt))
                         for prompt, output in read_oracle(oracle)}
        self._requests: dict[int, _Track | None] = {}

    def start(self, req_id: int, prompt_ids: Sequence[int]) -> None:
        answer = self._answers.get(tuple(prompt_ids))
        self._requests[req_id] = _Track(*answer) if answer else None

    def extend(self, req_id: int, token_ids: Sequence[int]) -> None:
        track = self._requests.get(req_id)
        if track is None or track.diverged:
            return
        for token in token_ids:
            if track.position >= len(track.truth) or track.truth[track.position] != token:
                track.diverged = True
                return
            track.position += 1

    def propose(self, req_id: int, k: int) -> list[int]:
        track = self._requests.get(req_id)
        if track is None or track.diverged:
            return []
        return track.drafts[track.position: track.position + k]

    def finish(self, req_id: int) -> None:
        self._requests.pop(req_id, None)


def corrupted(truth: Sequence[int], alpha: float, vocab_size: int, seed: int, prompt: Sequence[int]) -> list[int]:
    """`truth` with each token replaced by another with probability 1 - alpha. Both draws are
    made at every position whatever alpha is, so the stream of draws is the seed's and the
    prompt's alone (str seeds go through SHA-512: the same in every process)."""
    digest = hashlib.sha256(json.dumps(list(prompt)).encode()).hexdigest()
    rng = random.Random(f"{seed}:{digest}")
    drafts = []
    for token in truth:
        keep, shift = rng.random() < alpha, 1 + rng.randrange(vocab_size - 1)
        drafts.append(token if keep else (token + shift) % vocab_size)
    return drafts


def write_oracle(path: str | Path, pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> int:
    """One JSON line per (prompt_ids, output_ids); the number written."""
    count = 0
    with open(path, "w") as out:
        for prompt_ids, output_ids in pairs:
            out.write(json.dumps({"prompt_ids": list(prompt_ids), "output_ids": list(output_ids)}) + "\n")
            count += 1
    return count


def read_oracle(path: str | Path) -> list[tuple[list[int], list[int]]]:
    lines = Path(path).read_text().splitlines()
    return [(item["prompt_ids"], item["output_ids"]) for item in map(json.loads, filter(str.strip, lines))]
