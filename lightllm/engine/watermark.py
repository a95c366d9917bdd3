"""TGI's watermark (Kirchenbauer et al., 2023, "A Watermark for Large Language Models"): before a
watermarked request's token is chosen, its logits get `delta` on a "green" share `gamma` of the
vocabulary, a share that the token before it picks. Text written so holds more green tokens than
chance; `score` counts them, and a z-score of 4 or more is a watermark with near certainty (the
paper's threshold; unwatermarked text stays near 0).

Which tokens are green after token p: those v whose counter-hash uniform (the sampler's
`random_uniform`, seed p * HASH_KEY, step 0) is below gamma. It is the same on every device and
in every batch, so text can be scored on a CPU without the server (`python -m
lightllm.tools.watermark`). TGI draws its green list with torch's random permutation seeded the
same way; the lists differ, so text from one is scored by its own scorer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightllm.kernels import random_uniform

HASH_KEY = 15485863  # TGI's (a prime): the previous token times it seeds the green list
GAMMA, DELTA = 0.5, 2.0  # TGI's defaults (its WATERMARK_GAMMA, WATERMARK_DELTA)
# rows of the [rows, vocab] uniforms made at a time: as the sampler's draw, within its memory profile
BLOCK_BYTES = 64 << 20


def green_mask(prev: torch.Tensor, vocab: int, gamma: float) -> torch.Tensor:
    """bool [R, vocab]: the tokens green after each token of `prev` (int64 [R])."""
    seeds = prev.long() * HASH_KEY
    return random_uniform(seeds, torch.zeros_like(seeds), vocab) < gamma


def _green_blocks(prev: torch.Tensor, vocab: int, gamma: float):
    """(first row, green_mask of the rows from it) over `prev` in blocks of at most BLOCK_BYTES of uniforms."""
    step = max(1, BLOCK_BYTES // (4 * vocab))
    for start in range(0, prev.shape[0], step):
        yield start, green_mask(prev[start: start + step], vocab, gamma)


def apply_watermark_(logits: torch.Tensor, rows: torch.Tensor, prev: torch.Tensor, gamma: float,
                     delta: float) -> None:
    """Add `delta` to the green tokens of logits' `rows` (each row once), `prev` their tokens before."""
    for start, green in _green_blocks(prev, logits.shape[-1], gamma):
        logits.index_add_(0, rows[start: start + green.shape[0]], green.to(logits.dtype).mul_(delta))


@dataclass
class Score:
    scored: int  # tokens scored (all but the first, which has no token before it)
    green: int
    z: float  # (green - gamma * scored) / sqrt(scored * gamma * (1 - gamma))

    @property
    def green_fraction(self) -> float:
        return self.green / self.scored if self.scored else 0.0


def score(token_ids: list[int], gamma: float = GAMMA) -> Score:
    """How many of `token_ids` (from the second) are green after the token before them. A token's
    hash does not depend on the vocabulary's size (`random_uniform` hashes each column alone), so
    the columns up to the largest id are enough."""
    ids = torch.tensor(token_ids, dtype=torch.int64)
    if ids.numel() < 2:
        return Score(0, 0, 0.0)
    prev, nxt, vocab = ids[:-1], ids[1:], int(ids.max()) + 1
    green = sum(int(mask.gather(1, nxt[start: start + mask.shape[0], None]).sum())
                for start, mask in _green_blocks(prev, vocab, gamma))
    scored = nxt.numel()
    z = (green - gamma * scored) / math.sqrt(scored * gamma * (1 - gamma))
    return Score(scored, green, z)
