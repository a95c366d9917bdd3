"""--max_queued_requests: a request that would make more than that many open requests wait for
their first token gets 429 with Retry-After at once, and never reaches the router.

The first test drives HttpServerManager over its real sockets, with this test as the router;
the second sends a burst to a server whose queue holds 3."""

import asyncio
import concurrent.futures
import json
import shutil
import time

import pytest
import requests
import zmq
import zmq.asyncio

from lightllm.server.config import ServerConfig
from lightllm.server.httpserver.json_body import RequestError
from lightllm.server.httpserver.manager import HttpServerManager, QueueFull
from lightllm.server.httpserver.metrics import Metrics
from lightllm.server.io_struct import BatchTextOut, GenerateReq, SamplingParams, TextOut
from lightllm.tools.bench_model import write_bench_model
from server_utils import sse_events, start_server

MAX_QUEUED = 3


def first_output(req_id: int) -> BatchTextOut:
    return BatchTextOut([TextOut(req_id, 11, "a", 0.0, False, 1)])


async def manager_scenario() -> None:
    config = ServerConfig(max_queued_requests=2)
    config.allocate_addresses()
    router = zmq.asyncio.Context.instance().socket(zmq.PULL)
    router.bind(config.router_address)
    to_http = zmq.asyncio.Context.instance().socket(zmq.PUSH)
    manager = HttpServerManager(config, Metrics(max_total_token_num=100), heartbeat=None)
    await manager.start()
    to_http.connect(config.http_address)
    try:
        manager.check_queue(2)
        with pytest.raises(RequestError):  # more than the limit at once can never fit
            manager.check_queue(3)
        streams = [manager.generate([1, 2], SamplingParams()) for _ in range(2)]
        firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
        sent = [await router.recv_pyobj() for _ in streams]
        assert all(isinstance(req, GenerateReq) for req in sent)
        assert manager.metrics.registry.get_sample_value("lightllm:num_requests_queued") == 2

        with pytest.raises(QueueFull) as refused:
            await anext(manager.generate([3], SamplingParams()))
        assert refused.value.retry_after == 1  # no request has left the queue yet: no rate to go by
        with pytest.raises(QueueFull):
            manager.check_queue()
        await to_http.send_pyobj(first_output(sent[0].req_id))
        assert (await firsts[0]).count_output_tokens == 1
        manager.check_queue()  # the first request is running: one place is free
        with pytest.raises(QueueFull):
            manager.check_queue(2)

        third = manager.generate([4], SamplingParams())
        third_first = asyncio.ensure_future(anext(third))
        admitted = await router.recv_pyobj()
        # Only the accepted requests reached the router, in order.
        assert [req.prompt_ids for req in sent] + [admitted.prompt_ids] == [[1, 2], [1, 2], [4]]
        # A request that ends before its first token leaves the queue too.
        for waiting in (firsts[1], third_first):  # as a client that goes away does
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        manager.check_queue(2)
        assert manager.metrics.registry.get_sample_value("lightllm:num_requests_queued") == 0
    finally:
        await manager.stop()
        router.close(linger=0)
        to_http.close(linger=0)
        shutil.rmtree(config.socket_dir, ignore_errors=True)


def test_the_manager_refuses_past_max_queued_requests_and_sends_nothing():
    asyncio.run(manager_scenario())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")
    args = ["--model_dir", str(model_dir), "--max_queued_requests", str(MAX_QUEUED), "--running_max_req_size", "2"]
    server = start_server(args, tmp_path_factory.mktemp("backpressure") / "server.log")
    yield server
    assert server.stop() == 0


MAX_NEW_TOKENS = 200
SLOW = {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}  # two at a time: the rest wait for admission


def send(server, i: int) -> tuple[str, requests.Response, int | None]:
    """One request of the burst: its route, its answer, and the tokens it got (None if refused)."""
    route = ("/generate", "/generate_stream", "/v1/completions")[i % 3]
    if route == "/v1/completions":
        body = {"prompt": f"burst {i}", "max_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "temperature": 0}
        response = server.post(route, body)
        tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else None
        return route, response, tokens
    if route == "/generate_stream":
        response = server.stream({"inputs": f"burst {i}", "parameters": SLOW})
        tokens = len(list(sse_events(response))) if response.status_code == 200 else None
        return route, response, tokens
    response = server.post(route, {"inputs": f"burst {i}", "parameters": SLOW})
    return route, response, response.json()["count_output_tokens"] if response.status_code == 200 else None


def test_a_burst_past_the_queue_gets_429_and_every_accepted_request_completes(server):
    burst = 15
    refused_before = server.metrics()["lightllm:requests_queue_full_total"]
    with concurrent.futures.ThreadPoolExecutor(burst) as pool:
        futures = [pool.submit(send, server, i) for i in range(burst)]
        queued = []
        while not all(future.done() for future in futures):
            stats = server.metrics()
            queued.append((stats["lightllm:num_requests_queued"], stats["lightllm:num_requests_waiting"]))
            time.sleep(0.02)  # polling interval, not synchronisation
        results = [future.result() for future in futures]

    accepted = [(route, response, tokens) for route, response, tokens in results if response.status_code == 200]
    refused = [(route, response) for route, response, _ in results if response.status_code != 200]
    assert refused and len(accepted) >= MAX_QUEUED
    for route, response, tokens in accepted:
        assert tokens == MAX_NEW_TOKENS, (route, tokens)
    for route, response in refused:
        assert response.status_code == 429, (route, response.text)
        assert 1 <= int(response.headers["Retry-After"]) <= 60
        body = json.loads(response.content)
        message = body["error"]["message"] if route.startswith("/v1/") else body["error"]
        assert f"max_queued_requests={MAX_QUEUED}" in message
    # The bound holds at every moment: in the HTTP server, and so in the router.
    assert max(q for q, _ in queued) <= MAX_QUEUED and max(w for _, w in queued) <= MAX_QUEUED
    after = server.metrics()
    assert after["lightllm:requests_queue_full_total"] == refused_before + len(refused)
    assert after['lightllm:request_success_total{finished_reason="length"}'] >= len(accepted)
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    server.wait_for(lambda: (m := server.metrics())["lightllm:kv_cache_used_tokens"] == 0
                    and m["lightllm:num_requests_queued"] == 0, what="every request done")
    assert server.generate("after the burst", max_new_tokens=2)["count_output_tokens"] == 2
