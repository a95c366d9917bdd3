"""The prefix cache through the server (default model, cache on by default): a repeated prompt
and a shared system prompt are served from the cache with the same greedy text; responses and
/metrics report the cached tokens; idle, no KV token is in use and the cache keeps its tokens."""

import requests

SYSTEM = ("You are a helpful assistant for a small bakery. You answer questions about bread, cakes, "
          "opening hours and prices, politely and in at most two sentences. ") * 3


def metric(server, name: str) -> float:
    return server.metrics()[name]


def test_repeated_prompt_is_served_from_the_cache(default_server):
    prompt = SYSTEM + "What do you sell?"
    queried_before = metric(default_server, "lightllm:prefix_cache_queries_total")
    hits_before = metric(default_server, "lightllm:prefix_cache_hits_total")
    first = default_server.generate(prompt, max_new_tokens=8)
    second = default_server.generate(prompt, max_new_tokens=8)
    assert second["generated_text"] == first["generated_text"]
    # Every prompt token but the last (whose logits the reply needs) comes from the cache.
    assert second["cached_tokens"] == second["prompt_tokens"] - 1
    default_server.wait_for(
        lambda: metric(default_server, "lightllm:prefix_cache_queries_total") - queried_before
        == 2 * first["prompt_tokens"], what="the lookups counted")
    hits = metric(default_server, "lightllm:prefix_cache_hits_total") - hits_before
    assert hits == first["cached_tokens"] + second["cached_tokens"]
    default_server.wait_for(lambda: metric(default_server, "lightllm:kv_cache_used_tokens") == 0, what="idle")
    assert metric(default_server, "lightllm:prefix_cache_tokens") >= second["prompt_tokens"]


def test_shared_system_prompt_reports_cached_tokens_in_openai_usage(default_server):
    model = requests.get(f"{default_server.url}/v1/models", timeout=30).json()["data"][0]["id"]

    def chat(question: str) -> dict:
        body = {"model": model, "temperature": 0, "max_tokens": 6,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
        response = requests.post(f"{default_server.url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    first = chat("When do you open?")
    again = chat("When do you open?")
    other = chat("Do you bake rye bread?")
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    system_tokens = len(SYSTEM.split())  # a lower bound on its tokens
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] >= system_tokens
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1


def test_a_cache_salt_keeps_tenants_apart(default_server):
    """vLLM's cache_salt on the OpenAI routes: a repeated prompt under another salt (or none)
    computes its prompt again; under its own it is served from the cache."""
    def cached(salt: str | None) -> int:
        body = {"prompt": "Tenant " + SYSTEM, "max_tokens": 2, "temperature": 0,
                **({"cache_salt": salt} if salt is not None else {})}
        response = requests.post(f"{default_server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    first, prompt_tokens = cached("tenant-a")
    assert [first, cached("tenant-b")[0], cached(None)[0]] == [0, 0, 0]
    assert cached("tenant-a")[0] == prompt_tokens - 1
    empty = requests.post(f"{default_server.url}/v1/completions", json={"prompt": "x", "cache_salt": ""}, timeout=60)
    assert empty.status_code == 400 and "cache_salt" in empty.text


def test_a_flush_empties_the_cache_for_the_requests_after_it(default_server):
    """vLLM's POST /reset_prefix_cache and SGLang's /flush_cache: the next request computes its
    whole prompt, the same greedy text, and the cache's gauge falls to what it holds then."""
    prompt = SYSTEM + "Do you bake rye?"
    for path in ("/reset_prefix_cache", "/flush_cache"):
        first = default_server.generate(prompt, max_new_tokens=6)
        again = default_server.generate(prompt, max_new_tokens=6)
        assert again["cached_tokens"] == again["prompt_tokens"] - 1
        flushed = default_server.post(path, {})
        assert flushed.status_code == 200, flushed.text
        cold = default_server.generate(prompt, max_new_tokens=6)
        assert cold["cached_tokens"] == 0 and cold["generated_text"] == first["generated_text"]
        default_server.post(path, {})
        default_server.wait_for(lambda: metric(default_server, "lightllm:prefix_cache_tokens") == 0,
                                what="an empty cache")
    assert requests.get(f"{default_server.url}/reset_prefix_cache", timeout=10).status_code == 405
    version = requests.get(f"{default_server.url}/version", timeout=10)
    info = requests.get(f"{default_server.url}/info", timeout=10).json()
    assert version.status_code == 200 and version.json()["version"] == info["version"]
