"""The prefix cache: a radix tree keyed by token ids whose nodes own KV slots of the token table.

CPU bookkeeping only, run by the scheduler. The tree holds token ids; the slots themselves
stay on the device, in each model runner, under the node's id. Every change the runner must
mirror is appended to `ops` as one of the ops below (Split, Insert, Evict), in the order the
runner must apply it, so every tensor-parallel rank ends up with the same slots; the engine
carries them to the runner in its step plan (lightllm/engine/plan.py).

A node's KV depends only on the tokens from the root to it, so a node may hold slots computed
by one request under a parent computed by another. The page size is one token: any shared
prefix, to the token, can be reused.

A running request holds one reference on every node from its deepest node to the root
(`lock`); a node no request references is evictable once it is a leaf, least recently used
first. Locked tokens are never evicted; unlocked ones count as free for admission.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass


@dataclass
class Insert:
    """Positions [start, end) of a running request's row become the slots of cache node `node_id`."""

    req_id: int
    start: int
    end: int
    node_id: int


@dataclass
class Split:
    """Node `node_id` gives its first `at` slots to a new node `upper_id` (its new parent)."""

    node_id: int
    at: int
    upper_id: int


@dataclass
class Evict:
    """Node `node_id`'s slots go back to the token table."""

    node_id: int


class Node:
    __slots__ = ("node_id", "key", "parent", "children", "ref", "last_use", "depth")

    def __init__(self, node_id: int, key: list[int], parent: Node | None, last_use: int = 0):
        self.node_id = node_id
        self.key = key  # the token ids of the edge into this node
        self.parent = parent
        self.children: dict[int, Node] = {}  # first token of the child's key -> child
        self.ref = 0  # running requests whose path goes through this node
        self.last_use = last_use
        self.depth = (parent.depth if parent is not None else 0) + len(key)  # tokens root..here

    def __repr__(self) -> str:
        return f"Node({self.node_id}, len={len(self.key)}, depth={self.depth}, ref={self.ref})"


@dataclass
class Match:
    """The longest cached prefix of some tokens below a node: whole nodes down to `node`, then
    the first `partial` tokens of its child `child` (when the match ends inside it)."""

    node: Node
    child: Node | None
    partial: int
    length: int  # tokens matched below the node the search started from

    def partial_nodes(self) -> list[tuple[Node, int]]:
        """(node, tokens of it matched) from the deepest node up to the root."""
        out = [(self.child, self.partial)] if self.child is not None else []
        node = self.node
        while node.parent is not None:
            out.append((node, len(node.key)))
            node = node.parent
        return out


def common_prefix_len(key: list[int], tokens: list[int], start: int) -> int:
    n = len(key)
    if tokens[start: start + n] == key:  # the common case, compared in C
        return n
    i = 0
    end = min(n, len(tokens) - start)
    while i < end and key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, ops: list):
        self.ops = ops  # plan ops for the runner, shared with the scheduler, in order
        self.root = Node(0, [], None)
        self._ids = itertools.count(1)
        self._nodes: dict[int, Node] = {0: self.root}
        self._clock = itertools.count(1)
        self._evictable: list[tuple[int, int, Node]] = []  # (last_use, id, node), lazily pruned
        self.total_tokens = 0  # tokens held by nodes
        self.locked_tokens = 0  # tokens of nodes some running request references
        self.evicted_tokens = 0  # counter

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.locked_tokens

    # ---- lookups ----

    def match(self, tokens: list[int], node: Node | None = None) -> Match:
        """The longest prefix of `tokens` cached below `node` (the root by default)."""
        node = node or self.root
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = common_prefix_len(child.key, tokens, i)
            if n < len(child.key):
                return Match(node, child, n, i + n)
            node, i = child, i + n
        return Match(node, None, 0, i)

    def take(self, match: Match) -> Node:
        """The node that ends exactly where `match` ends (splitting the child it ends inside)."""
        if match.child is None:
            return match.node
        return self._split(match.child, match.partial)

    # ---- references ----

    def lock(self, node: Node, above: Node | None = None) -> None:
        """One more reference on `node` and its ancestors, up to (not including) `above`
        (a node the caller already holds) or the root."""
        stamp = next(self._clock)
        while node is not self.root and node is not above:
            if node.ref == 0:
                self.locked_tokens += len(node.key)
            node.ref += 1
            node.last_use = stamp
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.ref > 0, node
            node.ref -= 1
            if node.ref == 0:
                self.locked_tokens -= len(node.key)
                self._maybe_evictable(node)
            node = node.parent

    # ---- changes (each one appends the runner's op) ----

    def insert(self, node: Node, tokens: list[int], req_id: int, start: int,
               after_match: bool = True) -> tuple[int, Node | None]:
        """Cache `tokens`, whose KV request `req_id` holds at positions start.. of its row, below
        `node` (which ends at position `start`). Returns (tokens already cached, which the
        request's copy duplicates; the new node for the rest, or None). With `after_match`
        False, nothing is inserted unless nothing matched (the request's row then stays one
        cached prefix followed by its own slots)."""
        assert node.depth == start, (node, start)
        found = self.match(tokens, node)
        if found.length == len(tokens) or (found.length and not after_match):
            return found.length, None
        parent = self.take(found)
        new = Node(next(self._ids), tokens[found.length:], parent, next(self._clock))
        parent.children[new.key[0]] = new
        self._nodes[new.node_id] = new
        self.total_tokens += len(new.key)
        self.ops.append(Insert(req_id, start + found.length, start + len(tokens), new.node_id))
        self._maybe_evictable(new)
        return found.length, new

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node` after `at` tokens; the new upper part becomes its parent and is returned."""
        assert 0 < at < len(node.key), (node, at)
        parent = node.parent
        upper = Node(next(self._ids), node.key[:at], parent, node.last_use)
        upper.ref = node.ref  # both parts keep the references (and locked_tokens is unchanged)
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        self._nodes[upper.node_id] = upper
        self.ops.append(Split(node.node_id, at, upper.node_id))
        return upper

    def evict(self, tokens: int) -> int:
        """Free at least `tokens` tokens (if that many are evictable), least recently used
        leaves first; returns how many were freed."""
        freed = 0
        while freed < tokens and self._evictable:
            last_use, node_id, node = heapq.heappop(self._evictable)
            if self._nodes.get(node_id) is not node or node.ref or node.children or last_use != node.last_use:
                continue  # stale: since locked, grown, evicted or pushed again
            parent = node.parent
            del parent.children[node.key[0]]
            del self._nodes[node_id]
            self.total_tokens -= len(node.key)
            freed += len(node.key)
            self.evicted_tokens += len(node.key)
            self.ops.append(Evict(node_id))
            self._maybe_evictable(parent)
        return freed

    def _maybe_evictable(self, node: Node) -> None:
        if node is self.root or node.ref or node.children:
            return
        heapq.heappush(self._evictable, (node.last_use, node.node_id, node))
        if len(self._evictable) > 2 * len(self._nodes) + 64:  # drop stale entries now and then
            self._evictable = [e for e in self._evictable
                               if self._nodes.get(e[1]) is e[2] and not e[2].ref and not e[2].children
                               and e[0] == e[2].last_use]
            heapq.heapify(self._evictable)

    # ---- checks (tests) ----

    def check(self) -> None:
        """Assert the tree's invariants: counts, depths, child keys, references."""
        total = locked = 0
        for node in self._nodes.values():
            if node is self.root:
                continue
            assert node.key and node.parent.children[node.key[0]] is node, node
            assert node.depth == node.parent.depth + len(node.key), node
            assert all(child.ref <= node.ref for child in node.children.values()), node
            total += len(node.key)
            locked += len(node.key) if node.ref else 0
        assert (total, locked) == (self.total_tokens, self.locked_tokens), (total, locked)

    def cached_prefixes(self) -> dict[tuple[int, ...], int]:
        """Every cached token sequence (each node's path from the root) -> its node id."""
        out = {}
        for node in self._nodes.values():
            path, n = [], node
            while n is not self.root:
                path[:0] = n.key
                n = n.parent
            if node is not self.root:
                out[tuple(path)] = node.node_id
        return out
