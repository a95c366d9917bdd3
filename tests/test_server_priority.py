"""vLLM's `priority` through the server: with --schedule_policy priority, requests that wait are
admitted lowest value first, and one that finds no room preempts a less urgent running one, which
answers later what it answers alone; under another policy a value other than 0 is a 400."""

import json
import threading
import time

import pytest
import requests

from lightllm.tools.bench_model import write_bench_model
from server_utils import start_server

LONG_TOKENS = 1500  # the running request: long enough that the others all arrive while it runs
SHORT_TOKENS = 120  # each waiting one: its run outlasts a busy machine's delay in waking the thread that reads it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")
    args = ["--model_dir", str(model_dir), "--schedule_policy", "priority", "--running_max_req_size", "1"]
    server = start_server(args, tmp_path_factory.mktemp("priority") / "server.log")
    yield server
    assert server.stop() == 0


def first_token_time(url: str, body: dict, out: dict, key) -> None:
    """Stream a completion; note when its first text came, when it ended, and its text."""
    text = []
    with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=300) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines():
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                out.setdefault(key, time.monotonic())
                text.append(json.loads(line[6:])["choices"][0]["text"])
    out[("end", key)], out[("text", key)] = time.monotonic(), "".join(text)


def test_waiting_requests_are_admitted_lowest_priority_first(server):
    """One running slot, taken by a long request more urgent than the rest (never preempted);
    four more arrive while it runs, their values 2, 0, -1, 0 in that order: they start -1, then
    the two 0s in arrival order, then 2. The same prompt for all, so their order is the
    scheduler's alone."""
    body = {"prompt": "the river", "ignore_eos": True, "temperature": 0}
    times = {}
    long = threading.Thread(target=first_token_time, args=(server.url, {**body, "max_tokens": LONG_TOKENS,
                                                                          "priority": -9}, times, "long"))
    long.start()
    while "long" not in times:
        time.sleep(0.01)
    waiting = []
    for count, (name, priority) in enumerate((("a", 2), ("b", 0), ("c", -1), ("d", 0)), 1):
        waiting.append(threading.Thread(target=first_token_time, args=(server.url, {**body, "max_tokens": SHORT_TOKENS,
                                                                                    "priority": priority},
                                                                       times, name)))
        waiting[-1].start()
        server.wait_for(lambda: server.metrics()["lightllm:num_requests_waiting"] == count,
                        what=f"{count} requests waiting")  # so they arrive in this order
    arrived = time.monotonic()
    for thread in [long, *waiting]:
        thread.join()
    assert times[("end", "long")] > arrived, "the long request ended before the others had all arrived"
    assert sorted("abcd", key=times.get) == ["c", "b", "d", "a"]


def test_an_urgent_request_preempts_a_less_urgent_one(server):
    """One running slot, taken by a long request of priority 9; one of priority 0 arriving while
    it runs preempts it and ends first; the long one then goes on, and its text is the one it has
    alone."""
    body = {"prompt": "the river", "ignore_eos": True, "temperature": 0, "max_tokens": LONG_TOKENS, "priority": 9}
    alone = requests.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert alone.status_code == 200, alone.text
    before = server.metrics().get("lightllm:num_preemptions_total", 0)
    times = {}
    long = threading.Thread(target=first_token_time, args=(server.url, body, times, "long"))
    long.start()
    while "long" not in times:
        time.sleep(0.01)
    first_token_time(server.url, {"prompt": "the sea", "max_tokens": 3, "priority": 0}, times, "urgent")
    long.join()
    assert times[("end", "urgent")] < times[("end", "long")]
    assert times[("text", "long")] == alone.json()["choices"][0]["text"]
    assert server.metrics()["lightllm:num_preemptions_total"] == before + 1


def test_priority_other_than_zero_needs_the_policy(default_server):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": -3}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                 "priority": 1})):
        response = requests.post(f"{default_server.url}{path}", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert "--schedule_policy priority" in response.json()["error"]["message"]
    bounded = requests.post(f"{default_server.url}/v1/completions",
                            json={"prompt": "hi", "max_tokens": 1, "priority": 2**31}, timeout=60)
    assert bounded.status_code == 400 and "'priority'" in bounded.json()["error"]["message"]
