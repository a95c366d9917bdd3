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

With a host tier (`host_capacity` tokens > 0) an evicted node's KV is copied to the host pool
(Offload) and the node stays in the tree, host-resident; a node is evictable from the device
once none of its children is on the device, so the host-resident nodes of any path are its
tail. Host-resident leaves are dropped (Evict) least recently used first when the pool needs
room. A match runs through both tiers; the scheduler locks the matched path and loads its
host-resident nodes back (Load) before the request's first chunk.

A disk tier (`disk_capacity` > 0) lies below: a node leaving the host pool once none of its
children is in it is copied to disk (Spill) instead of dropped; disk-resident leaves are
dropped least recently used first. `host` means "not on the device" for both lower tiers, and
`disk` which of them, so the disk-resident nodes of a path are the tail of its host ones.

For a model with recurrent state (linear-attention layers) KV alone cannot resume a prompt: the
tree keeps snapshots of the state (`snapshot_slots` slots of a pool in each runner) on some nodes,
each the state after the tokens root..node, and a match is cut back to the deepest node with one
(`resumable`). A snapshot is taken from a running request whose tokens end at the node (Snapshot
op); it goes with its node (evicted, offloaded or dropped), and when no slot is free the least
recently used snapshot no running request references gives its slot up. Snapshots stay on the
device: an offloaded node drops its snapshot (the KV tiers hold KV only).
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


@dataclass
class Offload:
    """Node `node_id`'s KV is copied to the host pool; its slots go back to the token table."""

    node_id: int


@dataclass
class Spill:
    """Host-resident node `node_id`'s KV moves from the host pool to the disk pool."""

    node_id: int


@dataclass
class Snapshot:
    """Running request `req_id`'s recurrent state (its row's slot of the state pool) is copied to
    snapshot slot `slot`: the state after its tokens so far, which end where the slot's node ends."""

    req_id: int
    slot: int


@dataclass
class Load:
    """Host-resident node `node_id` takes slots of the token table, its KV copied back from the
    host (or disk) pool, whose room is freed."""

    node_id: int


class Node:
    __slots__ = ("node_id", "key", "parent", "children", "ref", "last_use", "depth", "host", "disk", "snapshot")

    def __init__(self, node_id: int, key: list[int], parent: Node | None, last_use: int = 0):
        self.node_id = node_id
        self.key = key  # the token ids of the edge into this node
        self.parent = parent
        self.children: dict[int, Node] = {}  # first token of the child's key -> child
        self.ref = 0  # running requests whose path goes through this node
        self.last_use = last_use
        self.depth = (parent.depth if parent is not None else 0) + len(key)  # tokens root..here
        self.host = False  # its KV is in the host (or disk) pool, not in the token table
        self.disk = False  # ... in the disk pool
        self.snapshot = -1  # slot of the recurrent state after its tokens (models with one), or -1

    def in_host_pool(self) -> bool:
        return self.host and not self.disk

    def on_device_children(self) -> bool:
        return any(not child.host for child in self.children.values())

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
    def __init__(self, ops: list, host_capacity: int = 0, disk_capacity: int = 0, snapshot_slots: int = 0):
        self.ops = ops  # plan ops for the runner, shared with the scheduler, in order
        self.root = Node(0, [], None)
        self._ids = itertools.count(1)
        self._nodes: dict[int, Node] = {0: self.root}
        self._clock = itertools.count(1)
        self._evictable: list[tuple[int, int, Node]] = []  # (last_use, id, node), lazily pruned
        self.total_tokens = 0  # tokens held by nodes on the device
        self.locked_tokens = 0  # tokens of nodes some running request references
        self.evicted_tokens = 0  # counter: tokens evicted from the device (offloaded or dropped)
        self.host_capacity = host_capacity  # tokens the host pool holds
        self.host_tokens = 0  # tokens of host-resident nodes
        self._host_evictable: list[tuple[int, int, Node]] = []  # host-resident leaves, lazily pruned
        self.loaded_tokens = 0  # counter: tokens loaded back from the host pool
        self.disk_capacity = disk_capacity  # tokens the disk pool holds
        self.disk_tokens = 0  # tokens of disk-resident nodes (not in host_tokens)
        self._disk_evictable: list[tuple[int, int, Node]] = []  # disk-resident leaves, lazily pruned
        self.loaded_disk_tokens = 0  # counter: of loaded_tokens, those read from the disk pool
        self.snapshot_slots = snapshot_slots  # > 0: the model has recurrent state (matches need a snapshot)
        self._free_snapshots = list(range(snapshot_slots))[::-1]
        self._snapshot_nodes: dict[int, Node] = {}  # slot -> the node whose snapshot it holds

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

    def resumable(self, found: Match, above: Node) -> Match:
        """`found` (a match below `above`) as far as a request can resume it: with snapshots, cut
        back to the deepest node of it that holds one (or to `above`, nothing matched)."""
        if not self.snapshot_slots:
            return found
        node = found.node
        while node is not above and node.snapshot < 0:
            node = node.parent
        return Match(node, None, 0, node.depth - above.depth)

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
            if node.ref == 0 and not node.host:
                self.locked_tokens += len(node.key)
            node.ref += 1
            node.last_use = stamp
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.ref > 0, node
            node.ref -= 1
            if node.ref == 0:
                self.locked_tokens -= 0 if node.host else len(node.key)
                self._maybe_evictable(node)
            node = node.parent

    # ---- changes (each one appends the runner's op) ----

    def insert(self, node: Node, tokens: list[int], req_id: int, start: int) -> tuple[int, Node | None]:
        """Cache `tokens`, whose KV request `req_id` holds at positions start.. of its row, below
        `node` (which ends at position `start`). Returns (tokens already cached, which the
        request's copy duplicates; the new node for the rest, or None)."""
        assert node.depth == start, (node, start)
        found = self.match(tokens, node)
        top = self._top_host(found, node)
        if top is not None:
            # The request's own copy covers a host-resident node: drop it (and its subtree) rather
            # than keep two copies; rare, since a request's match loads what it reaches.
            self._remove(top)
            self._maybe_evictable(top.parent)
            found = self.match(tokens, node)
        if found.length == len(tokens):
            return found.length, None
        parent = self.take(found)
        new = Node(next(self._ids), tokens[found.length:], parent, next(self._clock))
        parent.children[new.key[0]] = new
        self._nodes[new.node_id] = new
        self.total_tokens += len(new.key)
        self.ops.append(Insert(req_id, start + found.length, start + len(tokens), new.node_id))
        self._maybe_evictable(new)
        return found.length, new

    @property
    def free_snapshots(self) -> int:
        return len(self._free_snapshots)

    def snapshot(self, node: Node, req_id: int, evict: bool = True) -> bool:
        """Keep running request `req_id`'s state, whose tokens end where `node` ends, as `node`'s
        snapshot; False where it has one already or no slot can be had (with `evict` False, only
        a free one: the least recently used idle snapshot keeps its slot)."""
        if node.snapshot >= 0 or not self.snapshot_slots:
            return False
        if not self._free_snapshots:
            if not evict:
                return False
            idle = [n for n in self._snapshot_nodes.values() if not n.ref]
            if not idle:
                return False
            self._drop_snapshot(min(idle, key=lambda n: (n.last_use, n.node_id)))
        node.snapshot = self._free_snapshots.pop()
        self._snapshot_nodes[node.snapshot] = node
        self.ops.append(Snapshot(req_id, node.snapshot))
        return True

    def _drop_snapshot(self, node: Node) -> None:
        """Its slot is free again (no op: the runner's slot is simply overwritten by a later Snapshot)."""
        if node.snapshot >= 0:
            del self._snapshot_nodes[node.snapshot]
            self._free_snapshots.append(node.snapshot)
            node.snapshot = -1

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node` after `at` tokens; the new upper part becomes its parent and is returned."""
        assert 0 < at < len(node.key), (node, at)
        parent = node.parent
        upper = Node(next(self._ids), node.key[:at], parent, node.last_use)
        upper.host, upper.disk = node.host, node.disk
        upper.ref = node.ref  # both parts keep the references (and locked_tokens is unchanged)
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        self._nodes[upper.node_id] = upper
        self.ops.append(Split(node.node_id, at, upper.node_id))
        return upper

    def evict(self, tokens: int, offload: bool = True) -> int:
        """Free at least `tokens` device tokens (if that many are evictable), least recently used
        first; each node goes to the host pool when `offload` and it fits there (after dropping
        the pool's least recently used leaves), else it is dropped. Returns how many were freed."""
        freed = 0
        while freed < tokens and self._evictable:
            last_use, node_id, node = heapq.heappop(self._evictable)
            if self._nodes.get(node_id) is not node or not self._device_evictable(node) or last_use != node.last_use:
                continue  # stale: since locked, grown, evicted or pushed again
            freed += len(node.key)
            self.evicted_tokens += len(node.key)
            if offload and self._host_room(len(node.key)):
                node.host = True
                self._drop_snapshot(node)
                self.total_tokens -= len(node.key)
                self.host_tokens += len(node.key)
                self.ops.append(Offload(node_id))
                self._maybe_evictable(node)
            else:
                self._remove(node)
            self._maybe_evictable(node.parent)
        return freed

    def flush(self) -> int:
        """Drop every node no running request references, from every tier; device tokens freed."""
        freed = self.evict(self.total_tokens, offload=False)
        for node in [n for n in self._nodes.values() if n.host and not n.parent.host and not n.ref]:
            self._remove(node)
        return freed

    def host_path(self, node: Node) -> list[Node]:
        """The host-resident nodes from the root to `node` (the path's tail), root side first."""
        out = []
        while node.host:
            out.append(node)
            node = node.parent
        return out[::-1]

    def load(self, node: Node) -> None:
        """A locked host-resident node moves back to the device (its parent is there already)."""
        assert node.host and node.ref and not node.parent.host, node
        n = len(node.key)
        if node.disk:
            self.disk_tokens -= n
            self.loaded_disk_tokens += n
        else:
            self.host_tokens -= n
        node.host = node.disk = False
        self.total_tokens += n
        self.locked_tokens += n
        self.loaded_tokens += n
        self.ops.append(Load(node.node_id))

    def _host_room(self, tokens: int) -> bool:
        """Drop host-resident leaves, least recently used first, until `tokens` fit in the pool."""
        if tokens > self.host_capacity:
            return False
        self._drop_host(self.host_capacity - tokens)
        return self.host_tokens + tokens <= self.host_capacity

    def _drop_host(self, keep: int) -> None:
        """Move nodes out of the host pool, least recently used first, until at most `keep` tokens
        stay: to the disk pool where they fit (after dropping its least recently used leaves),
        else dropped."""
        while self.host_tokens > keep and self._host_evictable:
            last_use, node_id, node = heapq.heappop(self._host_evictable)
            if self._nodes.get(node_id) is not node or not self._host_evictable_now(node) or last_use != node.last_use:
                continue
            if self._disk_room(len(node.key)):
                node.disk = True
                self.host_tokens -= len(node.key)
                self.disk_tokens += len(node.key)
                self.ops.append(Spill(node_id))
                self._maybe_evictable(node)
            else:
                self._remove(node)
            self._maybe_evictable(node.parent)

    def _disk_room(self, tokens: int) -> bool:
        if tokens > self.disk_capacity:
            return False
        while self.disk_tokens + tokens > self.disk_capacity and self._disk_evictable:
            last_use, node_id, node = heapq.heappop(self._disk_evictable)
            if self._nodes.get(node_id) is not node or not self._disk_evictable_now(node) or last_use != node.last_use:
                continue
            self._remove(node)
            self._maybe_evictable(node.parent)
        return self.disk_tokens + tokens <= self.disk_capacity

    def _remove(self, node: Node) -> None:
        """Take `node` and its subtree out of the tree (below an evictable node: host-resident
        only), deepest first (a long chat's history is a deep chain: no recursion)."""
        del node.parent.children[node.key[0]]
        order, stack = [], [node]
        while stack:
            order.append(stack.pop())
            stack.extend(order[-1].children.values())
        for gone in reversed(order):
            del self._nodes[gone.node_id]
            self._drop_snapshot(gone)
            if gone.disk:
                self.disk_tokens -= len(gone.key)
            elif gone.host:
                self.host_tokens -= len(gone.key)
            else:
                self.total_tokens -= len(gone.key)
            self.ops.append(Evict(gone.node_id))

    def _top_host(self, found: Match, start: Node) -> Node | None:
        """The host-resident node nearest `start` on the path a match reached, if any."""
        node, top = found.child or found.node, None
        while node is not start and node is not self.root:
            top = node if node.host else top
            node = node.parent
        return top

    def _device_evictable(self, node: Node) -> bool:
        return node is not self.root and not node.host and not node.ref and not node.on_device_children()

    def _host_evictable_now(self, node: Node) -> bool:
        """In the host pool, unreferenced, none of its children in it (on disk, or none)."""
        return node.in_host_pool() and not node.ref and not any(c.in_host_pool() for c in node.children.values())

    def _disk_evictable_now(self, node: Node) -> bool:
        return node.disk and not node.ref and not node.children

    def _maybe_evictable(self, node: Node) -> None:
        if node.disk:
            heap, ok = self._disk_evictable, self._disk_evictable_now
        elif node.host:
            heap, ok = self._host_evictable, self._host_evictable_now
        else:
            heap, ok = self._evictable, self._device_evictable
        if not ok(node):
            return
        heapq.heappush(heap, (node.last_use, node.node_id, node))
        if len(heap) > 2 * len(self._nodes) + 64:  # drop stale entries now and then
            heap[:] = [e for e in heap if self._nodes.get(e[1]) is e[2] and ok(e[2]) and e[0] == e[2].last_use]
            heapq.heapify(heap)

    # ---- checks (tests) ----

    def check(self) -> None:
        """Assert the tree's invariants: counts, depths, child keys, references."""
        total = locked = host = disk = 0
        for node in self._nodes.values():
            if node is self.root:
                continue
            assert node.key and node.parent.children[node.key[0]] is node, node
            assert node.depth == node.parent.depth + len(node.key), node
            assert all(child.ref <= node.ref for child in node.children.values()), node
            assert not node.host or (not node.ref and not node.on_device_children()), node  # host: a path's tail
            assert not node.disk or all(c.disk for c in node.children.values()), node  # disk: a path's tail
            host += len(node.key) if node.in_host_pool() else 0
            disk += len(node.key) if node.disk else 0
            total += 0 if node.host else len(node.key)
            locked += len(node.key) if node.ref else 0
        assert (total, locked, host) == (self.total_tokens, self.locked_tokens, self.host_tokens), (total, locked, host)
        assert host <= self.host_capacity and disk <= self.disk_capacity, (host, disk)
        assert disk == self.disk_tokens, disk
        assert len(self._snapshot_nodes) + len(self._free_snapshots) == self.snapshot_slots
        assert all(self._nodes.get(n.node_id) is n and n.snapshot == slot and not n.host
                   for slot, n in self._snapshot_nodes.items())

    @property
    def snapshots_used(self) -> int:
        return len(self._snapshot_nodes)

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
