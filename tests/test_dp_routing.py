"""--dp routing by prefix. The router alone: chained block hashes name whole prefixes, a returning
prompt goes where its prefix went unless that replica is much busier, each index forgets its
oldest blocks past the replica's cache. A server with --dp 2 on the tiny model (CPU), multi-turn
chats whose histories fit in the two replicas' caches together but not in one: the prefix
cache's hit rate at least 1.8x round robin's, neither replica given more than 1.5x the other's
requests."""

import random

import pytest

from lightllm.server.httpserver.dp_routing import BLOCK_TOKENS, ReplicaRouter, block_hashes
from lightllm.tools.bench_model import write_bench_model
from server_utils import start_server


def test_a_block_hash_names_the_whole_prefix_before_it():
    rng = random.Random(0)
    a = [rng.randrange(1000) for _ in range(5 * BLOCK_TOKENS + 3)]
    b = a[:BLOCK_TOKENS] + [a[BLOCK_TOKENS] + 1] + a[BLOCK_TOKENS + 1:]  # one token differs in block 1
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 5 and ha[0] == hb[0] and all(x != y for x, y in zip(ha[1:], hb[1:]))
    assert block_hashes(a[: 3 * BLOCK_TOKENS]) == ha[:3]


def test_a_returning_prompt_goes_where_its_prefix_went_unless_that_replica_is_much_busier():
    router = ReplicaRouter(2)
    rng = random.Random(1)
    chats = [[rng.randrange(1000) for _ in range(3 * BLOCK_TOKENS)] for _ in range(2)]
    first = [router.pick(chat, [0.0, 0.0], [10_000] * 2) for chat in chats[:1]]
    assert first == [0]
    assert router.pick(chats[1], [0.2, 0.0], [10_000] * 2) == 1  # no prefix anywhere: the least loaded
    for home, chat in enumerate(chats):
        longer = chat + [rng.randrange(1000) for _ in range(40)]
        assert router.pick(longer, [0.3, 0.3], [10_000] * 2) == home
        assert router.pick(longer, [0.25 + home * 0.1, 0.35 - home * 0.1], [10_000] * 2) == home  # within the bound
        busy = [0.6, 0.1] if home == 0 else [0.1, 0.6]
        assert router.pick(longer, busy, [10_000] * 2) == 1 - home  # past it: the other one


def test_an_index_forgets_its_least_recently_routed_blocks_past_the_cache():
    router = ReplicaRouter(2)
    rng = random.Random(2)
    chats = [[rng.randrange(1000) for _ in range(2 * BLOCK_TOKENS)] for _ in range(3)]
    for chat in chats:  # all to replica 0 (replica 1 busy): room for 4 blocks, so the first chat is forgotten
        assert router.pick(chat, [0.0, 0.9], [4 * BLOCK_TOKENS, 10_000]) == 0
    assert router.pick(chats[0], [0.04, 0.0], [4 * BLOCK_TOKENS, 10_000]) == 1  # forgotten: the least loaded
    assert router.pick(chats[2], [0.04, 0.0], [4 * BLOCK_TOKENS, 10_000]) == 0  # held: within the bound


def test_round_robin_and_least_loaded_ignore_the_prompt():
    prompt = list(range(4 * BLOCK_TOKENS))
    robin = ReplicaRouter(3, "round_robin")
    assert [robin.pick(prompt, [0.0] * 3, [100] * 3) for _ in range(4)] == [0, 1, 2, 0]
    least = ReplicaRouter(2, "least_loaded")
    assert [least.pick(prompt, loads, [100] * 2) for loads in ([0.1, 0.0], [0.0, 0.1], [0.0, 0.0])] == [1, 0, 0]
    with pytest.raises(ValueError, match="dp_routing"):
        ReplicaRouter(2, "random")


# ---- a server with two replicas ----

CHATS, TURNS = 7, 5  # odd: round robin sends a chat's turns to alternate replicas
# Each replica's KV budget holds its share of the chats' histories (7 x about 100 tokens at the
# end, 4 or 3 on each) but not every chat's: round robin caches each chat on both replicas.
SMALL = ["--max_total_token_num", "450", "--max_req_total_len", "256", "--max_req_input_len", "200", "--chunked_prefill_size", "256",
         "--running_max_req_size", "8"]


def multi_turn(server) -> tuple[float, list[float]]:
    """(prefix-cache hit rate, requests routed to each replica) over the chats, turn by turn."""
    history = [f"Conversation {c} begins: tell me a story about the number {c * 37} and the river {c}."
               for c in range(CHATS)]
    for turn in range(TURNS):
        for c in range(CHATS):
            prompt = f"{history[c]} Question {turn}: and then what happened next?"
            history[c] = prompt + server.generate(prompt, max_new_tokens=6)["generated_text"][0]
    samples = server.metrics()
    hits = samples["lightllm:prefix_cache_hits_total"] / samples["lightllm:prefix_cache_queries_total"]
    return hits, [samples[f'lightllm:replica_requests_routed_total{{replica="{d}"}}'] for d in range(2)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")


def test_two_replicas_routed_by_prefix_hit_more_than_round_robin_and_stay_balanced(tiny_dir, tmp_path):
    found = {}
    for policy in ("round_robin", "prefix"):
        server = start_server(["--model_dir", str(tiny_dir), "--dp", "2", "--dp_routing", policy, *SMALL],
                              tmp_path / f"{policy}.log")
        try:
            found[policy] = multi_turn(server)
        finally:
            assert server.stop() == 0
    (robin, _), (prefix, routed) = found["round_robin"], found["prefix"]
    assert prefix >= 1.8 * robin, found
    assert sum(routed) == CHATS * TURNS and max(routed) <= 1.5 * min(routed), found
