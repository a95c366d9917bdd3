"""Schemathesis against the server's own /openapi.json, on the tiny preset (bench_model: two
layers of random weights, with the default model's tokenizer and chat template). What is fuzzed
is the front door, not the weights. In CI (two cores) the requests took 164 s on the default
model and 102 s on this preset, the server's start 41 s and under 17 s.

Every route the schema lists gets requests generated from it: bodies that fit the schema
(positive) and bodies that break it (negative: wrong types, out-of-range values, missing or
unknown fields). None may get a 5xx or hang; every refused body gets the route's JSON error
shape. Afterwards the server is healthy, holds no KV tokens, and its greedy output is unchanged.

Then hypothesis strategies of hostile JSON that no schema describes go to every POST route: arrays
and objects nested thousands deep (in the body, or inside a string a grammar reads), token-id keys
of non-ASCII digits ("²", "٣"), and numbers past every range (thousands of digits, 1e999); each
of the cases that once got a 500 is also sent by hand and must get a 400 naming the problem.

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
import multiprocessing
import random
import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET

from lightllm.server.httpserver.json_text import MAX_JSON_DEPTH

from server_utils import preset_server

logger = logging.getLogger(__name__)

# Per operation and generation mode. Generating the cases, not sending them, is most of this test's
# time (on a 2-core CPU 95 s of schemathesis against 27 s of requests for 64 a POST operation), so
# the count per operation keeps the whole run at MIN_REQUESTS and a little over as routes are added:
# 11 POST operations (the LoRA adapter routes among them) x 2 modes x 32, about 750 requests.
EXAMPLES = {"POST": 32, "GET": 10, "HEAD": 10}
MIN_REQUESTS = 700
IN_FLIGHT = 16
REQUEST_TIMEOUT = 60.0  # seconds: far past any answer of this server; reaching it is a hang
GREEDY = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A small queue bound: n up to 128 choices of fuzzed requests would otherwise flood 2 cores (n > 16 is a 400)
    args = ("--max_req_input_len", "48", "--max_req_total_len", "52", "--max_queued_requests", "16")
    with preset_server(tmp_path_factory, "tiny", args) as (_, server):
        yield server


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
    if path.startswith("/v1/messages"):  # Anthropic's
        assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    elif path.startswith("/v1/"):  # OpenAI's
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


# Generating is Python in this process, while the server sits idle: two processes (forked, so that
# they hold the schema's operations already) generate the cases of half the operations each. What
# comes back is each case's data, from which this process makes the same case again.
GENERATORS = 2
CASE_FIELDS = ("method", "path_parameters", "headers", "cookies", "query", "body", "media_type",
               "multipart_content_types")
_operations: list = []  # what the forked generators read


def generated_fields(index: int, mode: GenerationMode) -> list[dict]:
    """In a generator process: the fields of the cases of operation `index` in `mode`."""
    fields = []
    for case in generate_cases(_operations[index], mode):
        values = {name: getattr(case, name) for name in CASE_FIELDS}
        values["headers"] = dict(values["headers"] or {})
        if values["body"] is NOT_SET:
            del values["body"]
        fields.append(values)
    return fields


def generate_all(operations: list) -> list:
    """Every operation's cases: POSITIVE, and for a POST with a body also NEGATIVE (as generate_cases
    makes them; a POST without one, /reset_prefix_cache, has no input to get wrong)."""
    jobs = [(index, mode) for index, operation in enumerate(operations)
            for mode in [GenerationMode.POSITIVE]
            + [GenerationMode.NEGATIVE] * (operation.method.upper() == "POST" and bool(operation.body))]
    _operations[:] = operations
    try:
        with concurrent.futures.ProcessPoolExecutor(GENERATORS, mp_context=multiprocessing.get_context("fork")) as pool:
            made = list(pool.map(generated_fields, *zip(*jobs)))
    finally:
        _operations.clear()
    return [operations[index].Case(**values) for (index, _), cases in zip(jobs, made) for values in cases]


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
            "POST /v1/responses", "POST /v1/messages", "POST /v1/messages/count_tokens",
            "GET /health", "GET /info", "GET /metrics", "GET /v1/models", "POST /", "GET /version",
            "POST /reset_prefix_cache"} <= routes
    cases = generate_all(operations)
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


# ---- hostile JSON: deep nesting, non-ASCII digits, huge numbers ----

HOSTILE_EXAMPLES = 300
# A body of each POST route holding the fields the hostile values replace; each is accepted as it is.
RICH_BODIES = {
    "/generate": {"inputs": "hi", "parameters": {
        "max_new_tokens": 2, "do_sample": True, "top_k": 5, "seed": 1, "min_tokens": 1, "stop_token_ids": [1],
        "logit_bias": {"1": 1.0}, "grammar": {"type": "json", "value": '{"type": "object"}'}}},
    "/v1/completions": {"prompt": [1, 2], "max_tokens": 2, "seed": 1, "top_k": 5, "logprobs": 1,
                        "stop_token_ids": [1], "logit_bias": {"1": 1.0}},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
                             "top_logprobs": 1, "logit_bias": {"1": 1.0},
                             "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
    "/tokenize": {"prompt": "hi", "add_special_tokens": True},
    "/detokenize": {"tokens": [1, 2]},
}
RICH_BODIES["/generate_stream"] = RICH_BODIES["/generate"]
MARKER = "@@hostile@@"


def nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "array" else '{"a":' * depth + "{}" + "}" * depth


def node_paths(value, path=()) -> list[tuple]:
    """The path of every value inside `value`, itself (the whole body) included."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return [path] + [p for key, child in children for p in node_paths(child, (*path, key))]


def with_raw_value(body: dict, path: tuple, raw: str) -> str:
    """`body` as JSON text, with the value at `path` replaced by the JSON text `raw`."""
    if not path:
        return raw
    copy = json.loads(json.dumps(body))
    *parents, last = path
    target = copy
    for key in parents:
        target = target[key]
    target[last] = MARKER
    return json.dumps(copy).replace(json.dumps(MARKER), raw)


deep_json = st.builds(nested, st.integers(MAX_JSON_DEPTH + 1, 3000), st.sampled_from(["array", "object"]))
huge_number = (st.builds(lambda sign, digits: sign + "9" * digits, st.sampled_from(["", "-"]), st.integers(19, 6000))
               | st.sampled_from(["1e999", "-1e999", "1e-999", "1" + "0" * 400 + ".5"]))
non_ascii_digits = st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=4).filter(
    lambda text: not text.isascii())
hostile_json = st.one_of(
    deep_json,
    deep_json.map(json.dumps),  # a string holding it: a json grammar's text
    huge_number,
    non_ascii_digits.map(lambda key: json.dumps({key: 1.0})),  # logit_bias keys
    non_ascii_digits.map(json.dumps),
)
hostile_cases = st.sampled_from(sorted(RICH_BODIES)).flatmap(lambda route: st.tuples(
    st.just(route), st.sampled_from(node_paths(RICH_BODIES[route])), hostile_json))


def hostile_bodies() -> list[tuple[str, str]]:
    bodies = []

    @settings(max_examples=HOSTILE_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=hostile_cases)
    def collect(case):
        route, path, raw = case
        bodies.append((route, with_raw_value(RICH_BODIES[route], path, raw)))

    collect()
    return bodies


def post_json(url: str, route: str, text: str) -> requests.Response:
    return requests.post(f"{url}{route}", data=text.encode(), headers={"Content-Type": "application/json"},
                         timeout=REQUEST_TIMEOUT)


def test_rich_bodies_are_accepted(server):
    """So that what the hostile values replace is read, not refused beside them."""
    for route, body in RICH_BODIES.items():
        response = post_json(server.url, route, json.dumps(body))
        assert response.status_code == 200, (route, response.text)


def test_hostile_json_gets_no_5xx(server):
    before = greedy_text(server.url)
    bodies = hostile_bodies()
    statuses = collections.Counter()
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        responses = pool.map(lambda case: post_json(server.url, *case), bodies)
        for (route, text), response in zip(bodies, responses):
            statuses[response.status_code] += 1
            assert response.status_code < 500, (route, text[:300], response.text)
            if response.status_code >= 400:
                check_error_shape(route, response)
    logger.info("hostile JSON: %d requests, statuses %s", len(bodies), dict(statuses))
    assert statuses[400] > len(bodies) // 2
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    assert greedy_text(server.url) == before


DEEP_ARRAY = nested(2000, "array")  # 4,000 bytes
GENERATE_HI = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}
CHAT_HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOO_DEEP = f"nests arrays and objects more than {MAX_JSON_DEPTH} deep"
BAD_LOGIT_BIAS = "'logit_bias' keys must be token ids in [0, 49152)"


def with_parameters(**parameters) -> str:
    return json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 2, **parameters}}, ensure_ascii=False)


@pytest.mark.parametrize("route, text, problem", [
    ("/generate", DEEP_ARRAY, f"request body {TOO_DEEP}"),
    ("/generate_stream", DEEP_ARRAY, f"request body {TOO_DEEP}"),
    ("/v1/chat/completions", DEEP_ARRAY, f"request body {TOO_DEEP}"),
    ("/tokenize", DEEP_ARRAY, f"request body {TOO_DEEP}"),
    ("/generate", with_raw_value(GENERATE_HI, ("parameters", "logit_bias"), nested(200, "object")), TOO_DEEP),
    ("/generate", with_parameters(logit_bias={"²": 1.0}), BAD_LOGIT_BIAS + ", got '²'"),
    ("/generate", with_parameters(logit_bias={"٣": 1.0}), BAD_LOGIT_BIAS + ", got '٣'"),
    ("/generate_stream", with_parameters(logit_bias={"²": 1.0}), BAD_LOGIT_BIAS),
    ("/v1/chat/completions", json.dumps({**CHAT_HI, "logit_bias": {"²": 1.0}}), BAD_LOGIT_BIAS),
    ("/generate", with_parameters(logit_bias={"9" * 5000: 1.0}), BAD_LOGIT_BIAS),
    ("/generate", with_parameters(grammar={"type": "json", "value": DEEP_ARRAY}),
     f"'grammar': the json grammar's value {TOO_DEEP}"),
    ("/generate", with_raw_value(GENERATE_HI, ("parameters", "max_new_tokens"), "1" + "0" * 5000),
     "request body is not valid JSON: Exceeds the limit (4300 digits) for integer string conversion"),
], ids=["deep body", "deep body, stream", "deep body, chat", "deep body, tokenize", "deep value", "logit_bias ²",
        "logit_bias ٣", "logit_bias ², stream", "logit_bias ², chat", "logit_bias huge", "deep grammar text",
        "huge integer"])
def test_input_that_once_got_a_500_gets_a_400_naming_it(server, route, text, problem):
    response = post_json(server.url, route, text)
    assert response.status_code == 400, response.text
    check_error_shape(route, response)
    body = response.json()
    message = body["error"]["message"] if route.startswith("/v1/") else body["error"]
    assert problem in message
    assert "sys.set_int_max_str_digits" not in message
    assert post_json(server.url, "/generate", json.dumps(GENERATE_HI)).status_code == 200
