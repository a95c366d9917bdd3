"""Schemathesis against the server's own /openapi.json, on the default model.

Every route the schema lists gets requests generated from it: bodies that fit the schema
(positive) and bodies that break it (negative: wrong types, out-of-range values, missing or
unknown fields). None may get a 5xx or hang; every refused body gets the route's JSON error
shape. Afterwards the server is healthy, holds no KV tokens, and its greedy output is unchanged.

The server runs with short length limits (48 prompt tokens, 4 new ones) so that the whole run
fits in CI's minutes on two cores; longer values are refused by the length checks, which the
fuzzing then covers too.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import logging
import random
import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from server_utils import start_server

logger = logging.getLogger(__name__)

EXAMPLES = {"POST": 130, "GET": 10, "HEAD": 10}  # per operation and generation mode
MIN_REQUESTS = 1000
IN_FLIGHT = 16
REQUEST_TIMEOUT = 60.0  # seconds: far past any answer of this server; reaching it is a hang
GREEDY = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    # A small queue bound: n up to 128 choices of fuzzed requests would otherwise flood 2 cores (n > 16 is a 400)
    args = ["--model_dir", str(default_model_dir), "--max_req_input_len", "48", "--max_req_total_len", "52",
            "--max_queued_requests", "16"]
    server = start_server(args, tmp_path_factory.mktemp("fuzz") / "server.log")
    yield server
    assert server.stop() == 0


class Tally:
    """Requests sent, by route and status."""

    def __init__(self):
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.seconds_waiting = 0.0  # summed over requests in flight together

    def add(self, route: str, status: int, seconds: float) -> None:
        self.statuses[route][status] += 1
        self.seconds_waiting += seconds

    @property
    def requests(self) -> int:
        return sum(sum(counter.values()) for counter in self.statuses.values())

    def summary(self) -> dict:
        return {route: dict(sorted(counter.items())) for route, counter in sorted(self.statuses.items())}


def check_error_shape(path: str, response) -> None:
    body = json.loads(response.content)
    if path.startswith("/v1/"):  # OpenAI's
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == response.status_code
    else:  # TGI's
        assert set(body) == {"error", "error_type"} and body["error"]


def generate_cases(operation, mode: GenerationMode) -> list:
    cases = []

    @settings(max_examples=EXAMPLES[operation.method.upper()], deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def collect(case):
        cases.append(case)

    collect()
    return cases


def send(case, url: str) -> tuple:
    start = time.monotonic()
    response = case.call(base_url=url, timeout=REQUEST_TIMEOUT)
    return case, response, time.monotonic() - start


def send_all(cases: list, url: str, tally: Tally) -> None:
    """Several requests in flight at once, as clients send them. The server batches those it
    admits: one at a time, their sampled steps would take this CPU an hour for 1,000 requests."""
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        for case, response, seconds in pool.map(send, cases, itertools.repeat(url)):
            tally.add(f"{case.operation.method.upper()} {case.operation.path}", response.status_code, seconds)
            assert response.status_code < 500, case.as_curl_command(base_url=url)
            if response.status_code >= 400:
                check_error_shape(case.operation.path, response)


def greedy_text(url: str) -> str:
    response = requests.post(f"{url}/generate", json=GREEDY, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["generated_text"][0]


def test_generated_requests_get_no_5xx(server):
    before = greedy_text(server.url)
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    routes = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /generate", "POST /generate_stream", "POST /v1/completions", "POST /v1/chat/completions",
            "GET /health", "GET /info", "GET /metrics", "GET /v1/models"} <= routes
    cases = []
    for operation in operations:
        modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * (operation.method.upper() == "POST")
        cases += [case for mode in modes for case in generate_cases(operation, mode)]
    random.shuffle(cases)  # every route in flight beside every other
    tally, start = Tally(), time.monotonic()
    send_all(cases, server.url, tally)
    took = time.monotonic() - start
    logger.info("schemathesis: %d requests over %d routes in %.0f s (%.0f s of request latency); statuses by "
                "route: %s", tally.requests, len(tally.statuses), took, tally.seconds_waiting, json.dumps(tally.summary()))
    assert tally.requests >= MIN_REQUESTS and set(tally.statuses) == routes
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    server.wait_for(lambda: (m := server.metrics())["lightllm:kv_cache_used_tokens"] == 0 and m["lightllm:num_requests_running"] == 0,
                    what="every fuzzed request freed")
    assert greedy_text(server.url) == before
