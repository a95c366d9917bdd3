"""Answers that OpenAI's (or vLLM's) API gives and a client relies on: schemas that refer outside
themselves, tool messages and tool schemas, models.retrieve, vLLM's prompt_logprobs, each route's
own name for max_new_tokens in its errors, and a /docs page that loads nothing from outside."""

import json
import re

import openai
import pytest
import requests
import torch
from helpers.models import assert_rank
from transformers import AutoModelForCausalLM, AutoTokenizer

TOL = 1e-3
PROMPT = "The capital of France is"
HI = [{"role": "user", "content": "hi"}]
REMOTE = "https://example.com/schema.json"
BAD_TYPE = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}


def error_message(response: requests.Response) -> str:
    """The message of an error body of any route's shape (ours, OpenAI's, Anthropic's)."""
    error = response.json()["error"]
    return error if isinstance(error, str) else error["message"]


def post(server, path: str, body: dict) -> requests.Response:
    if path == "/v1/messages":  # Anthropic's body names its model
        body = {"model": requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"], **body}
    return requests.post(f"{server.url}{path}", json=body, timeout=120)


@pytest.fixture(scope="module")
def served(default_server) -> str:
    return requests.get(f"{default_server.url}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def hf(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, local_files_only=True)
    return tokenizer, model


REMOTE_REFS = {
    "response_format": ("/v1/chat/completions", {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": REMOTE}}}}),
    "structured_outputs": ("/v1/completions", {"prompt": PROMPT, "structured_outputs": {"json": {
        "type": "object", "properties": {"a": {"$ref": REMOTE}}}}}),
    "guided_json": ("/v1/completions", {"prompt": PROMPT, "guided_json": {"$ref": REMOTE}}),
    "generate's grammar": ("/generate", {"inputs": PROMPT, "parameters": {"grammar": {
        "type": "json", "value": {"items": {"$ref": REMOTE}, "type": "array"}}}}),
}


@pytest.mark.parametrize("path, body", REMOTE_REFS.values(), ids=REMOTE_REFS.keys())
def test_a_remote_ref_is_refused_and_named(default_server, path, body):
    """xgrammar reads a remote $ref as no constraint; OpenAI refuses one (nothing is fetched)."""
    response = post(default_server, path, {**body, **({} if path == "/generate" else {"max_tokens": 4})})
    assert response.status_code == 400, response.text
    assert REMOTE in error_message(response)


def test_a_tool_message_needs_its_tool_call_id(tool_server):
    call = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]
    response = post(tool_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert "messages[2].tool_call_id" in error_message(response)
    messages[2]["tool_call_id"] = "call_7"
    assert post(tool_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).status_code == 200


BAD_TOOLS = {
    "chat, a bad type": ("/v1/chat/completions", {"messages": HI, "tools": [
        {"type": "function", "function": {"name": "bad_tool", "parameters": BAD_TYPE}}]}),
    "chat, a remote ref": ("/v1/chat/completions", {"messages": HI, "tool_choice": "auto", "tools": [
        {"type": "function", "function": {"name": "bad_tool", "parameters": {"$ref": REMOTE}}}]}),
    "chat, a dangling ref": ("/v1/chat/completions", {"messages": HI, "tools": [
        {"type": "function", "function": {"name": "bad_tool", "parameters": {"$ref": "#/$defs/none"}}}]}),
    "messages": ("/v1/messages", {"messages": HI, "tools": [{"name": "bad_tool", "input_schema": BAD_TYPE}]}),
    "responses": ("/v1/responses", {"input": "hi", "tools": [
        {"type": "function", "name": "bad_tool", "parameters": BAD_TYPE}]}),
}


@pytest.mark.parametrize("path, body", BAD_TOOLS.values(), ids=BAD_TOOLS.keys())
def test_an_invalid_tool_schema_is_400_with_auto_too(tool_server, path, body):
    """With tool_choice auto (the default) no grammar is compiled, and the schema is still checked."""
    limit = {"max_output_tokens": 16} if path == "/v1/responses" else {"max_tokens": 4}
    response = post(tool_server, path, {**body, **limit})
    assert response.status_code == 400, response.text
    assert "bad_tool" in error_message(response)


def test_models_retrieve(default_server, served):
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    model = client.models.retrieve(served)
    listed = requests.get(f"{default_server.url}/v1/models", timeout=10).json()["data"][0]
    assert model.model_dump(exclude_unset=True) == listed and model.id == served and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    missing = requests.get(f"{default_server.url}/v1/models/no-such-model", timeout=10)
    assert missing.status_code == 404 and "no-such-model" in missing.json()["error"]["message"]


def check_prompt_logprobs(entries: list, prompt_ids: list[int], k: int, hf) -> None:
    """vLLM's shape: None, then per prompt token {id: {logprob, rank, decoded_token}} of the token
    and the k most likely; the values are transformers' log-softmax of the same prompt."""
    expected = torch.log_softmax(hf[1](torch.tensor([prompt_ids])).logits[0].float(), -1)
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for j, entry in enumerate(entries[1:], 1):
        token = prompt_ids[j]
        row = expected[j - 1]
        assert abs(entry[str(token)]["logprob"] - row[token].item()) < TOL
        assert_rank(entry[str(token)]["rank"], row, token, TOL)
        assert entry[str(token)]["decoded_token"] == hf[0].decode([token], skip_special_tokens=False,
                                                                  clean_up_tokenization_spaces=False)
        top = sorted((e for t, e in entry.items() if e["rank"] is not None and e["rank"] <= k),
                     key=lambda e: e["rank"])
        assert [e["rank"] for e in top] == list(range(1, k + 1))
        assert [e["logprob"] for e in top] == pytest.approx(row.topk(k).values.tolist(), abs=TOL)
        assert len(entry) <= k + 1


@torch.no_grad()
def test_prompt_logprobs_as_vllm(default_server, hf):
    prompt_ids = hf[0].encode(PROMPT)
    reply = post(default_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                      "prompt_logprobs": 2, "n": 2})
    assert reply.status_code == 200, reply.text
    for choice in reply.json()["choices"]:  # vLLM's completions: per choice
        check_prompt_logprobs(choice["prompt_logprobs"], prompt_ids, 2, hf)
    chat = post(default_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    body = chat.json()  # vLLM's chat: once, beside the choices
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"] and body["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])


@pytest.mark.parametrize("path, stream", [("/v1/completions", False), ("/v1/completions", True),
                                          ("/v1/chat/completions", False), ("/v1/chat/completions", True)])
def test_tokens_as_token_ids_name_the_same_tokens(default_server, hf, path, stream):
    """vLLM's return_tokens_as_token_ids: every token a logprobs object names (the sampled ones, the
    top ones, an echoed prompt's) is 'token_id:<id>' of the token the plain answer names by its text;
    the logprobs and the completions' text_offset stay the same."""
    tokenizer = hf[0]
    chat = path.endswith("chat/completions")
    body = ({"messages": HI, "logprobs": True, "top_logprobs": 2} if chat else
            {"prompt": PROMPT, "logprobs": 2, "echo": not stream})
    body.update(max_tokens=5, temperature=0, stream=stream)
    answers = []
    for as_ids in (False, True):
        reply = post(default_server, path, {**body, "return_tokens_as_token_ids": as_ids})
        assert reply.status_code == 200, reply.text
        events = ([json.loads(line[6:]) for line in reply.text.splitlines()
                   if line.startswith("data: {")] if stream else [reply.json()])
        entries = []
        for event in events:
            logprobs = event["choices"][0]["logprobs"] if event["choices"] else None
            if logprobs is None:
                continue
            if chat:
                entries += [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
                            for e in logprobs["content"]]
            else:
                entries += [(token, lp, sorted((top or {}).items()), offset) for token, lp, top, offset in
                            zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                logprobs["text_offset"])]
        answers.append(entries)
    plain, as_ids = answers
    assert len(plain) == len(as_ids) >= 5
    text = lambda name: tokenizer.decode([int(name.removeprefix("token_id:"))], skip_special_tokens=False)
    for named, ided in zip(plain, as_ids):
        assert re.fullmatch(r"token_id:\d+", ided[0]) and text(ided[0]) == named[0] and ided[1] == named[1]
        assert sorted((text(t), lp) for t, lp in ided[2]) == sorted(named[2])
        assert all(re.fullmatch(r"token_id:\d+", t) for t, _ in ided[2])
        assert ided[3:] == named[3:]  # text_offset


def test_truncated_prompts_keep_their_last_tokens(default_server, hf):
    """vLLM's truncate_prompt_tokens (TGI's truncate on /generate): the answer is the one to the
    prompt's last k tokens given as ids, and usage counts k; -1 keeps max_req_input_len of a prompt
    longer than that (refused without it); 0 is a 400."""
    tokenizer = hf[0]
    ids = tokenizer.encode(PROMPT)
    alone = post(default_server, "/v1/completions", {"prompt": ids[-3:], "max_tokens": 4, "temperature": 0}).json()
    cut = post(default_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                   "truncate_prompt_tokens": 3}).json()
    assert cut["choices"][0]["text"] == alone["choices"][0]["text"] and cut["usage"]["prompt_tokens"] == 3
    chat = post(default_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "truncate_prompt_tokens": 2})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 2, chat.text
    generate = post(default_server, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "truncate": 3}})
    assert generate.json()["prompt_tokens"] == 3 and generate.json()["generated_text"][0] == alone["choices"][0]["text"]
    long = " ".join(["river"] * 2100)
    assert post(default_server, "/v1/completions", {"prompt": long, "max_tokens": 1}).status_code == 400
    kept = post(default_server, "/v1/completions", {"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 2048, kept.text
    zero = post(default_server, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 0})
    assert zero.status_code == 400 and "'truncate_prompt_tokens' must be -1" in error_message(zero)


def test_request_id_names_the_answer_and_priority_zero_is_served(default_server):
    """vLLM's request_id is the answer's id after the route's prefix, in every chunk of a stream;
    priority 0 (vLLM's default) is accepted."""
    chat = post(default_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "request_id": "job-7:a",
                                                         "priority": 0})
    assert chat.status_code == 200 and chat.json()["id"] == "chatcmpl-job-7:a", chat.text
    stream = post(default_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True,
                                                      "request_id": "batch-1"})
    ids = {json.loads(line[6:])["id"] for line in stream.text.splitlines() if line.startswith("data: {")}
    assert ids == {"cmpl-batch-1"}
    plain = post(default_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).json()["id"]
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", plain)


@pytest.mark.parametrize("extra, why", [({"prompt_logprobs": 21}, "less than or equal to 20"),
                                        ({"prompt_logprobs": -1}, "greater than or equal to 0"),
                                        ({"prompt_logprobs": 1, "stream": True}, "'stream'")])
def test_prompt_logprobs_bounds(default_server, extra, why):
    """k is bounded as logprobs' is (MAX_LOGPROBS), and the list comes whole, never streamed (vLLM)."""
    response = post(default_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **extra})
    assert response.status_code == 400 and "prompt_logprobs" in error_message(response)
    assert why in error_message(response)


LONG_REQUESTS = {
    "chat max_tokens": ("/v1/chat/completions", {"messages": HI, "max_tokens": 5000}, "max_tokens"),
    "chat max_completion_tokens": ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 5000},
                                   "max_completion_tokens"),
    "completions": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5000}, "max_tokens"),
    "messages": ("/v1/messages", {"messages": HI, "max_tokens": 5000}, "max_tokens"),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    "generate": ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 5000}}, "max_new_tokens"),
}


@pytest.mark.parametrize("path, body, field", LONG_REQUESTS.values(), ids=LONG_REQUESTS.keys())
def test_length_errors_name_the_routes_field(default_server, path, body, field):
    response = post(default_server, path, body)
    assert response.status_code == 400, response.text
    message = error_message(response)
    assert re.search(rf"\+ {field} \(5000\) = \d+ is more than max_req_total_len", message), message


def test_docs_load_nothing_from_outside(default_server):
    page = requests.get(f"{default_server.url}/docs", timeout=10)
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    assert not re.search(r"(https?:)?//[A-Za-z0-9]", page.text), "the page refers to another host"
    assets = re.findall(r'(?:src|href)="(/[^"]+)"', page.text)
    assert {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"} <= set(assets)
    for asset in assets:
        served_asset = requests.get(f"{default_server.url}{asset}", timeout=10)
        assert served_asset.status_code == 200 and len(served_asset.content) > 100, asset
