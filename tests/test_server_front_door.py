"""The front door against what a client can send: bodies past --max_request_body_bytes get 413
before they are read, text that is not valid Unicode gets 400, and a long prompt is tokenized
off the event loop (the server keeps answering /health meanwhile)."""

import http.client
import json
import time
import urllib.parse

import pytest
import requests

SURROGATE = "a \ud800 b"


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def post_raw(url: str, path: str, headers: dict, chunks) -> tuple[int, dict, float]:
    """POST a body given as chunks; stop sending once the server has answered."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    start = time.monotonic()
    conn.putrequest("POST", path)
    for name, value in headers.items():
        conn.putheader(name, value)
    conn.endheaders()
    try:
        for chunk in chunks:
            conn.send(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the whole body went out
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    return response.status, body, time.monotonic() - start


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_100_mb_body_gets_413_at_once_and_memory_stays(default_server, path):
    before = rss_bytes(default_server.proc.pid)
    size = 100 << 20
    chunks = (b"x" * (1 << 20) for _ in range(100))
    status, body, took = post_raw(default_server.url, path, {"Content-Type": "application/json",
                                                             "Content-Length": str(size)}, chunks)
    assert status == 413 and took < 1.0
    message = body["error"]["message"] if path.startswith("/v1/") else body["error"]
    assert "max_request_body_bytes" in message
    assert rss_bytes(default_server.proc.pid) < before + (20 << 20)
    assert requests.get(f"{default_server.url}/health", timeout=30).status_code == 200


def test_a_chunked_body_past_the_bound_gets_413(default_server):
    chunk = b"y" * (1 << 20)
    framed = (b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(12))  # 12 MiB > the 8 MiB default
    status, body, _ = post_raw(default_server.url, "/generate", {"Content-Type": "application/json",
                                                                 "Transfer-Encoding": "chunked"}, framed)
    assert status == 413 and "max_request_body_bytes" in body["error"]
    assert requests.get(f"{default_server.url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/generate", {"inputs": SURROGATE}),
    ("/generate_stream", {"inputs": SURROGATE}),
    ("/generate", {"inputs": "hi", "parameters": {"stop_sequences": [SURROGATE]}}),
    ("/v1/completions", {"prompt": SURROGATE}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [SURROGATE]}),
])
def test_lone_surrogates_get_a_400(default_server, path, body):
    raw = json.dumps(body)  # json escapes the surrogate as \ud800, which is valid JSON
    response = requests.post(f"{default_server.url}{path}", data=raw, timeout=30,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    assert "not valid Unicode" in message


def test_a_long_prompt_does_not_stall_health(default_server):
    """A 1.5 MB prompt takes the tokenizer a while (and is then refused as too long); /health
    answers meanwhile."""
    import threading

    long_body = json.dumps({"inputs": "word " * 300_000})
    answer = {}

    def send_long():
        answer["status"] = requests.post(f"{default_server.url}/generate", data=long_body, timeout=120,
                                         headers={"Content-Type": "application/json"}).status_code

    thread = threading.Thread(target=send_long)
    thread.start()
    health_times = []
    while thread.is_alive() and len(health_times) < 20:
        start = time.monotonic()
        assert requests.get(f"{default_server.url}/health", timeout=30).status_code == 200
        health_times.append(time.monotonic() - start)
    thread.join()
    assert answer["status"] == 400  # past max_req_input_len
    assert len(health_times) >= 2 and max(health_times) < 0.5
