"""The prefix cache through the engine core and a real model runner (CPU): greedy text equals
transformers and equals the cache-off text for a shared system prompt, multi-turn chats, a
prompt that is a prefix of another, identical prompts at once and a prompt ending inside a
cached node; seeded sampling is unchanged; under a small KV budget eviction runs, the budget
holds and nothing leaks.
Relies on transformers' Llama modeling code (rotary with llama3 scaling) and its greedy `generate` as the oracle."""

import pytest
import torch
from helpers.models import Client, assert_idle, engine, hf_greedy, make_model, make_runner

from lightllm.engine.request import SamplingParams

VOCAB = 101
NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_model = make_model("llama_gqa_llama3_rope", path)
    runner = make_runner(path, tokens=1024, max_req_total_len=160)
    return hf_model, runner


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf(hf_model, prompts, new=NEW) -> list[list[int]]:
    return list(hf_greedy(hf_model, prompts, new).values())


def workloads() -> dict[str, list[list[int]]]:
    system = tokens(1, 40)
    long = tokens(2, 50)
    return {
        "shared system prompt": [system + tokens(10 + i, 5 + 3 * i) for i in range(5)],
        "prefix of another": [long[:20], long, long[:35], long[:20] + tokens(3, 4)],
        "identical at once": [long] * 3,
        "ends inside a node": [long, long[:13], long[:29] + [7], long[:41]],
    }


@pytest.mark.parametrize("name", list(workloads()))
def test_cache_equals_transformers_and_cache_off(name, tiny):
    hf_model, runner = tiny
    prompts = workloads()[name]
    expected = hf(hf_model, prompts)
    greedy = SamplingParams(max_new_tokens=NEW)
    results = {}
    for prefix_cache in (True, False):
        core = engine(runner, chunk=16, prefix_cache=prefix_cache)
        client = Client(core)
        # Staggered: later prompts find earlier ones cached; then all again at once, all cached.
        results[prefix_cache] = client.run(prompts, greedy, staggered=True) + client.run(prompts, greedy)
        hits = core.scheduler.prefix_hit_tokens
        assert (hits > 0) == prefix_cache
        assert_idle(core)
    assert results[True] == results[False] == expected + expected


def test_multi_turn_conversation_reuses_its_history(tiny):
    hf_model, runner = tiny
    core = engine(runner, chunk=16)
    client = Client(core)
    history = tokens(20, 12)
    for turn in range(4):
        prompt = history + tokens(30 + turn, 7)
        hits_before = core.scheduler.prefix_hit_tokens
        (out,) = client.run([prompt], SamplingParams(max_new_tokens=NEW))
        assert out == hf(hf_model, [prompt])[0]
        if turn:  # the history came from the cache, all but the last answer token (never fed back)
            assert core.scheduler.prefix_hit_tokens - hits_before == len(history) - 1
        history = prompt + out
    assert_idle(core)


def test_salted_prompts_share_the_cache_only_with_their_salt(tiny):
    """vLLM's cache_salt: the same prompt under salts "a", "b", "a", none and "a" again: only a
    request of a salt seen before reuses the KV (all but the last prompt token); every output is
    transformers'."""
    from lightllm.engine.request import GenerateReq

    hf_model, runner = tiny
    core = engine(runner, chunk=16)
    prompt = tokens(40, 24)
    expected = hf(hf_model, [prompt])[0]
    cached = []
    for i, salt in enumerate(["a", "b", "a", "", "a"]):
        core.add(GenerateReq(500 + i, prompt, SamplingParams(max_new_tokens=NEW), cache_salt=salt))
        outs = core.drain()
        assert [o.token_id for o in outs] == expected, salt
        cached.append(outs[0].cached_tokens)
    assert cached == [0, 0, len(prompt) - 1, 0, len(prompt) - 1]
    assert_idle(core)


def test_seeded_sampling_is_the_same_with_the_cache(tiny):
    _, runner = tiny
    prompts = workloads()["shared system prompt"]
    seeded = SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=77)
    results = []
    for prefix_cache in (True, False):
        core = engine(runner, chunk=16, prefix_cache=prefix_cache)
        client = Client(core)
        results.append(client.run(prompts, seeded, staggered=True) + client.run(prompts, seeded))
        assert_idle(core)
    assert results[0] == results[1]


def test_small_budget_evicts_and_holds(tmp_path):
    hf_model = make_model("llama_gqa_llama3_rope", tmp_path)
    budget = 120
    runner = make_runner(tmp_path, tokens=budget, running_max_req_size=4)
    stems = [tokens(40 + s, 24) for s in range(3)]
    prompts = [stems[i % 3] + tokens(50 + i, 6) for i in range(12)]  # 12 distinct, 3 shared stems
    expected = hf(hf_model, prompts)
    core = engine(runner, chunk=16)
    used = []
    runner_apply = runner.apply

    def watch(ops):  # what the table holds before each step's allocation: never over budget
        runner_apply(ops)
        used.append(runner.token_table.used_count)

    runner.apply = watch
    client = Client(core)
    try:
        got = client.run(prompts[:6], SamplingParams(max_new_tokens=NEW), staggered=True)
        got += client.run(prompts[6:], SamplingParams(max_new_tokens=NEW))
    finally:
        runner.apply = runner_apply
    assert got == expected
    assert core.scheduler.cache.evicted_tokens > 0 and core.scheduler.prefix_hit_tokens > 0
    assert max(used) <= budget
    assert_idle(core)
