"""Which --dp replica a request goes to.

`prefix` (the default): the front end keeps, per replica, an approximate index of the prompts it
sent there: the hashes of each prompt's blocks of BLOCK_TOKENS tokens, each chained to the one
before, so a block's hash names the whole prefix up to it. A request goes to the replica whose
index holds the longest run of its leading blocks (most of its prefix cached there), unless that
replica is much busier than the least loaded one (`BALANCE_RATIO`, `BALANCE_SLACK`); with no
prefix anywhere, to the least loaded. Each index forgets its least recently routed blocks beyond
what the replica can cache (its KV budget and host tier), as the replica's cache does; it never
hears of the replica's own evictions, hence approximate: a wrong guess costs a prefill, never
an error.

`least_loaded`: the replica whose open requests may take the smallest share of its KV budget
(ties in turn, so that requests one at a time spread too).
`round_robin`: in turn.

Load is the KV tokens a replica's open requests may take (prompt + max_new_tokens) over its
budget, known here at once (the routers' reports lag).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

POLICIES = ("prefix", "least_loaded", "round_robin")
BLOCK_TOKENS = 16  # a prefix shorter than this is not worth routing for
# The prefix replica is taken while its load is at most BALANCE_RATIO x the least loaded's plus
# BALANCE_SLACK (of a budget). A returning conversation's saved prefill is worth a little queueing:
# a replica may run 1.25x the other's load and then gets only new conversations' blocks' worth of
# work until the other catches up, which keeps the busier of two replicas under 1.5x the other's
# load over a run; the slack keeps near-idle replicas (a few requests each) from flipping on one.
BALANCE_RATIO = 1.25
BALANCE_SLACK = 0.05


def block_hashes(prompt_ids: list[int], block: int = BLOCK_TOKENS) -> list[int]:
    """The chained hash of every whole block of the prompt: the i-th names tokens [0, (i+1) * block)."""
    out, h = [], 0
    for start in range(0, len(prompt_ids) - block + 1, block):
        h = hash((h, tuple(prompt_ids[start: start + block])))
        out.append(h)
    return out


class PrefixIndex:
    """One replica's blocks, least recently routed first."""

    def __init__(self):
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: list[int]) -> int:
        """Leading blocks held."""
        n = 0
        while n < len(hashes) and hashes[n] in self._blocks:
            n += 1
        return n

    def add(self, hashes: list[int], capacity_blocks: int) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > capacity_blocks:
            self._blocks.popitem(last=False)


class ReplicaRouter:
    def __init__(self, replicas: int, policy: str = "prefix"):
        if policy not in POLICIES:
            raise ValueError(f"unknown --dp_routing {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self._indexes = [PrefixIndex() for _ in range(replicas)]
        self._turn = itertools.count()

    def pick(self, prompt_ids: list[int], loads: list[float], capacities: list[int]) -> int:
        """The replica for a prompt, given each replica's load (share of its budget) and the
        tokens its cache can hold."""
        n = len(loads)
        if n == 1:
            return 0
        turn = next(self._turn) % n
        if self.policy == "round_robin":
            return turn
        least = min(range(n), key=lambda d: (loads[d], (d - turn) % n))  # ties in turn: idle replicas share new work
        if self.policy == "least_loaded":
            return least
        hashes = block_hashes(prompt_ids)
        held = [index.match(hashes) for index in self._indexes]
        best = max(range(n), key=lambda d: (held[d], -loads[d], -d))
        chosen = best if held[best] and loads[best] <= BALANCE_RATIO * loads[least] + BALANCE_SLACK else least
        self._indexes[chosen].add(hashes, max(1, capacities[chosen] // BLOCK_TOKENS))
        return chosen
