"""The front door against what a client can send: bodies past --max_request_body_bytes get 413
before they are read, text that is not valid Unicode gets 400, a body that is not JSON gets 415
(curl -d's form type holding JSON is read as JSON), a prompt longer than max_req_input_len
tokens could spell is refused before it is tokenized, and prompts are tokenized off the event
loop (the server keeps answering /health meanwhile)."""

import http.client
import json
import time
import urllib.parse

import pytest
import requests
from transformers import AutoTokenizer

SURROGATE = "a \ud800 b"
VALID_BODIES = {
    "/generate": {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}},
    "/generate_stream": {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}},
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
}
CURL_FORM_TYPE = "application/x-www-form-urlencoded"  # what `curl -d` sends without -H 'Content-Type: ...'


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def post_raw(url: str, path: str, headers: dict, chunks, answer_wait_s: float = 0.0) -> tuple[int, dict, bool]:
    """POST a body given as chunks; stop sending once the server has answered. Also says whether
    the answer came before a byte of the body was sent (waiting up to answer_wait_s for it)."""
    import select

    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.putrequest("POST", path)
    for name, value in headers.items():
        conn.putheader(name, value)
    conn.endheaders()
    answered_first = bool(select.select([conn.sock], [], [], answer_wait_s)[0])
    try:
        for chunk in chunks:
            conn.send(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the whole body went out
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    return response.status, body, answered_first


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_100_mb_body_gets_413_at_once_and_memory_stays(default_server, path):
    # The route has answered once before RSS is read: a first request's own growth (the response
    # model's validators built, its first generation) is not the body's (25 MiB where it was not).
    assert default_server.post(path, VALID_BODIES[path]).status_code == 200
    before = rss_bytes(default_server.proc.pid)
    size = 100 << 20
    chunks = (b"x" * (1 << 20) for _ in range(100))
    # "At once" as an order, not a time, so that load cannot move it: the 413 comes before a byte
    # of the body is sent. A server that reads the body first never answers before it; the 30 s
    # wait is only a guard against hanging (the server reads 100 MiB off loopback in ~30 ms, so a
    # time bound on the whole exchange could not tell reading it from not reading it).
    status, body, answered_first = post_raw(default_server.url, path, {"Content-Type": "application/json",
                                                                       "Content-Length": str(size)}, chunks,
                                            answer_wait_s=30)
    assert status == 413 and answered_first
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


def error_message(path: str, response: requests.Response) -> str:
    error = response.json()["error"]
    return error["message"] if path.startswith("/v1/") else error


@pytest.mark.parametrize("headers", [{"Content-Type": CURL_FORM_TYPE}, {}], ids=["curl -d", "no type"])
def test_curl_d_and_a_missing_type_are_read_as_json(default_server, headers):
    body = json.dumps(VALID_BODIES["/generate"])
    as_json = requests.post(f"{default_server.url}/generate", data=body, timeout=60,
                            headers={"Content-Type": "application/json"})
    response = requests.post(f"{default_server.url}/generate", data=body, headers=headers, timeout=60)
    assert response.request.headers.get("Content-Type") == headers.get("Content-Type")
    assert response.status_code == as_json.status_code == 200
    assert response.json()["generated_text"] == as_json.json()["generated_text"]


@pytest.mark.parametrize("path", list(VALID_BODIES))
@pytest.mark.parametrize("content_type", ["text/plain", "multipart/form-data; boundary=x", "application/xml"])
def test_a_body_that_is_not_json_gets_415(default_server, path, content_type):
    response = requests.post(f"{default_server.url}{path}", data=json.dumps(VALID_BODIES[path]), timeout=30,
                             headers={"Content-Type": content_type})
    assert response.status_code == 415
    assert f"Content-Type '{content_type.split(';')[0]}' is not supported" in error_message(path, response)


def test_a_real_form_gets_415(default_server):
    response = requests.post(f"{default_server.url}/generate", data={"inputs": "hi"}, timeout=30)
    assert response.request.headers["Content-Type"] == CURL_FORM_TYPE
    assert response.status_code == 415 and "must hold JSON" in response.json()["error"]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def prompt_char_bound(tokenizer) -> int:
    """max_req_input_len (2048) tokens of at most the longest vocabulary entry's length each."""
    return 2048 * max(map(len, tokenizer.get_vocab()))


def seconds_to_tokenize(tokenizer, text: str) -> float:
    start = time.monotonic()
    tokenizer(text)
    return time.monotonic() - start


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_prompt_past_the_character_bound_is_not_tokenized(default_server, tokenizer, prompt_char_bound, path):
    def send(prompt: str) -> tuple[requests.Response, float]:
        body = {
            "/generate": {"inputs": prompt},
            "/v1/completions": {"prompt": prompt},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": prompt[:10]},
                                                  {"role": "user", "content": prompt[10:]}]},
        }[path]
        start = time.monotonic()
        response = requests.post(f"{default_server.url}{path}", json=body, timeout=60)
        return response, time.monotonic() - start

    at_bound, _ = send(("word " * prompt_char_bound)[:prompt_char_bound])
    assert at_bound.status_code == 400 and "tokens, more than max_req_input_len" in error_message(path, at_bound)
    past, _ = send("x" * (prompt_char_bound + 1))
    assert past.status_code == 400
    assert f"has {prompt_char_bound + 1} characters" in error_message(path, past)
    assert "it was not tokenized" in error_message(path, past)
    # 5 MB: refused at once. The baseline, taken here under the same load: tokenizing a tenth of
    # it with the server's tokenizer. A server that tokenized it before refusing would take about
    # ten times that (8.6 s against 0.43 s); refused on its length, it takes the send and parse of
    # 5 MB of JSON, 0.05-0.1 s against 0.5-0.75 s at a load average of 4 (2026-12-02).
    prompt = "word " * 1_000_000
    tenth_s = seconds_to_tokenize(tokenizer, prompt[: len(prompt) // 10])
    huge, took = send(prompt)
    assert huge.status_code == 400 and "it was not tokenized" in error_message(path, huge)
    assert took < 3 * tenth_s, f"refused in {took:.2f} s; a tenth of it tokenizes in {tenth_s:.2f} s"


def test_prompts_are_tokenized_off_the_event_loop(default_server, prompt_char_bound):
    """Prompts just under the character bound keep the tokenizer busy for a while, one after
    another, each refused for its token count; /health answers meanwhile."""
    import threading

    # CJK text is a token a character: of the texts at the bound, among the slowest to tokenize
    # (0.36 s here, against 0.08 s for "word word ..."), so that a /health stuck behind one waits long.
    text = "".join(chr(0x4E00 + i * 7919 % 20000) for i in range(prompt_char_bound))
    body = json.dumps({"inputs": text})
    statuses, request_times = [], []

    def send_long():
        for _ in range(12):
            start = time.monotonic()
            statuses.append(requests.post(f"{default_server.url}/generate", data=body, timeout=120,
                                          headers={"Content-Type": "application/json"}).status_code)
            request_times.append(time.monotonic() - start)

    thread = threading.Thread(target=send_long)
    thread.start()
    health_times = []
    while thread.is_alive() and len(health_times) < 50:
        start = time.monotonic()
        assert requests.get(f"{default_server.url}/health", timeout=30).status_code == 200
        health_times.append(time.monotonic() - start)
    thread.join()
    assert statuses == [400] * 12  # tokenized, then refused as longer than max_req_input_len
    # The requests come back to back, so a /health stuck behind a tokenization on the event loop
    # waits for most of one: the mean of the /health times would be half a request's time or more.
    # Answered at once, it is a few ms. Mean and median, not maximum, so that one late answer on a
    # loaded machine moves neither much, and both sides slow down together under load.
    request_s, health_s = sorted(request_times)[len(request_times) // 2], sum(health_times) / len(health_times)
    assert len(health_times) >= 2 and health_s < request_s / 10, (health_times, request_times)
