"""The two guards in front of the router, on one server: the API key and the queue bound.

--api_key (or $LIGHTLLM_API_KEY): every route but /health, /info, /metrics and /version needs
`Authorization: Bearer KEY`; without it, 401 before the body is read. The key is never logged.
/health?generate=1, which runs a generation, needs it too; its probes run one generation at a time.

--max_queued_requests: a request that would make more than that many open requests wait for
their first token gets 429 with Retry-After at once, and never reaches the router. The manager
is first driven over its real sockets with this test as the router, then the server gets a burst.
"""

import asyncio
import concurrent.futures
import json
import secrets
import socket
import time

import pytest
import requests

from lightllm.server.config import API_KEY_ENV, ServerConfig, build_parser, parse_config
from lightllm.server.httpserver.auth import presented_key
from lightllm.frontend.errors import RequestError
from lightllm.server.httpserver.manager import QueueFull
from lightllm.engine.request import GenerateReq, SamplingParams
from lightllm.server.io_struct import BatchTextOut, TextOut
from lightllm.tools.bench_model import write_bench_model
from server_utils import sse_events, start_server, wired_manager

KEY = f"sk-test-{secrets.token_hex(16)}"
BEARER = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUED = 3


def test_the_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert parse_config([]).api_key is None
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert parse_config([]).api_key == KEY
    assert parse_config(["--api_key", "from-flag"]).api_key == "from-flag"
    assert KEY not in repr(parse_config([])) and KEY not in build_parser().format_help()
    monkeypatch.setenv(API_KEY_ENV, "")  # set but empty: no key
    assert parse_config([]).api_key is None
    with pytest.raises(SystemExit):
        parse_config(["--api_key", " "])


@pytest.mark.parametrize("header, token", [
    (b"Bearer abc", b"abc"), (b"bearer abc", b"abc"), (b"BEARER  abc ", b"abc"),
    (b"Basic abc", None), (b"abc", None), (b"Bearerabc", None),
])
def test_the_bearer_token_is_read_from_the_header(header, token):
    assert presented_key([(b"host", b"x"), (b"authorization", header)]) == token


def first_output(req_id: int) -> BatchTextOut:
    return BatchTextOut([TextOut(req_id, 11, "a", 0.0, False, 1)])


async def manager_scenario() -> None:
    async with wired_manager(ServerConfig(max_queued_requests=2)) as (manager, router, to_http):
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


def test_the_manager_refuses_past_max_queued_requests_and_sends_nothing():
    asyncio.run(manager_scenario())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The key through the environment, as the help advises, and debug logging, to show that no
    line has it; a queue of 3 in front of a batch of 2."""
    model_dir = write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")
    args = ["--model_dir", str(model_dir), "--log_level", "debug", "--max_request_body_bytes", "1000",
            "--max_queued_requests", str(MAX_QUEUED), "--running_max_req_size", "2", "--health_timeout", "120"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(API_KEY_ENV, KEY)
        server = start_server(args, tmp_path_factory.mktemp("guarded") / "server.log")
    yield server
    assert server.stop() == 0
    assert KEY not in server.log_text()


# Each protected route with a body it accepts.
ROUTES = [
    ("POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/openapi.json", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/flush_cache", None),
]


def call(server, method: str, path: str, body, headers=None) -> requests.Response:
    return requests.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=60)


def assert_unauthorized(path: str, response: requests.Response) -> None:
    assert response.status_code == 401, (path, response.text)
    assert response.headers["WWW-Authenticate"] == "Bearer"
    body = response.json()
    if path.startswith("/v1/"):  # OpenAI's shape
        assert body["error"]["code"] == 401 and "Authorization: Bearer" in body["error"]["message"]
    else:
        assert body["error_type"] == "authentication" and "Authorization: Bearer" in body["error"]
    assert KEY not in response.text


@pytest.mark.parametrize("method, path, body", ROUTES)
def test_every_generation_route_needs_the_key(server, method, path, body):
    wrong = {"Authorization": f"Bearer {KEY[:-1]}x"}
    for headers in (None, wrong, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
        assert_unauthorized(path, call(server, method, path, body, headers))
    assert call(server, method, path, body, {"Authorization": f"bearer {KEY}"}).status_code == 200


def test_health_info_metrics_and_version_stay_open(server):
    for path in ("/health", "/info", "/metrics", "/version"):
        assert requests.get(f"{server.url}{path}", timeout=30).status_code == 200, path
    assert requests.head(f"{server.url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("query", ["generate=1", "generate=true", "generate=0", "generate", "x=1&generate=1"])
def test_health_that_generates_needs_the_key(server, query):
    url = f"{server.url}/health?{query}"
    for headers in (None, {"Authorization": f"Bearer {KEY[:-1]}x"}):
        assert_unauthorized("/health", requests.get(url, headers=headers, timeout=30))
    head = requests.head(url, timeout=30)
    assert head.status_code == 401 and head.headers["WWW-Authenticate"] == "Bearer"
    assert requests.get(url, headers=BEARER, timeout=60).status_code in (200, 400)  # 400: "" is no bool
    assert requests.get(f"{server.url}/health?generate=1", headers=BEARER, timeout=60).json() == {"status": "ok"}


def probe(server) -> requests.Response:
    return requests.get(f"{server.url}/health?generate=1", headers=BEARER, timeout=120)


def test_a_burst_of_health_probes_runs_one_generation(server):
    """With both running places held by long streams, a probe's generation waits in the router, and
    so do the probes that come meanwhile: they all share that one generation."""
    burst = 8
    routed = 'lightllm:replica_requests_routed_total{replica="0"}'
    long = {"inputs": "hold", "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    streams = [requests.post(f"{server.url}/generate_stream", json=long, headers=BEARER, stream=True, timeout=120)
               for _ in range(2)]
    try:
        events = [sse_events(stream) for stream in streams]  # kept: a dropped one closes its connection
        for stream_events in events:
            next(stream_events)
        before = server.metrics()[routed]
        with concurrent.futures.ThreadPoolExecutor(burst) as pool:
            probes = [pool.submit(probe, server) for _ in range(burst)]
            server.wait_for(lambda: (m := server.metrics())["lightllm:health_probes_waiting"] == burst
                            and m["lightllm:num_requests_waiting"] == 1, what=f"{burst} probes waiting")
            assert server.metrics()[routed] == before + 1
            for stream in streams:  # frees the running places: the probe's generation runs
                stream.close()
            answers = [future.result() for future in probes]
    finally:
        for stream in streams:
            stream.close()
    assert [(a.status_code, a.json()) for a in answers] == [(200, {"status": "ok"})] * burst
    after = server.metrics()
    assert after[routed] == before + 1 and after["lightllm:health_probes_waiting"] == 0
    server.wait_for(lambda: server.metrics()["lightllm:kv_cache_used_tokens"] == 0, what="the streams aborted")


def answer_head(server, head: str, body: bytes) -> bytes:
    """The status line and headers answered to a request whose body stays unfinished (the
    connection stays open): a server that waited for the rest would time this out."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as connection:
        connection.sendall(head.encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := connection.recv(65536)):
            answer += chunk
    return answer


def test_the_key_is_checked_before_the_body_is_read(server):
    rejected = server.metrics()["lightllm:requests_rejected_total"]
    # Broken JSON and an oversized body: 401, not 400 or 413.
    assert_unauthorized("/generate", server.post("/generate", b"{not json"))
    assert_unauthorized("/v1/completions", server.post("/v1/completions", json.dumps({"prompt": "x" * 5000})))
    # A body announced but never sent: the answer comes without waiting for it.
    head = "POST /generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: 900\r\n\r\n"
    answer = answer_head(server, head, b'{"inputs": ')
    assert answer.startswith(b"HTTP/1.1 401") and b"www-authenticate: bearer" in answer.lower()
    assert server.metrics()["lightllm:requests_rejected_total"] == rejected  # nothing reached the JSON checks
    # With the key, the same broken body is a 400 from the JSON checks.
    response = requests.post(f"{server.url}/generate", data=b"{not json", headers=BEARER, timeout=30)
    assert response.status_code == 400 and response.json()["error_type"] == "validation"


MAX_NEW_TOKENS = 200
SLOW = {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}  # two at a time: the rest wait for admission


def send(server, i: int) -> tuple[str, requests.Response, int | None]:
    """One request of the burst: its route, its answer, and the tokens it got (None if refused)."""
    route = ("/generate", "/generate_stream", "/v1/completions")[i % 3]
    if route == "/v1/completions":
        body = {"prompt": f"burst {i}", "max_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "temperature": 0}
    else:
        body = {"inputs": f"burst {i}", "parameters": SLOW}
    response = requests.post(f"{server.url}{route}", json=body, headers=BEARER, stream=True, timeout=120)
    if response.status_code != 200:
        return route, response, None
    if route == "/generate_stream":
        return route, response, len(list(sse_events(response)))
    reply = response.json()
    return route, response, reply["usage"]["completion_tokens"] if route == "/v1/completions" else reply["count_output_tokens"]


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
    after_burst = {"inputs": "after the burst", "parameters": {"max_new_tokens": 2}}
    reply = requests.post(f"{server.url}/generate", json=after_burst, headers=BEARER, timeout=60).json()
    assert reply["count_output_tokens"] == 2
