"""HTTPS without a proxy (--ssl_keyfile / --ssl_certfile, a self-signed certificate made here) and
CORS (--allowed_origins), closed by default."""

import os
import shutil
import subprocess

import pytest
import requests

from lightllm.tools.bench_model import write_bench_model
from server_utils import start_server

ALLOWED = "https://app.example.com"
KEY = "tls-test-key"


def self_signed(out) -> tuple[str, str]:
    """(key file, certificate file) for 127.0.0.1, with the openssl command-line tool."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    key, cert = out / "key.pem", out / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return str(key), str(cert)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def tls_server(tiny_dir, tmp_path_factory):
    """HTTPS, a key, and one allowed origin; requests trusts the certificate through REQUESTS_CA_BUNDLE."""
    out = tmp_path_factory.mktemp("tls")
    key, cert = self_signed(out)
    previous = os.environ.get("REQUESTS_CA_BUNDLE")
    os.environ["REQUESTS_CA_BUNDLE"] = cert
    args = ["--model_dir", str(tiny_dir), "--ssl_keyfile", key, "--ssl_certfile", cert,
            "--allowed_origins", f"{ALLOWED}, https://other.example.com", "--api_key", KEY]
    server = start_server(args, out / "server.log")
    yield server
    assert server.stop() == 0
    if previous is None:
        del os.environ["REQUESTS_CA_BUNDLE"]
    else:
        os.environ["REQUESTS_CA_BUNDLE"] = previous


def test_https_serves_with_the_certificate_and_plain_http_is_refused(tls_server):
    assert tls_server.url.startswith("https://")
    assert f"on {tls_server.url}" in tls_server.wait_for_log_line("serving ")
    reply = requests.post(f"{tls_server.url}/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert reply.status_code == 200 and reply.json()["count_output_tokens"] == 3
    with pytest.raises(requests.exceptions.SSLError):  # a certificate the client does not trust
        requests.get(f"{tls_server.url}/health", verify=requests.certs.where(), timeout=30)
    with pytest.raises(requests.ConnectionError):  # no plain HTTP on the port
        requests.get(tls_server.url.replace("https://", "http://") + "/health", timeout=30)


def preflight(url: str, origin: str) -> requests.Response:
    return requests.options(f"{url}/v1/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_preflight_from_an_allowed_origin_is_answered_without_the_key(tls_server):
    reply = preflight(tls_server.url, ALLOWED)
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in reply.headers["access-control-allow-methods"]
    assert "authorization" in reply.headers["access-control-allow-headers"].lower()
    # the call itself needs the key; its 401 carries the CORS header, so that the page can read it
    denied = requests.post(f"{tls_server.url}/v1/completions", json={"prompt": "hi"}, headers={"Origin": ALLOWED},
                           timeout=30)
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ALLOWED


def test_preflight_from_another_origin_is_refused(tls_server):
    reply = preflight(tls_server.url, "https://evil.example.com")
    assert reply.status_code == 400
    assert "access-control-allow-origin" not in reply.headers
    simple = requests.get(f"{tls_server.url}/health", headers={"Origin": "https://evil.example.com"}, timeout=30)
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers


def test_cors_is_closed_by_default(default_server):
    """The suite's shared server has no --allowed_origins: no CORS header, so a browser refuses."""
    reply = preflight(default_server.url, ALLOWED)
    assert reply.status_code == 405
    assert not [h for h in reply.headers if h.lower().startswith("access-control-")]
    simple = requests.get(f"{default_server.url}/health", headers={"Origin": ALLOWED}, timeout=30)
    assert simple.status_code == 200
    assert not [h for h in simple.headers if h.lower().startswith("access-control-")]
