"""--api_key (or $LIGHTLLM_API_KEY): every route but /health, /info and /metrics needs
`Authorization: Bearer KEY`; without it, 401 before the body is read. The key is never logged."""

import json
import secrets
import socket

import pytest
import requests

from lightllm.server.config import API_KEY_ENV, build_parser, parse_config
from lightllm.server.httpserver.auth import presented_key
from lightllm.tools.bench_model import write_bench_model
from server_utils import start_server

KEY = f"sk-test-{secrets.token_hex(16)}"


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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The key through the environment, as the help advises; debug logging, to show that no line has it."""
    model_dir = write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")
    args = ["--model_dir", str(model_dir), "--log_level", "debug", "--max_request_body_bytes", "1000"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(API_KEY_ENV, KEY)
        server = start_server(args, tmp_path_factory.mktemp("auth") / "server.log")
    yield server
    assert server.stop() == 0
    assert KEY not in server.log_text()


BEARER = {"Authorization": f"Bearer {KEY}"}
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


def test_health_info_and_metrics_stay_open(server):
    for path in ("/health", "/info", "/metrics"):
        assert requests.get(f"{server.url}{path}", timeout=30).status_code == 200, path
    assert requests.head(f"{server.url}/health", timeout=30).status_code == 200


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
