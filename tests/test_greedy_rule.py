"""One greedy rule for every path: a temperature below GREEDY_TEMPERATURE samples greedily.

A temperature of 1e-38 divides the logits into float32 overflow (inf, then NaN probabilities);
before the rule lived in the engine, every HTTP route sampled garbage text with it. Each route
and the offline LLM (test_offline_llm.py's test_tiny_temperature_is_greedy, on that module's LLM)
must give, with such a temperature, exactly the text of temperature 0.
"""

import pytest
import requests

from lightllm.engine.request import GREEDY_TEMPERATURE, SamplingParams

TINY = (1e-38, GREEDY_TEMPERATURE / 2)
MAX_TOKENS = 12
PROMPT = "The three primary colors are"


def test_engine_rule():
    assert SamplingParams(do_sample=True, temperature=GREEDY_TEMPERATURE / 2).greedy
    assert SamplingParams(do_sample=True, temperature=0.0).greedy
    assert not SamplingParams(do_sample=True, temperature=GREEDY_TEMPERATURE).greedy


def _generate(server, temperature):
    parameters = {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}
    if temperature:
        parameters.update(do_sample=True, temperature=temperature)
    return server.post("/generate", {"inputs": PROMPT, "parameters": parameters})


def _completions(server, temperature):
    return server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": temperature,
                                           "ignore_eos": True})


def _chat(server, temperature):
    return server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                "max_tokens": MAX_TOKENS, "temperature": temperature,
                                                "ignore_eos": True})


def _messages(server, temperature):
    (model,) = requests.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    return server.post("/v1/messages", {"model": model["id"], "messages": [{"role": "user", "content": PROMPT}],
                                        "max_tokens": MAX_TOKENS, "temperature": temperature})


def _responses(server, temperature):
    return server.post("/v1/responses", {"input": PROMPT, "max_output_tokens": MAX_TOKENS,
                                         "temperature": temperature})


def _text(route: str, body: dict) -> str:
    if route == "generate":
        return body["generated_text"][0]
    if route == "completions":
        return body["choices"][0]["text"]
    if route == "chat":
        return body["choices"][0]["message"]["content"]
    if route == "messages":
        return "".join(block["text"] for block in body["content"] if block["type"] == "text")
    return "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])


ROUTES = {"generate": _generate, "completions": _completions, "chat": _chat, "messages": _messages,
          "responses": _responses}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_tiny_temperature_is_greedy_on_every_route(default_server, route):
    def text(temperature):
        response = ROUTES[route](default_server, temperature)
        assert response.status_code == 200, response.text
        return _text(route, response.json())

    greedy = text(0.0)
    assert greedy.strip()
    for temperature in TINY:
        assert text(temperature) == greedy, f"temperature {temperature}"
