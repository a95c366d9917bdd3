"""A small KV budget: every request still completes and usage never passes the budget."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from lightllm.tools.bench_model import write_bench_model
from server_utils import start_server
from seeds import fresh_rng  # noqa: E402

BUDGET = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny_dir = write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")
    args = ["--model_dir", str(tiny_dir), "--max_total_token_num", str(BUDGET), "--max_req_total_len", "800",
            "--max_req_input_len", "200"]
    server = start_server(args, tmp_path_factory.mktemp("budget") / "server.log")
    yield server
    assert server.stop() == 0


def test_many_long_requests_fit_a_small_budget(server):
    rng = fresh_rng()
    requests = [(" ".join(["stone"] * rng.randrange(20, 50)), rng.randrange(80, 150)) for _ in range(24)]
    samples, done = [], threading.Event()

    def sample_metrics():
        while not done.is_set():
            samples.append(server.metrics())

    def run(request):
        prompt, max_new_tokens = request
        return server.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)

    sampler = threading.Thread(target=sample_metrics)
    sampler.start()
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(run, requests))
    finally:
        done.set()
        sampler.join()
    assert [r["count_output_tokens"] for r in results] == [n for _, n in requests]
    assert all(r["finish_reason"] == "length" for r in results)
    used = [s["lightllm:kv_cache_used_tokens"] for s in samples]
    assert max(used) <= BUDGET
    assert max(used) > BUDGET / 2, "the budget was never under pressure: the test proves nothing"
    assert max(s["lightllm:num_requests_waiting"] for s in samples) > 0, "requests had to wait for admission"
    server.wait_for(
        lambda: (m := server.metrics())["lightllm:kv_cache_used_tokens"] == 0 and m["lightllm:num_requests_running"] == 0,
        what="every token free when idle",
    )


@pytest.mark.parametrize(
    "prompt_words, max_new_tokens, message",
    [
        (150, 500, "can never fit the KV cache of max_total_token_num=600"),
        (250, 10, "more than max_req_input_len=200"),
        (150, 700, "more than max_req_total_len=800"),
    ],
)
def test_request_that_can_never_fit_is_refused(server, prompt_words, max_new_tokens, message):
    body = {"inputs": "stone " * prompt_words, "parameters": {"max_new_tokens": max_new_tokens}}
    response = server.post("/generate", body)
    assert response.status_code == 400
    assert message in response.json()["error"]


def test_chat_without_max_tokens_gets_the_room_the_budget_leaves(server):
    body = {"messages": [{"role": "user", "content": "stone " * 30}], "ignore_eos": True}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    # OpenAI's default max_tokens: whatever min(max_req_total_len=800, max_total_token_num) leaves.
    assert usage["total_tokens"] == BUDGET
    assert usage["completion_tokens"] == BUDGET - usage["prompt_tokens"] > 0
