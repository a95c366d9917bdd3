"""The API's newer fields against a server on the GPU: logprobs, n, seed, logit_bias, min_tokens,
stop_token_ids, echo, allowed_token_ids, bad_words, prompt_logprobs' ranks, /generate's details,
TGI's POST / and /metrics' names.

    LIGHTLLM_GPU_MODEL=.gpu/bench-8b python -m pytest -m gpu tests/gpu/test_gpu_api.py

The server serves LIGHTLLM_GPU_MODEL (default .gpu/bench-8b, a config and tokenizer: dummy bf16
weights, as test/benchmark/serving/device_serving.sh carries it) or, where that is absent,
bench_model's tiny preset (its tokenizer from the default model). Plain `requests`: OpenAI's
client is not on the GPU image. Greedy answers are compared only between requests whose prompt is
already in the prefix cache (each such prompt is sent once first), so every compared request
computes the same rows the same way: in bf16 a full prefill and an extend over cached KV round
differently, and dummy weights give near-ties that such rounding can flip.
"""

import json
import math
import os
from pathlib import Path

import pytest
import requests
import torch
from helpers import ROOT
from server_utils import start_server

from benchmark.lib.server_process import metric_samples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TIMEOUT_S = 120.0  # a request


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    given = Path(os.environ.get("LIGHTLLM_GPU_MODEL") or ROOT / ".gpu" / "bench-8b")
    if given.is_dir():
        return given
    from lightllm.tools.bench_model import write_bench_model

    return write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def api(model_dir, tmp_path_factory):
    weights = [] if any(model_dir.glob("*.safetensors")) else ["--load_format", "dummy", "--data_type", "bfloat16"]
    server = start_server(["--model_dir", str(model_dir), *weights], tmp_path_factory.mktemp("server") / "server.log")
    yield Api(server.url, TIMEOUT_S)
    assert server.stop() == 0


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def eos(model_dir, tokenizer) -> int:
    return eos_id(model_dir, tokenizer)


# Distinct prompts: each check's prefix-cache state is its own.
PROMPTS = {
    "logprobs": "The capital of France is",
    "n": "Once upon a time, in a small village by the sea, there lived",
    "seed": "Here is a short list of fruits:",
    "bias": "My favourite city is",
    "min_tokens": "The weather today is",
    "stop": "In the beginning there was",
    "echo": "Question: what is two plus two? Answer:",
    "generate": "The quick brown fox jumps over",
    "allowed": "My three favourite numbers are",
    "bad_words": "The best season of the year is",
    "prompt_ranks": "Water boils at one hundred degrees",
    "tgi": "A good breakfast has",
}
TOL = 1e-5  # the same float sent twice (top-1 and the sampled token): equal up to JSON's repr


def expect(condition: bool, message: str) -> None:
    assert condition, message


def is_logprob(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x <= 0.0


class Api:
    """The server's routes, each answer checked for status 200."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.session = requests.Session()
        self.model = self.get("/v1/models").json()["data"][0]["id"]

    def get(self, path: str) -> requests.Response:
        response = self.session.get(self.url + path, timeout=self.timeout)
        expect(response.status_code == 200, f"GET {path}: {response.status_code} {response.text[:300]}")
        return response

    def post(self, path: str, body: dict) -> dict:
        response = self.session.post(self.url + path, json=body, timeout=self.timeout)
        expect(response.status_code == 200, f"POST {path}: {response.status_code} {response.text[:300]}")
        return response.json()

    def complete(self, prompt, **fields) -> dict:
        return self.post("/v1/completions", {"model": self.model, "prompt": prompt, **fields})

    def generate(self, prompt: str, **parameters) -> dict:
        return self.post("/generate", {"inputs": prompt, "parameters": parameters})

    def warm(self, prompt: str) -> None:
        """Put the prompt in the prefix cache (all but its last token, for the next request)."""
        self.complete(prompt, max_tokens=1, temperature=0)


def eos_id(model_dir: Path, tokenizer) -> int:
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return value[0] if isinstance(value, list) else int(value)
    return tokenizer.eos_token_id


def first_difference(texts: list[str]) -> str:
    base = texts[0]
    for i, text in enumerate(texts[1:], 1):
        if text != base:
            at = next((j for j, (a, b) in enumerate(zip(base, text)) if a != b), min(len(base), len(text)))
            return f"choice {i} differs from choice 0 at character {at}: {base[at:at + 20]!r} vs {text[at:at + 20]!r}"
    return "all equal"


# ---- the checks ----


def test_logprobs_top5(api: Api, tokenizer, eos: int):
    reply = api.complete(PROMPTS["logprobs"], max_tokens=8, temperature=0, logprobs=5)
    lp = reply["choices"][0]["logprobs"]
    tokens, chosen, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    n = reply["usage"]["completion_tokens"]
    expect(len(tokens) == len(chosen) == len(tops) == n > 0, f"lengths {len(tokens)}, {len(chosen)}, {len(tops)}, "
           f"usage {n}")
    for i, (token, logprob, top) in enumerate(zip(tokens, chosen, tops)):
        expect(is_logprob(logprob), f"token {i}: logprob {logprob!r} is not a finite value <= 0")
        expect(token in top, f"token {i}: sampled {token!r} not in its top_logprobs {top}")
        expect(top[token] == logprob, f"token {i}: top_logprobs[{token!r}] = {top[token]} != its logprob {logprob}")
        values = list(top.values())
        expect(all(is_logprob(v) for v in values), f"token {i}: top_logprobs {top} not all finite and <= 0")
        # the top 5 in order, then the sampled token if it is not among them (greedy: it is the first)
        head = values[:5]
        expect(head == sorted(head, reverse=True), f"token {i}: top 5 not sorted: {head}")
        expect(abs(logprob - max(values)) <= TOL, f"token {i}: greedy token's logprob {logprob} below the top "
               f"{max(values)}")
        # fewer than 5 where two of the top ids decode to the same text (one dict key)
        expect(len(top) <= 5, f"token {i}: {len(top)} entries for a greedy token (5 expected)")


def test_n_greedy(api: Api, tokenizer, eos: int):
    api.warm(PROMPTS["n"])
    reply = api.complete(PROMPTS["n"], n=4, temperature=0, max_tokens=12)
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    expect([c["index"] for c in choices] == [0, 1, 2, 3], f"indices {[c['index'] for c in choices]}")
    texts = [c["text"] for c in choices]
    expect(len(set(texts)) == 1, first_difference(texts))
    expect(reply["usage"]["completion_tokens"] == 48 or any(c["finish_reason"] == "stop" for c in choices),
           f"usage {reply['usage']}")


def test_n_seed(api: Api, tokenizer, eos: int):
    api.warm(PROMPTS["seed"])

    def draw(seed: int) -> list[str]:
        reply = api.complete(PROMPTS["seed"], n=3, temperature=1.0, seed=seed, max_tokens=12)
        return [c["text"] for c in sorted(reply["choices"], key=lambda c: c["index"])]

    first, again, other = draw(7), draw(7), draw(8)
    expect(len(first) == 3 and len(set(first)) > 1, f"seed 7's 3 choices do not differ: {first}")
    expect(again == first, f"seed 7 twice gave {first} then {again}")
    expect(other != first, "seed 8 gave seed 7's texts")


def test_logit_bias(api: Api, tokenizer, eos: int):
    forced = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    reply = api.complete(PROMPTS["bias"], temperature=0, max_tokens=4, logit_bias={str(forced): 100}, logprobs=1)
    text, expected = reply["choices"][0]["text"], tokenizer.decode([forced] * 4)
    expect(text == expected, f"text {text!r}, forced token {forced} x4 is {expected!r}")
    chosen = reply["choices"][0]["logprobs"]["token_logprobs"]
    expect(all(is_logprob(x) for x in chosen), f"logprobs {chosen}")


def test_min_tokens(api: Api, tokenizer, eos: int):
    bias = {str(eos): 100}
    free = api.complete(PROMPTS["min_tokens"], temperature=0, max_tokens=10, logit_bias=bias)
    held = api.complete(PROMPTS["min_tokens"], temperature=0, max_tokens=10, logit_bias=bias, min_tokens=3)
    counts = (free["usage"]["completion_tokens"], held["usage"]["completion_tokens"])
    reasons = (free["choices"][0]["finish_reason"], held["choices"][0]["finish_reason"])
    expect(counts == (1, 4) and reasons == ("stop", "stop"),
           f"EOS {eos} biased +100: without min_tokens {counts[0]} tokens ({reasons[0]}), with min_tokens=3 "
           f"{counts[1]} ({reasons[1]}); expected 1 and 4, both stop")


def test_stop_token_ids(api: Api, tokenizer, eos: int):
    prompt = PROMPTS["stop"]
    api.warm(prompt)
    reference = api.generate(prompt, max_new_tokens=8, do_sample=False, details=True)
    ids = [t["id"] for t in reference["details"]["tokens"]]
    expect(len(ids) >= 3, f"reference stopped after {len(ids)} tokens")
    stop = ids[2]
    expected = ids.index(stop) + 1
    reply = api.complete(prompt, temperature=0, max_tokens=8, stop_token_ids=[stop])
    got = (reply["usage"]["completion_tokens"], reply["choices"][0]["finish_reason"])
    expect(got == (expected, "stop"), f"stop_token_ids=[{stop}] (greedy ids {ids}): {got[0]} tokens, "
           f"finish {got[1]}; expected {expected}, stop")


def test_echo(api: Api, tokenizer, eos: int):
    prompt = PROMPTS["echo"]
    reply = api.complete(prompt, temperature=0, max_tokens=4, logprobs=2, echo=True)
    choice, usage = reply["choices"][0], reply["usage"]
    lp, p = choice["logprobs"], usage["prompt_tokens"]
    tokens, chosen, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    expect(p == len(tokenizer.encode(prompt)), f"prompt_tokens {p}, tokenizer {len(tokenizer.encode(prompt))}")
    expect(choice["text"].startswith(prompt), f"text {choice['text'][:60]!r} does not start with the prompt")
    expect(len(tokens) == len(chosen) == len(tops) == p + usage["completion_tokens"],
           f"{len(tokens)} tokens for {p} prompt + {usage['completion_tokens']} completion")
    expect("".join(tokens[:p]).endswith(prompt), f"prompt tokens join to {''.join(tokens[:p])!r}")
    expect(chosen[0] is None and tops[0] is None, f"first token's logprob {chosen[0]!r}, top {tops[0]!r}")
    bad = [(i, x) for i, x in enumerate(chosen[1:], 1) if not is_logprob(x)]
    expect(not bad, f"logprobs not finite and <= 0 at {bad[:5]}")
    for i in range(1, len(tokens)):
        expect(tokens[i] in tops[i] and 1 <= len(tops[i]) <= 3, f"position {i}: top {tops[i]} for {tokens[i]!r}")


def test_generate_details(api: Api, tokenizer, eos: int):
    prompt = PROMPTS["generate"]
    reply = api.generate(prompt, max_new_tokens=6, do_sample=False, details=True, decoder_input_details=True,
                            top_n_tokens=3)
    details = reply["details"]
    prefill, tokens, tops = details["prefill"], details["tokens"], details.get("top_tokens")
    ids = tokenizer.encode(prompt)
    expect([t["id"] for t in prefill] == ids, f"prefill ids {[t['id'] for t in prefill]}, tokenizer {ids}")
    expect(prefill[0]["logprob"] is None, f"first prefill logprob {prefill[0]['logprob']!r}")
    expect(all(is_logprob(t["logprob"]) for t in prefill[1:]), f"prefill logprobs {[t['logprob'] for t in prefill]}")
    expect(len(tokens) == details["generated_tokens"] == reply["count_output_tokens"] > 0,
           f"{len(tokens)} tokens, generated_tokens {details['generated_tokens']}")
    expect(tops is not None and len(tops) == len(tokens), f"top_tokens {tops!r}")
    for i, (token, top) in enumerate(zip(tokens, tops)):
        values = [t["logprob"] for t in top]
        expect(len(top) == 3 and values == sorted(values, reverse=True) and all(map(is_logprob, values)),
               f"token {i}: top_tokens {top}")
        expect(is_logprob(token["logprob"]) and abs(token["logprob"] - values[0]) <= TOL,
               f"token {i}: greedy {token} but top {top[0]}")
        expect(token["id"] == top[0]["id"] or token["logprob"] == values[0], f"token {i}: greedy {token} top {top[0]}")
    expect("".join(t["text"] for t in tokens) == reply["generated_text"][0], "token texts do not join to the text")


def test_metrics(api: Api, tokenizer, eos: int):
    samples = metric_samples(api.get("/metrics").text)
    names = ("lightllm:num_requests_running", "lightllm:prefix_cache_hits_total")
    for name in names:
        expect(name in samples, f"/metrics has no {name}")


def test_allowed_token_ids(api: Api, tokenizer, eos: int):
    """Greedy and sampled, every token is one of the list; greedy takes the most likely of them."""
    allowed = sorted({tokenizer.encode(w, add_special_tokens=False)[0] for w in (" one", " two", " seven", " x")})
    for temperature in (0, 1.0):
        reply = api.complete(PROMPTS["allowed"], temperature=temperature, max_tokens=6, ignore_eos=True, seed=3,
                             allowed_token_ids=allowed, logprobs=1)
        ids = tokenizer.encode(reply["choices"][0]["text"], add_special_tokens=False)
        expect(set(ids) <= set(allowed), f"temperature {temperature}: tokens {ids} outside {allowed}")
        expect(all(is_logprob(x) for x in reply["choices"][0]["logprobs"]["token_logprobs"]), "logprobs")


def test_bad_words(api: Api, tokenizer, eos: int):
    """A one-token word the greedy text holds (after a space), banned, is never sampled."""
    api.warm(PROMPTS["bad_words"])

    def token_ids(**fields) -> list[int]:
        reply = api.complete(PROMPTS["bad_words"], temperature=0, max_tokens=8, ignore_eos=True, logprobs=1,
                             return_tokens_as_token_ids=True, **fields)
        return [int(t.split(":")[1]) for t in reply["choices"][0]["logprobs"]["tokens"]]

    free = token_ids()
    texts = [tokenizer.decode([t]) for t in free]
    banned = next((t for t, text in zip(free, texts) if text.startswith(" ") and text[1:].strip()
                   and tokenizer.encode(text, add_special_tokens=False) == [t]), None)
    if banned is None:
        pytest.skip(f"no token of the greedy text {texts} is a word after a space")
    held = token_ids(bad_words=[tokenizer.decode([banned])[1:]])
    expect(banned not in held, f"banned token {banned} in {held} (free: {free})")
    expect(held[: free.index(banned)] == free[: free.index(banned)], f"held {held} parts from free {free} early")


def test_prompt_logprob_ranks(api: Api, tokenizer, eos: int):
    """A prompt token's rank counts the whole vocabulary at least as likely (vLLM's), whether or not
    it is among the k shown: 1 where it is the most likely. The prompt is a text and its own greedy
    continuation, whose tokens are each the most likely there (bar bf16 near-ties between a decode
    and a prefill of the same rows)."""
    reply = api.complete(PROMPTS["prompt_ranks"], temperature=0, max_tokens=6, ignore_eos=True, logprobs=1,
                         return_tokens_as_token_ids=True)
    continued = [int(t.split(":")[1]) for t in reply["choices"][0]["logprobs"]["tokens"]]
    ids = tokenizer.encode(PROMPTS["prompt_ranks"], add_special_tokens=False) + continued
    reply = api.complete(ids, max_tokens=1, temperature=0, prompt_logprobs=3)
    positions = reply["choices"][0]["prompt_logprobs"]
    expect(len(positions) == len(ids) and positions[0] is None, f"{len(positions)} positions for {len(ids)} tokens")
    for token, position in zip(ids[1:], positions[1:]):
        entries = {int(k): v for k, v in position.items()}
        mine = entries[token]
        better = sum(e["logprob"] > mine["logprob"] + TOL for t, e in entries.items() if t != token)
        expect(mine["rank"] >= better + 1, f"token {token}: rank {mine['rank']} below {better} shown likelier + 1")
    ranks = [positions[-n][str(ids[-n])]["rank"] for n in range(len(continued), 0, -1)]
    expect(sum(r == 1 for r in ranks) >= len(ranks) - 1, f"the greedy continuation's ranks {ranks}")


def test_tgi_root_route(api: Api, tokenizer, eos: int):
    """TGI's POST /: a list of one answer, /generate's text; its stream's events join to it."""
    api.warm(PROMPTS["tgi"])
    ours = api.generate(PROMPTS["tgi"], max_new_tokens=6)["generated_text"][0]
    answer = api.post("/", {"inputs": PROMPTS["tgi"], "parameters": {"max_new_tokens": 6, "details": True}})
    expect(isinstance(answer, list) and answer[0]["generated_text"] == ours, f"{answer} against {ours!r}")
    expect(answer[0]["details"]["finish_reason"] in ("length", "eos_token"), f"{answer[0]['details']}")
    response = api.session.post(api.url + "/", json={"inputs": PROMPTS["tgi"], "stream": True,
                                                     "parameters": {"max_new_tokens": 6}}, timeout=api.timeout)
    events = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]
    expect("".join(e["token"]["text"] for e in events) == ours, f"events {events}")
