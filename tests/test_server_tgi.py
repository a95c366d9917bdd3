"""TGI's clients against the server: huggingface_hub's InferenceClient sends to TGI's POST / (a list
of one answer, or /generate_stream's events with "stream": true) with TGI's parameter names, and
chats through /v1/chat/completions with TGI's model name ("dummy") and response_format. Each
answer must be what our own route answers the same request."""

import json
import re

import math

import pytest
import requests
from huggingface_hub import InferenceClient

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def client(default_server) -> InferenceClient:
    """The client on the local server. The tests run with HF_HUB_OFFLINE set (nothing may reach
    the Hub), which huggingface_hub applies to every URL: lifted for this module's calls, which
    go to 127.0.0.1 only."""
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield InferenceClient(base_url=default_server.url)


def generate(server, **parameters) -> dict:
    response = server.post("/generate", {"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 200, response.text
    return response.json()


def test_text_details_and_stream_are_generates(default_server, client):
    ours = generate(default_server, max_new_tokens=8, details=True)
    assert client.text_generation(PROMPT, max_new_tokens=8) == ours["generated_text"][0]
    tgi = client.text_generation(PROMPT, max_new_tokens=8, details=True)
    assert tgi.generated_text == ours["generated_text"][0]
    assert [t.id for t in tgi.details.tokens] == [t["id"] for t in ours["details"]["tokens"]]
    assert tgi.details.finish_reason == "length" and tgi.details.generated_tokens == 8
    streamed = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert [e.index for e in streamed] == list(range(1, 9))
    assert "".join(e.token.text for e in streamed) == streamed[-1].generated_text == ours["generated_text"][0]
    assert streamed[-1].details.finish_reason == "length"
    assert client.text_generation(PROMPT, max_new_tokens=8, return_full_text=True) == PROMPT + ours["generated_text"][0]


def test_tgi_names_stop_and_its_finish_reasons(default_server, client):
    full = generate(default_server, max_new_tokens=8)["generated_text"][0]
    word = full.split()[1]  # a word the greedy text holds past its start
    ours = generate(default_server, max_new_tokens=8, stop_sequences=[word])
    tgi = client.text_generation(PROMPT, max_new_tokens=8, stop=[word], details=True)
    assert tgi.generated_text == ours["generated_text"][0] and ours["finish_reason"] == "stop"
    assert tgi.details.finish_reason == "stop_sequence"  # TGI's name on TGI's route; /generate keeps its own


def test_best_of_answers_the_most_likely_of_n_draws(default_server, client):
    """best_of=3 draws the three sequences n=3 draws with the same seed and answers the one whose
    tokens' logprobs sum highest."""
    for seed in range(11, 31):  # a seed whose most likely draw is not its first (the first is answered alone)
        sampled = dict(max_new_tokens=6, do_sample=True, temperature=1.5, seed=seed)
        drawn = generate(default_server, n=3, details=True, **sampled)
        sequences = [drawn["details"], *drawn["details"]["best_of_sequences"]]
        scores = [sum(t["logprob"] for t in seq["tokens"]) for seq in sequences]
        best = max(range(3), key=scores.__getitem__)
        if best and len({round(s, 3) for s in scores}) == 3:
            break
    else:
        pytest.fail("no seed drew a most likely sequence other than its first")
    tgi = client.text_generation(PROMPT, best_of=3, details=True, **sampled)
    assert tgi.generated_text == drawn["generated_text"][best]
    assert math.isclose(sum(t.logprob for t in tgi.details.tokens), scores[best], abs_tol=1e-3)
    assert len(tgi.details.best_of_sequences) == 2


def test_typical_p_narrows_the_draw(client):
    """typical_p through TGI's client: near 0 only the most typical token is left at each step, so
    every seed draws one text; at 1.0 (off) the same seeds draw different ones."""
    def draws(typical_p):
        return {client.text_generation(PROMPT, max_new_tokens=12, do_sample=True, seed=seed, typical_p=typical_p)
                for seed in range(4)}

    assert len(draws(1e-6)) == 1
    assert len(draws(1.0)) > 1


@pytest.mark.parametrize("parameters, message", [
    ({"typical_p": 0}, "typical_p"),
    ({"best_of": 2, "n": 2, "do_sample": True}, "not both"),
    ({"best_of": 2}, "'best_of' > 1 needs sampling"),
    ({"stop": ["x"], "stop_sequences": ["y"]}, "not both"),
])
def test_what_cannot_be_served_is_a_400(default_server, parameters, message):
    for path, body in (("/", {"inputs": PROMPT, "parameters": parameters}),
                       ("/generate", {"inputs": PROMPT, "parameters": parameters})):
        response = requests.post(f"{default_server.url}{path}", json=body, timeout=60)
        assert response.status_code == 400 and message in response.json()["error"], (path, response.text)
    stream = requests.post(f"{default_server.url}/", json={"inputs": PROMPT, "stream": True,
                                                          "parameters": {"best_of": 2, "do_sample": True}}, timeout=60)
    assert stream.status_code == 400 and "not supported by a stream" in stream.json()["error"]


CHAT = [{"role": "user", "content": "Name a colour."}]


def chat(server, **fields) -> dict:
    response = server.post("/v1/chat/completions", {"messages": CHAT, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_completion_with_tgis_model_name(default_server, client):
    """huggingface_hub names the model "dummy" (TGI serves one model whatever the name): the base
    model, as "tgi" is; another unknown name stays a 404."""
    ours = chat(default_server, max_tokens=6, temperature=0)["choices"][0]["message"]["content"]
    tgi = client.chat_completion(CHAT, max_tokens=6, temperature=0)
    assert tgi.choices[0].message.content == ours
    streamed = client.chat_completion(CHAT, max_tokens=6, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == ours
    assert chat(default_server, max_tokens=6, temperature=0, model="tgi")["choices"][0]["message"]["content"] == ours
    unknown = default_server.post("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4", "max_tokens": 1})
    assert unknown.status_code == 404


def test_tgis_response_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"],
              "additionalProperties": False}
    answer = client.chat_completion(CHAT, max_tokens=40, temperature=0,
                                    response_format={"type": "json", "value": schema})
    assert set(json.loads(answer.choices[0].message.content)) == {"colour"}
    answer = client.chat_completion(CHAT, max_tokens=10, temperature=0,
                                    response_format={"type": "regex", "value": "(red|green|blue)!"})
    assert re.fullmatch("(red|green|blue)!", answer.choices[0].message.content)
