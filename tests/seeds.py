"""Fresh random seeds for tests that draw their inputs afresh, each printed: pytest shows a
failing test's output, so a failure names the seed that reproduces it."""

from __future__ import annotations

import os
import random


def fresh_seed(what: str = "seed") -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"{what} {seed}")
    return seed


def fresh_rng() -> random.Random:
    return random.Random(fresh_seed("random.Random seed"))
