"""The prefix cache's radix tree against a plain model: the set of every cached token sequence
(prefix-closed). Random inserts, matches, references and evictions (hypothesis); the runner's
ops replayed on a slot store must give every node exactly its tokens' slots."""

from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.common.radix_cache import RadixCache
from lightllm.engine.plan import Evict, Insert, Split

token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=12)
actions = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), token_lists),
        st.tuples(st.just("lock"), token_lists),
        st.tuples(st.just("unlock"), st.integers(0, 100)),
        st.tuples(st.just("evict"), st.integers(0, 20)),
    ),
    max_size=60,
)


class SlotStore:
    """The runner's side: node id -> slot ids, replaying the ops; slots are (request, position)."""

    def __init__(self):
        self.nodes: dict[int, list] = {}
        self.freed = 0

    def apply(self, ops) -> None:
        for op in ops:
            if isinstance(op, Insert):
                assert op.node_id not in self.nodes
                self.nodes[op.node_id] = [(op.req_id, p) for p in range(op.start, op.end)]
            elif isinstance(op, Split):
                slots = self.nodes[op.node_id]
                self.nodes[op.upper_id], self.nodes[op.node_id] = slots[: op.at], slots[op.at:]
            elif isinstance(op, Evict):
                self.freed += len(self.nodes.pop(op.node_id))
        ops.clear()


def prefixes(tokens) -> set[tuple[int, ...]]:
    return {tuple(tokens[:n]) for n in range(1, len(tokens) + 1)}


def tree_model(cache: RadixCache) -> set[tuple[int, ...]]:
    return set().union(*map(prefixes, cache.cached_prefixes()))


def longest_cached(model: set, tokens) -> int:
    return max((n for n in range(1, len(tokens) + 1) if tuple(tokens[:n]) in model), default=0)


@settings(max_examples=200, deadline=None)
@given(actions)
def test_tree_matches_a_set_of_prefixes(actions):
    ops = []
    cache = RadixCache(ops)
    store = SlotStore()
    model: set[tuple[int, ...]] = set()  # every cached sequence
    locks = []  # (node, tokens it covers)
    for req_id, (kind, arg) in enumerate(actions):
        if kind == "insert":
            found = longest_cached(model, arg)
            assert cache.match(arg).length == found
            duplicated, node = cache.insert(cache.root, arg, req_id, 0)
            assert duplicated == found and (node is None) == (found == len(arg))
            model |= prefixes(arg)
        elif kind == "lock":
            found = cache.match(arg)
            assert found.length == longest_cached(model, arg)
            if found.length:
                node = cache.take(found)
                assert node.depth == found.length
                cache.lock(node)
                locks.append((node, arg[: found.length]))
        elif kind == "unlock" and locks:
            node, _ = locks.pop(arg % len(locks))
            cache.unlock(node)
        elif kind == "evict":
            before = set(model)
            evictable = cache.evictable_tokens
            freed = cache.evict(arg)
            assert freed >= min(arg, evictable) and freed <= evictable
            model = tree_model(cache)
            assert model <= before and len(before) - len(model) == freed
            assert all(p[:-1] in model for p in model if len(p) > 1)  # still prefix-closed
            assert all(prefixes(tokens) <= model for _, tokens in locks)  # locked: never evicted
        store.apply(ops)
        cache.check()
        assert tree_model(cache) == model
        assert cache.total_tokens == len(model)  # one token per distinct prefix: no duplicates
        locked = set().union(*(prefixes(t) for _, t in locks)) if locks else set()
        assert cache.locked_tokens == len(locked)
        # The runner's copy: each node holds exactly one slot per token of its key.
        for tokens, node_id in cache.cached_prefixes().items():
            node = cache._nodes[node_id]
            assert len(store.nodes[node_id]) == len(node.key)
        assert set(store.nodes) == set(cache._nodes) - {0}
    for node, _ in locks:
        cache.unlock(node)
    total = cache.total_tokens
    assert cache.evict(total) == total and cache.total_tokens == 0
    store.apply(ops)
    assert store.nodes == {}


def test_eviction_is_least_recently_used_and_leaves_first():
    ops = []
    cache = RadixCache(ops)
    cache.insert(cache.root, [1, 2, 3, 4], 0, 0)
    cache.insert(cache.root, [1, 2, 9], 1, 0)  # splits [1, 2 | 3, 4]
    cache.insert(cache.root, [5, 6], 2, 0)
    node = cache.take(cache.match([1, 2, 3, 4]))
    cache.lock(node)
    cache.unlock(node)  # [1, 2, 3, 4] is now the most recently used
    assert cache.evict(1) == 1 and cache.match([1, 2, 9]).length == 2  # [9] went first
    assert cache.evict(1) == 2 and cache.match([5, 6]).length == 0  # then [5, 6]
    assert cache.match([1, 2, 3, 4]).length == 4
