"""POST /tokenize and /detokenize (vLLM's shapes): the ids the server itself would generate from,
and back to the text.
Relies on transformers' tokenizer encode and chat template as the oracle of the ids."""

import asyncio
import json
import random
from types import SimpleNamespace

import pytest
import requests
from transformers import AutoTokenizer

from lightllm.frontend.limits import Limits
from lightllm.server.httpserver.prompt_encoder import PromptEncoder
from lightllm.server.httpserver.tokenize_api import TokenizeRequest, tokenize_route

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def info(server):
    return requests.get(f"{server.url}/info", timeout=30).json()


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, timeout=60)


def test_a_prompt_tokenizes_as_generate_reads_it(server, tokenizer, info):
    prompt = "The quick brown fox " + " ".join(random.sample(["jumps", "über", "the", "lazy", "dog", "🦊", "42"], 5))
    reply = post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert reply["tokens"] == tokenizer.encode(prompt)
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == info["max_req_total_len"]
    assert reply["token_strs"] == tokenizer.convert_ids_to_tokens(reply["tokens"])
    generated = server.generate(prompt, max_new_tokens=1)
    assert generated["prompt_tokens"] == reply["count"]
    assert "token_strs" not in post(server, "/tokenize", {"prompt": prompt}).json()


def test_messages_tokenize_as_chat_completions_reads_them(server, tokenizer, info):
    reply = post(server, "/tokenize", {"messages": MESSAGES, "model": info["served_model_name"]}).json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert reply["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    chat = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == reply["count"]

    bare = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["tokens"] == reply["tokens"][:bare["count"]] and bare["count"] < reply["count"]


def test_detokenize_inverts_tokenize(server, tokenizer, info):
    text = "Paris is the capital of France; Rome, of Italy."
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": text}
    ids = random.sample(range(info["vocab_size"]), 20)
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == tokenizer.decode(ids)
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, words", [
    ("/detokenize", {"tokens": [1, -1]}, 400, "[0, "),
    ("/detokenize", {"tokens": [49152]}, 400, "[0, 49152)"),
    ("/detokenize", {"tokens": [2**70]}, 400, "[0, "),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "does not exist"),
    ("/detokenize", {"tokens": [1] * 3073}, 400, "max_req_total_len"),
    ("/tokenize", {}, 400, "either 'prompt' or 'messages'"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "either 'prompt' or 'messages'"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "'add_generation_prompt' goes with 'messages'"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "'add_special_tokens' goes with 'prompt'"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": None}]}, 400, "may be null only"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "does not exist"),
    ("/tokenize", {"prompt": "a", "typo": 1}, 400, "unknown field"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "ab" * 90_000}, 400, "was not tokenized"),
    ("/tokenize", {"messages": [{"role": "user", "content": "ab" * 90_000}]}, 400, "was not tokenized"),
])
def test_bad_requests_get_a_clear_4xx(server, path, body, status, words):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = json.loads(response.content)
    assert error["error_type"] == "validation" and words in error["error"], error


class BosTokenizer:
    """A tokenizer that adds a BOS token (1) unless told not to; the default model's adds none."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [ord(c) for c in text]


@pytest.mark.parametrize("given, expected", [(None, [1, 104, 105]), (True, [1, 104, 105]), (False, [104, 105])])
def test_add_special_tokens_reaches_the_tokenizer(given, expected):
    tokenizer = BosTokenizer()
    state = SimpleNamespace(config=SimpleNamespace(served_model_name="m"), tokenizer=tokenizer,
                            encoder=PromptEncoder(tokenizer), limits=Limits(8, 16, 100, 1000))
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(server=state)))
    body = TokenizeRequest(prompt="hi", add_special_tokens=given)
    reply = json.loads(asyncio.run(tokenize_route(request, body)).body)
    assert reply == {"count": len(expected), "max_model_len": 16, "tokens": expected}
