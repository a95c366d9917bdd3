"""--dp: engine replicas behind one HTTP endpoint, on this CPU with the tiny model. Greedy answers
equal one replica's (the engine's, offline), both replicas receive work, and a replica whose
worker dies ends the server cleanly: every open request gets its error, no process is left."""

import threading
from concurrent.futures import ThreadPoolExecutor

import requests
import pytest

from lightllm.tools.bench_model import write_bench_model
from server_utils import sse_events, start_server, wait_exited

PROMPTS = [f"request number {i} asks about the weather in city {i}" for i in range(8)]
LONG = {"max_new_tokens": 2500, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")


def greedy_tokens(server) -> list[list[int]]:
    """Every prompt's greedy token ids, sent at once so that they batch (and spread over replicas)."""
    def one(prompt):
        reply = server.generate(prompt, max_new_tokens=12, details=True)
        return [t["id"] for t in reply["details"]["tokens"]]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def routed(server) -> list[float]:
    samples = server.metrics()
    return [samples[f'lightllm:replica_requests_routed_total{{replica="{d}"}}'] for d in range(2)]


@pytest.fixture(scope="module")
def dp2_server(tiny_dir, tmp_path_factory):
    """One --dp 2 server for both tests: the first leaves it running, the second kills a replica,
    which ends it. A clean stop of a --dp 2 server is test_dp_routing's check too."""
    server = start_server(["--model_dir", str(tiny_dir), "--dp", "2"], tmp_path_factory.mktemp("dp2") / "server.log")
    yield server
    running = server.proc.poll() is None
    code = server.stop()
    assert code == 0 or not running  # a clean stop, unless a test ended it


def dp1_greedy_tokens(tiny_dir) -> list[list[int]]:
    """The same through the engine with one replica, in this process (the offline API runs the
    router's engine core and a ModelRunner, as test_multinode does; a server costs ~15 s more)."""
    from lightllm import LLM, SamplingParams

    with LLM(tiny_dir) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_two_replicas_answer_as_one_and_share_the_work(tiny_dir, dp2_server):
    expected = dp1_greedy_tokens(tiny_dir)
    two = dp2_server
    before = routed(two)
    assert len(two.model_workers()) == 2 and requests.get(f"{two.url}/info", timeout=10).json()["dp"] == 2
    assert greedy_tokens(two) == expected
    counts = [after - earlier for after, earlier in zip(routed(two), before)]
    assert sum(counts) == len(PROMPTS) and min(counts) >= 1, counts
    def idle() -> bool:  # the replicas publish their gauges once a second: the last answer can lead them
        samples = two.metrics()
        return samples["lightllm:num_requests_running"] == 0 and samples["lightllm:kv_cache_used_tokens"] == 0

    two.wait_for(idle, what="no request running and no KV in use")
    assert 'lightllm:replica_kv_cache_usage_perc{replica="1"}' in two.metrics()


def test_a_dead_replica_ends_the_server_with_every_request_answered(dp2_server):
    server = dp2_server
    family = server.processes()
    before = routed(server)
    streams = [server.stream({"inputs": f"stream {i}", "parameters": LONG}) for i in range(4)]
    events = [sse_events(stream) for stream in streams]
    firsts = [next(e) for e in events]
    replies = []
    post = threading.Thread(target=lambda: replies.append(server.post("/generate", {"inputs": "whole",
                                                                                    "parameters": LONG})))
    post.start()
    server.wait_for(lambda: server.metrics()["lightllm:num_requests_running"] == 5, what="5 requests running")
    assert min(after - earlier for after, earlier in zip(routed(server), before)) >= 1  # both replicas have some
    server.model_workers()[0].kill()
    lasts = [list(e)[-1] for e in events]
    post.join(timeout=60)
    assert not any(first["finished"] for first in firsts)
    # the dead replica's requests end with its error; the other replica's end as the server stops
    for last in lasts:
        assert last["finished"] and last["finish_reason"] == "error", last
    assert len(replies) == 1 and replies[0].status_code == 500
    assert server.proc.wait(timeout=60) == 1
    gone, alive = wait_exited(family, timeout=15)
    assert not alive and server.socket_dirs() == []
