"""Slow and hostile clients: a body that is slow to validate leaves the event loop free and gets a
small 400; a request that never finishes arriving gets 408 within --request_receive_timeout; an
idle keep-alive connection is closed after --keep_alive_timeout; a connection past
--max_connections is refused; and none of it, nor a /health probe or an over-long prompt, writes
more to the log than a line."""

import json
import socket
import statistics
import threading
import time
import urllib.parse

import pytest
import requests

from lightllm.server.httpserver.json_body import describe_errors
from lightllm.server.httpserver.json_text import MAX_CLAUSES

RECEIVE_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 1.0
MAX_CONNECTIONS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny preset: what is tested is the HTTP front door, which the weights never reach (the
    tokenizer, whose warning one test looks for, is the default model's)."""
    from server_utils import preset_server

    args = ("--request_receive_timeout", str(RECEIVE_TIMEOUT_S), "--keep_alive_timeout", str(KEEP_ALIVE_S),
            "--max_connections", str(MAX_CONNECTIONS))
    with preset_server(tmp_path_factory, "tiny", args) as (_, server):
        yield server


def connect(url: str, timeout: float = 30.0) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def read_response(sock: socket.socket) -> tuple[int, dict | None]:
    """(status, JSON body) of the one response the server sends before closing."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body) if body else None


def get_health(sock: socket.socket) -> bytes:
    """GET /health on an open connection; its whole response (the connection stays open)."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def health_seconds(url: str) -> float:
    start = time.monotonic()
    assert requests.get(f"{url}/health", timeout=60).status_code == 200
    return time.monotonic() - start


def test_errors_name_a_few_fields_and_count_the_rest():
    errors = [{"loc": ("body", f"field_{i}"), "type": "extra_forbidden"} for i in range(1000)]
    message = describe_errors(errors)
    assert message.count("unknown field") == MAX_CLAUSES and message.endswith(f"and {1000 - MAX_CLAUSES} more errors")
    assert describe_errors(errors[:MAX_CLAUSES]).count("unknown field") == MAX_CLAUSES


def test_600k_unknown_keys_get_a_small_400_and_health_goes_on(server):
    idle_s = statistics.median(health_seconds(server.url) for _ in range(20))
    fields = {"inputs": "hi", **{f"k{i}": 1 for i in range(600_000)}}
    body = json.dumps(fields, separators=(",", ":")).encode()  # 7.2 MB, under the 8 MiB bound
    start = time.monotonic()
    json.loads(body)
    parse_s = time.monotonic() - start
    answer = {}

    def send():
        start = time.monotonic()
        answer["response"] = requests.post(f"{server.url}/generate", data=body, timeout=120,
                                           headers={"Content-Type": "application/json"})
        answer["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=send)
    thread.start()
    during = []
    while thread.is_alive():
        during.append(health_seconds(server.url))
    thread.join()
    response = answer["response"]
    assert response.status_code == 400 and len(response.content) < 2048, response.content[:300]
    assert "and 599995 more unknown fields" in response.json()["error"], response.json()
    # On the event loop a probe waited for the whole request: 6.7 s, against a parse of the body of
    # 0.3 s; on a thread, for json.loads, which holds the GIL throughout. Parsed in another process,
    # the body costs the server's loop only a copy into a pipe and a small error back.
    assert max(during) < parse_s / 2 + 20 * idle_s, (idle_s, parse_s, during, answer["seconds"])


def test_a_huge_logit_bias_gets_a_small_400(server):
    for entries, expected in ((700_000, "object keys, more than 65536"), (1025, "at most 1024 items")):
        body = {"inputs": "hi", "parameters": {"logit_bias": {str(i): 1 for i in range(entries)}}}
        response = requests.post(f"{server.url}/generate", data=json.dumps(body, separators=(",", ":")), timeout=120)
        assert response.status_code == 400 and len(response.content) < 2048
        assert expected in response.json()["error"], response.json()


LYING_CONTENT_LENGTH = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"inputs\":")
LYING_CHUNK = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n{\"prompt\":"


@pytest.mark.parametrize("sent", [LYING_CONTENT_LENGTH, LYING_CHUNK, b""], ids=["content-length", "chunk", "nothing"])
def test_an_incomplete_request_gets_408_within_the_timeout(server, sent):
    with connect(server.url) as sock:
        start = time.monotonic()
        sock.sendall(sent)
        status, body = read_response(sock)
        took = time.monotonic() - start
    assert status == 408
    message = body["error"]["message"] if b"/v1/" in sent else body["error"]
    assert "--request_receive_timeout" in message
    # The timer's own time, stretched by a loaded loop by a fraction of it, not a multiple.
    assert RECEIVE_TIMEOUT_S * 0.9 < took < RECEIVE_TIMEOUT_S * 3, took


def test_headers_sent_a_line_at_a_time_get_408(server):
    with connect(server.url, timeout=RECEIVE_TIMEOUT_S / 4) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        while time.monotonic() - start < RECEIVE_TIMEOUT_S * 5:
            try:
                first = sock.recv(65536)
                break
            except socket.timeout:
                sock.sendall(b"X-Slow: 1\r\n")  # each line well within any per-read timeout
        took = time.monotonic() - start
        sock.settimeout(30)
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
    assert first.startswith(b"HTTP/1.1 408"), first
    assert RECEIVE_TIMEOUT_S * 0.9 < took < RECEIVE_TIMEOUT_S * 3, took


def test_a_second_request_on_a_connection_is_timed_too(server):
    """After a whole request and its answer, the next one on the same connection has its own timer."""
    with connect(server.url) as sock:
        assert get_health(sock).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        sock.sendall(LYING_CONTENT_LENGTH)
        status, _ = read_response(sock)
        assert status == 408 and time.monotonic() - start < RECEIVE_TIMEOUT_S * 3


def test_an_idle_keep_alive_connection_is_closed(server):
    with connect(server.url) as sock:
        assert get_health(sock).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert sock.recv(65536) == b""  # closed by the server
        took = time.monotonic() - start
    assert KEEP_ALIVE_S * 0.9 < took < KEEP_ALIVE_S * 3, took


def test_connections_past_the_bound_are_refused(server):
    held = [connect(server.url) for _ in range(MAX_CONNECTIONS)]
    try:
        with connect(server.url) as extra:
            status, body = read_response(extra)  # answered and closed before it sends anything
        assert status == 503 and "too many open connections" in body["error"]
        # Those already open are served.
        assert get_health(held[0]).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    server.wait_for(lambda: requests.get(f"{server.url}/health", timeout=30).status_code == 200,
                    what="a connection served once the others closed")


def test_a_client_that_hangs_up_mid_body_is_one_line(server):
    for _ in range(3):
        with connect(server.url) as sock:
            sock.sendall(LYING_CONTENT_LENGTH)
            sock.sendall(b'"a')  # more of the body, so the route is reading it when the client goes
    line = server.wait_for_log_line("went away before sending the whole body", timeout=30)
    assert "POST /generate" in line
    log = server.log_text()
    assert "Traceback" not in log and "ClientDisconnect" not in log


def test_health_probes_write_no_access_line(server):
    for _ in range(3):
        assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    requests.get(f"{server.url}/info", timeout=30)
    server.wait_for_log_line('"GET /info HTTP/1.1" 200', timeout=30)  # the access log works
    assert '"GET /health' not in server.log_text()


def test_an_over_long_prompt_logs_no_tokenizer_warning(server):
    # 10,000 tokens: past the tokenizer's model_max_length (8192) and --max_req_input_len (2048),
    # under the character bound, so that it is tokenized and then refused.
    response = requests.post(f"{server.url}/generate", json={"inputs": "word " * 10_000}, timeout=120)
    assert response.status_code == 400 and "max_req_input_len" in response.json()["error"]
    server.wait_for_log_line('"POST /generate HTTP/1.1" 400', timeout=30)
    assert "Token indices sequence length" not in server.log_text()
