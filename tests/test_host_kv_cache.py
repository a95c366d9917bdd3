"""The prefix cache's host tier.

The tree: random inserts, lock-and-loads (the scheduler's pattern), evictions and flushes against
a plain model of every cached sequence and of where each lives (hypothesis); the ops replayed on
a slot store give every node its tokens on the tier the tree says.
The pool: an offload then a load puts every layer's K and V of each token at the token's new slot,
with one shape in every buffer or buffers of their own heads and head size (as Gemma 4's).
The engine on a real model (CPU), a KV budget small enough to evict: greedy output equals
transformers' and the device-only cache's, over random multi-turn traffic, and for Gemma 4 the
device-only cache's; when idle no slot or host room is held.
"""

import re
import subprocess
import sys

import pytest
import torch
from helpers.models import Client, hf_greedy, make_model, make_runner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightllm.common import host_pool
from lightllm.common.host_pool import HostKVPool
from lightllm.common.radix_cache import Evict, Insert, Load, Offload, RadixCache, Spill, Split
from lightllm.common.token_table import TokenTable
from lightllm.engine.config import EngineConfig
from lightllm.engine.core import EngineCore
from lightllm.engine.request import SamplingParams
from lightllm.engine.scheduler import Scheduler

VOCAB = 101
NEW = 4

# ---- the tree ----

token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=10)
actions = st.lists(  # evictions and matches weighted up: each move between tiers needs both
    st.one_of(
        st.tuples(st.just("insert"), token_lists),
        st.tuples(st.sampled_from(["lock", "lock+unlock"]), token_lists),
        st.tuples(st.just("unlock"), st.integers(0, 100)),
        st.tuples(st.just("evict"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(0, 20)),
    ),
    min_size=10,
    max_size=60,
)


class TieredStore:
    """The runner's side: node id -> its tokens' slots on the device, in the host or the disk pool."""

    def __init__(self):
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.disk: dict[int, list] = {}

    def tier(self, node_id: int) -> dict:
        return next(t for t in (self.device, self.host, self.disk) if node_id in t)

    def apply(self, ops) -> None:
        for op in ops:
            if isinstance(op, Insert):
                assert all(op.node_id not in t for t in (self.device, self.host, self.disk))
                self.device[op.node_id] = [(op.req_id, p) for p in range(op.start, op.end)]
            elif isinstance(op, Split):
                tier = self.tier(op.node_id)
                slots = tier[op.node_id]
                tier[op.upper_id], tier[op.node_id] = slots[: op.at], slots[op.at:]
            elif isinstance(op, Evict):
                self.tier(op.node_id).pop(op.node_id)
            elif isinstance(op, Offload):
                self.host[op.node_id] = self.device.pop(op.node_id)
            elif isinstance(op, Spill):
                self.disk[op.node_id] = self.host.pop(op.node_id)
            elif isinstance(op, Load):
                self.device[op.node_id] = self.tier(op.node_id).pop(op.node_id)
        ops.clear()


def prefixes(tokens) -> set[tuple[int, ...]]:
    return {tuple(tokens[:n]) for n in range(1, len(tokens) + 1)}


def tiers(cache: RadixCache) -> tuple[set, set, set]:
    """(every cached sequence, those whose last token is off the device, those of them on disk)."""
    every, host, disk = set(), set(), set()
    for path, node_id in cache.cached_prefixes().items():
        node = cache._nodes[node_id]
        mine = {path[:n] for n in range(node.depth - len(node.key) + 1, node.depth + 1)}
        every |= mine
        host |= mine if node.host else set()
        disk |= mine if node.disk else set()
    return every, host, disk


@settings(max_examples=300, deadline=None)
@given(actions, st.integers(0, 12), st.sampled_from([0, 6, 30]))
def test_tree_with_lower_tiers_keeps_every_sequence_on_one_tier(actions, capacity, disk_capacity):
    ops = []
    cache = RadixCache(ops, host_capacity=capacity, disk_capacity=disk_capacity if capacity else 0)
    store = TieredStore()
    model: set[tuple[int, ...]] = set()
    locks = []
    for req_id, (kind, arg) in enumerate(actions):
        if kind == "insert":
            duplicated, _ = cache.insert(cache.root, arg, req_id, 0)
            assert duplicated <= len(arg)
            model |= prefixes(arg)  # a host node the insert reached is dropped, its sequences now on the device
            model = {p for p in model if p in prefixes(arg) or p in tiers(cache)[0]}
        elif kind.startswith("lock"):
            found = cache.match(arg)
            if found.length:
                node = cache.take(found)
                cache.lock(node)
                for host_node in cache.host_path(node):
                    cache.evict(len(host_node.key))  # what the scheduler does for room
                    cache.load(host_node)
                assert not cache.host_path(node)
                locks.append((node, arg[: found.length]))
                if kind == "lock+unlock":
                    cache.unlock(locks.pop()[0])
        elif kind == "unlock" and locks:
            cache.unlock(locks.pop(arg % len(locks))[0])
        elif kind == "evict":
            before_device = cache.total_tokens
            freed = cache.evict(arg)
            assert cache.total_tokens == before_device - freed
        store.apply(ops)
        cache.check()
        every, host, disk = tiers(cache)
        assert every <= model and all(p[:-1] in every for p in every if len(p) > 1)  # prefix-closed
        assert all(p[:-1] not in host or p in host for p in every)  # below a host token: host only
        assert all(p[:-1] not in disk or p in disk for p in every)  # below a disk token: disk only
        assert len(host - disk) == cache.host_tokens <= capacity and len(every - host) == cache.total_tokens
        assert len(disk) == cache.disk_tokens <= cache.disk_capacity
        assert all(prefixes(t) <= every - host for _, t in locks)  # locked: on the device
        model = every
        for node_id, node in cache._nodes.items():
            if node_id:
                tier = store.disk if node.disk else store.host if node.host else store.device
                assert len(tier[node_id]) == len(node.key)
        assert set(store.device) | set(store.host) | set(store.disk) == set(cache._nodes) - {0}
    for node, _ in locks:
        cache.unlock(node)
    cache.flush()
    store.apply(ops)
    assert cache.total_tokens == cache.host_tokens == cache.disk_tokens == 0
    assert not store.device and not store.host and not store.disk


def test_a_host_node_is_dropped_least_recently_used_first():
    ops = []
    cache = RadixCache(ops, host_capacity=4)
    cache.insert(cache.root, [1, 2], 0, 0)
    cache.insert(cache.root, [3, 4], 1, 0)
    cache.insert(cache.root, [5, 6], 2, 0)
    assert cache.evict(6) == 6 and cache.total_tokens == 0
    assert cache.host_tokens == 4 and cache.match([1, 2]).length == 0  # the oldest did not fit
    assert cache.match([3, 4]).length == 2 and cache.match([5, 6]).length == 2


# ---- the pool ----

# one shape in every layer, and Gemma 4's kind: buffers of their own heads and head size each
SHAPES = {"uniform": [(2, 4)] * 3, "mixed": [(2, 4), (1, 8), (3, 2), (2, 4)]}


@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("staging", [512, 2])
def test_offload_then_load_puts_each_token_at_its_new_slot(staging, shapes, monkeypatch):
    monkeypatch.setattr(host_pool, "STAGING_TOKENS", staging)
    table = TokenTable(32, len(shapes), *shapes[0], torch.float32, "cpu", shapes=shapes)
    for t in table.k + table.v:
        t.copy_(torch.randn_like(t))
    pool = HostKVPool(16, table.k + table.v, torch.device("cpu"))
    first, _, second, _ = pool.alloc(2), pool.alloc(2), pool.alloc(3), pool.alloc(9)
    pool.free(first + second)  # the pool's room in two runs, neither long enough alone
    old = torch.tensor([9, 2, 30, 17, 5], dtype=torch.int32)
    expected = [t[old.long()].clone() for t in table.k + table.v]
    pool.offload([(7, old)], table.k + table.v)
    assert pool.nodes[7] == [(0, 2), (4, 3)]
    pool.split(7, 4, 8)  # the upper 4 tokens and the lower 1
    new = torch.tensor([0, 1, 3, 4, 6])
    pool.load([(8, new[:4])], table.k + table.v)
    pool.load([(7, new[4:])], table.k + table.v)
    for t, want in zip(table.k + table.v, expected):
        torch.testing.assert_close(t[new], want, rtol=0, atol=0)
    assert pool.free_count == 5 and not pool.nodes


def test_records_of_buffers_of_several_dtypes_come_back_bit_for_bit(tmp_path):
    """fp8 K/V of 3 and 4 values a slot, then an fp32 feature and a bf16 one (at bytes 14 and 34 of
    the record), through the host and disk pools."""
    shapes = [(1, 3), (2, 2)]
    table = TokenTable(16, len(shapes), *shapes[0], torch.float8_e4m3fn, "cpu", shapes=shapes)
    for t in table.k + table.v:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    buffers = table.k + table.v + [torch.randn(16, 5), torch.randn(16, 3).bfloat16()]
    host = HostKVPool(8, buffers, torch.device("cpu"))
    disk = HostKVPool(8, buffers, torch.device("cpu"), path=str(tmp_path / "kv.bin"))
    assert host.widths == [3, 4, 3, 4, 20, 6] and host.unit == torch.uint8
    old, new = torch.tensor([3, 11, 7, 0, 14]), torch.tensor([1, 2, 4, 5, 6])
    expected = [t[old].clone() for t in buffers]
    host.offload([(5, old), (6, old[:2])], buffers)
    disk.take_from(5, host)
    disk.load([(5, new)], buffers)
    host.load([(6, new[:2] + 8)], buffers)
    for t, want in zip(buffers, expected):
        assert torch.equal(t[new].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(t[new[:2] + 8].view(torch.uint8), want[:2].view(torch.uint8))
    with pytest.raises(ValueError, match="bytes a slot"):
        host.offload([(7, old)], buffers[:-1])


RESIDENT_CHECK = """
import os, torch
from lightllm.common.host_pool import HostKVPool
def rss_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
buffers = [torch.zeros(4, 64, 64) for _ in range(4)]  # 64 KiB a slot
before = rss_mib()
pool = HostKVPool(1024, buffers, torch.device("cpu"))  # 64 MiB
print(rss_mib() - before, pool.data.numel() * pool.data.element_size() / 2**20)
"""


def test_a_host_pool_on_the_cpu_is_resident_from_its_start():
    """As a pinned pool on CUDA is: the memory the operator gave is taken at start, not page by page
    as the tier fills (a soak would read that as the server's memory growing). In a fresh process:
    in a long-lived one the allocator may hand back pages earlier tests left resident."""
    out = subprocess.run([sys.executable, "-c", RESIDENT_CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grew, size = map(float, out.stdout.split())
    assert grew >= 0.9 * size, (grew, size)


def test_a_node_spilled_to_disk_loads_back_to_its_new_slots(tmp_path):
    layers, heads, dim = 2, 2, 4
    table = TokenTable(16, layers, heads, dim, torch.float32, "cpu")
    for t in table.k + table.v:
        t.copy_(torch.randn_like(t))
    host = HostKVPool(8, table.k + table.v, torch.device("cpu"))
    disk = HostKVPool(8, table.k + table.v, torch.device("cpu"), path=str(tmp_path / "kv.bin"))
    assert not list(tmp_path.iterdir())  # the file goes with the process
    disk.alloc(1)  # its room starts elsewhere than the host pool's
    old = torch.tensor([3, 11, 7, 0, 14])
    expected = [t[old].clone() for t in table.k + table.v]
    host.offload([(5, old)], table.k + table.v)
    disk.take_from(5, host)
    assert host.free_count == 8 and not host.nodes and disk.nodes[5] == [(1, 5)]
    new = torch.tensor([1, 2, 4, 5, 6])
    disk.load([(5, new)], table.k + table.v)
    for t, want in zip(table.k + table.v, expected):
        torch.testing.assert_close(t[new], want, rtol=0, atol=0)


def test_the_disk_tier_needs_the_host_tier():
    with pytest.raises(ValueError, match="--disk_kv_cache_dir needs --host_kv_cache_gb"):
        EngineConfig(disk_kv_cache_dir="/tmp").check()
    EngineConfig(disk_kv_cache_dir="/tmp", host_kv_cache_gb=1.0).check()


# ---- the engine ----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_model = make_model("llama_gqa_llama3_rope", path)
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads of 16, fp32
    runner = make_runner(path, tokens=96, running_max_req_size=4, max_req_total_len=96,
                         host_kv_cache_gb=160 * per_token / 2**30)
    assert runner.host_pool.capacity == 160
    return hf_model, runner


def engine(runner, host: int, chunk: int = 16, disk: int = 0) -> EngineCore:
    scheduler = Scheduler(runner.max_total_token_num, chunk, runner.req_table.max_reqs, host_cache_tokens=host,
                          disk_cache_tokens=disk)
    return EngineCore(scheduler, runner, eos_token_ids=[], overlap=True)


def assert_idle(core: EngineCore) -> None:
    """Nothing held but the cache's nodes, on both tiers; a flush frees every slot and host token."""
    runner, scheduler = core._workers, core.scheduler
    scheduler.cache.check()
    assert not runner.reqs and runner.token_table.used_count == scheduler.cached_tokens
    pools = [(p, held) for p, held in ((runner.host_pool, scheduler.cache.host_tokens),
                                       (runner.disk_pool, scheduler.cache.disk_tokens)) if p is not None]
    for pool, held in pools:
        assert pool.capacity - pool.free_count == held == sum(n for runs in pool.nodes.values() for _, n in runs)
    scheduler.flush_cache()
    core.drain()
    assert runner.token_table.used_count == 0 and not runner.nodes
    for pool, _ in pools:
        assert pool.free_count == pool.capacity and not pool.nodes and pool.free_runs == [(0, pool.capacity)]


def tokens(rng: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=rng).tolist()


def converse(core, conversations: list[list[int]], turns: list[list[int]], rng) -> list[list[int]]:
    """Each turn, the listed conversations send their history and a new user message together."""
    client, outs = Client(core), []
    for who in turns:
        prompts = [conversations[c] + tokens(rng, 3 + (c * 5 + len(outs)) % 7) for c in who]
        got = client.run(prompts, SamplingParams(max_new_tokens=NEW))
        for c, prompt, out in zip(who, prompts, got):
            conversations[c] = prompt + out
        outs += got
    return outs


def test_multi_turn_reloads_from_host_and_equals_transformers(tiny):
    hf_model, runner = tiny
    rng = torch.Generator().manual_seed(5)
    system = tokens(rng, 10)
    starts = [system + tokens(rng, 8) for _ in range(4)]
    turns = [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1, 2, 3]]
    results = {}
    for host in (0, runner.host_pool.capacity):
        core = engine(runner, host)
        conversations = [list(s) for s in starts]
        results[host] = converse(core, conversations, turns, torch.Generator().manual_seed(6))
        if host:
            scheduler = core.scheduler
            assert scheduler.cache.evicted_tokens > 0 and scheduler.prefix_host_hit_tokens > 0
            assert scheduler.prefix_host_hit_tokens <= scheduler.prefix_hit_tokens
        assert_idle(core)
    assert results[0] == results[runner.host_pool.capacity]
    # the oracle for the last turn: every conversation's final history, prompted afresh
    last = [c[:-NEW] for c in conversations]
    assert [c[-NEW:] for c in conversations] == list(hf_greedy(hf_model, last, NEW).values())


def test_multi_turn_through_the_disk_tier_equals_the_device_only_cache(tmp_path):
    make_model("llama_gqa_llama3_rope", tmp_path)
    per_token = 2 * 2 * 2 * 16 * 4
    runner = make_runner(tmp_path, tokens=96, running_max_req_size=4, max_req_total_len=96,
                         host_kv_cache_gb=24 * per_token / 2**30, disk_kv_cache_dir=str(tmp_path),
                         disk_kv_cache_gb=200 * per_token / 2**30)
    assert (runner.host_pool.capacity, runner.disk_pool.capacity) == (24, 200)
    turns = [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1, 2, 3]]
    results = []
    for host, disk in ((0, 0), (24, 200)):
        core = engine(runner, host, disk=disk)
        rng = torch.Generator().manual_seed(8)
        conversations = [tokens(rng, 14) for _ in range(4)]
        results.append(converse(core, conversations, turns, rng))
        if disk:
            assert core.scheduler.prefix_disk_hit_tokens > 0
        assert_idle(core)
    assert results[0] == results[1]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True), min_size=2, max_size=5),
       st.sampled_from([24, 160]), st.integers(0, 2**16))
def test_random_multi_turn_traffic_equals_the_device_only_cache(tiny, turns, host, seed):
    _, runner = tiny
    results = []
    for tier in (0, host):
        core = engine(runner, tier)
        rng = torch.Generator().manual_seed(seed)
        system = tokens(rng, 6)
        conversations = [system + tokens(rng, 4 + c) for c in range(4)]
        results.append(converse(core, conversations, turns, rng))
        assert_idle(core)
    assert results[0] == results[1]


def test_gemma4_multi_turn_through_the_host_tier_equals_the_device_only_cache(tmp_path):
    """Buffers of two shapes (sliding layers: 2 kv heads of 16; global: 1 of 32) and KV-sharing layers."""
    make_model("gemma4", tmp_path)
    per_token = 2 * (2 * 16 + 32) * 4  # K and V of the two buffers that own KV, fp32
    runner = make_runner(tmp_path, tokens=96, running_max_req_size=4, max_req_total_len=96,
                         host_kv_cache_gb=160 * per_token / 2**30)
    assert sorted({tuple(k.shape[1:]) for k in runner.token_table.k}) == [(1, 32), (2, 16)]
    assert runner.host_pool.capacity == 160
    turns = [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1, 2, 3]]
    results = []
    for host in (0, 160):
        core = engine(runner, host)
        rng = torch.Generator().manual_seed(9)
        system = tokens(rng, 10)
        conversations = [system + tokens(rng, 8) for _ in range(4)]
        results.append(converse(core, conversations, turns, rng))
        if host:
            assert core.scheduler.cache.evicted_tokens > 0 and core.scheduler.prefix_host_hit_tokens > 0
        assert_idle(core)
    assert results[0] == results[1]


# ---- batches: a step's evictions, then its loads, each moved in one batch ----

def test_a_batch_of_nodes_moves_in_one_copy_a_staging_tensor(monkeypatch):
    shapes = SHAPES["mixed"]
    table = TokenTable(64, len(shapes), *shapes[0], torch.float32, "cpu", shapes=shapes)
    for t in table.k + table.v:
        t.copy_(torch.randn_like(t))
    pool = HostKVPool(64, table.k + table.v, torch.device("cpu"))
    copies = []
    copy = pool._copy
    monkeypatch.setattr(pool, "_copy", lambda runs, staging, to_host: (copies.append(runs),
                                                                        copy(runs, staging, to_host)))
    old = [torch.randperm(64)[:n].int() for n in (5, 9, 3)]
    expected = [[t[slots.long()].clone() for t in table.k + table.v] for slots in old]
    pool.offload(list(zip((1, 2, 3), old)), table.k + table.v)
    assert copies == [[(0, 17)]]  # three nodes, one gather, one copy of their adjacent runs
    new = torch.randperm(64)[:17].split([3, 5, 9])
    pool.load(list(zip((3, 1, 2), new)), table.k + table.v)
    assert copies[1:] == [[(14, 3), (0, 14)]]  # one staging tensor, a copy a run
    for slots, want in zip((new[1], new[2], new[0]), expected):
        for t, w in zip(table.k + table.v, want):
            torch.testing.assert_close(t[slots], w, rtol=0, atol=0)
    assert pool.free_count == 64 and pool.free_runs == [(0, 64)] and not pool.nodes


def test_the_runner_moves_consecutive_offloads_and_loads_as_one_batch(tiny, monkeypatch):
    _, runner = tiny
    pool, kv = runner.host_pool, runner.token_table.k + runner.token_table.v
    calls = []
    for name in ("offload", "load"):
        method = getattr(pool, name)
        monkeypatch.setattr(pool, name, lambda nodes, layers, method=method, name=name: (
            calls.append((name, [node_id for node_id, _ in nodes])), method(nodes, layers)))
    for t in kv:
        t.copy_(torch.randn_like(t))
    for node_id, n in ((101, 4), (102, 7), (103, 2)):
        runner.nodes[node_id] = runner.token_table.alloc(n, contiguous=False).int()
    expected = {i: [t[runner.nodes[i].long()].clone() for t in kv] for i in (101, 102, 103)}
    runner.apply([Offload(101), Offload(102), Offload(103)])
    assert runner.token_table.used_count == 0 and not runner.nodes
    runner.apply([Load(102), Load(101), Load(103)])
    assert calls == [("offload", [101, 102, 103]), ("load", [102, 101, 103])]
    for node_id, want in expected.items():
        for t, w in zip(kv, want):
            torch.testing.assert_close(t[runner.nodes[node_id].long()], w, rtol=0, atol=0)
    runner.apply([Evict(101), Evict(102), Evict(103)])
    assert runner.token_table.used_count == 0 and pool.free_count == pool.capacity


def test_an_admission_evicts_its_room_before_it_loads_its_path(tiny):
    """A returning conversation whose history is host-resident in several nodes, the device full
    of evictable tokens: the plan that admits it evicts, then loads its nodes, so the runner moves
    each as one batch (room evicted node by node would interleave them)."""
    _, runner = tiny
    core = engine(runner, 160)
    plans = []
    step = runner.step
    runner.step = lambda plan: (plans.append(plan), step(plan))[1]
    try:
        rng = torch.Generator().manual_seed(11)
        client = Client(core)
        first = tokens(rng, 30)  # chunks of 16: its history is three nodes (16, 14 and its answer's)
        history = first + client.run([first], SamplingParams(max_new_tokens=NEW))[0]
        for _ in range(3):  # others push it to the host tier and fill the device
            client.run([tokens(rng, 40)], SamplingParams(max_new_tokens=NEW))
        assert core.scheduler.cache.match(history).length == len(history) - 1
        assert len(core.scheduler.cache.host_path(core.scheduler.cache.take(core.scheduler.cache.match(history)))) >= 2
        plans.clear()
        client.run([history + tokens(rng, 5)], SamplingParams(max_new_tokens=NEW))
        admitting = [plan for plan in plans if any(isinstance(op, Load) for op in plan.ops)]
        assert len(admitting) == 1
        moves = [op for op in admitting[0].ops if isinstance(op, (Offload, Load))]
        kinds = "".join("L" if isinstance(op, Load) else "O" for op in moves)
        # its room, then its loads, one run each (the plan's chunk may evict more after them)
        assert re.fullmatch(r"O+L{2,}O*", kinds), admitting[0].ops
        assert core.scheduler.prefix_host_hit_tokens == len(history) - 1
        assert_idle(core)
    finally:
        runner.step = step


def test_the_pinned_pool_is_its_exact_size_registered_once_and_unregistered_when_dropped(monkeypatch):
    """torch's pinned allocator would round 24 GiB up to 32: the pool registers exactly its own bytes
    (CUDA's calls recorded here; tests/gpu runs them)."""
    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    data = host_pool.pinned_empty((3, 5), torch.float16)
    assert data.shape == (3, 5) and not data.any()
    assert calls == [("register", data.data_ptr(), 30)]
    ptr = data.data_ptr()
    del data
    assert calls[1:] == [("unregister", ptr)]
