"""The OpenAI-compatible API, driven by OpenAI's own Python client, on the default model.
Relies on transformers' Llama modeling code, greedy `generate` and the tokenizer's chat template as the oracle."""

import openai
from server_utils import openai_client
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

CHATS = [
    [{"role": "user", "content": "What is AI?"}],
    [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def client(default_server):
    return openai_client(default_server.url)


@pytest.fixture(scope="module")
def model_name(client):
    (model,) = client.models.list().data
    return model.id


@pytest.fixture(scope="module")
def hf(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, local_files_only=True)
    return tokenizer, model


def hf_greedy_chat(hf, messages) -> tuple[str, int, int, str]:
    """(text, prompt tokens, completion tokens, finish reason) of transformers' greedy generate."""
    tokenizer, model = hf
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    reason = "stop" if out[-1] == tokenizer.eos_token_id else "length"
    return tokenizer.decode(out, skip_special_tokens=True), ids.shape[1], len(out), reason


def test_models_lists_the_served_model(default_server, default_model_dir, model_name):
    assert model_name == default_model_dir.name
    listed = requests.get(f"{default_server.url}/v1/models", timeout=10).json()["data"][0]
    assert listed["max_model_len"] == requests.get(f"{default_server.url}/info", timeout=10).json()["max_req_total_len"]


@pytest.mark.parametrize("messages", CHATS, ids=["user", "system+user"])
def test_chat_greedy_matches_transformers(client, model_name, hf, messages):
    reply = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    text, prompt_len, completion_len, reason = hf_greedy_chat(hf, messages)
    (choice,) = reply.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, reason)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_len, completion_len)
    assert reply.usage.total_tokens == prompt_len + completion_len
    assert reply.object == "chat.completion" and reply.model == model_name


def test_text_parts_are_joined(client, model_name):
    plain = [{"role": "user", "content": "What is AI?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "AI?"}]}]
    answers = [
        client.chat.completions.create(model=model_name, messages=m, temperature=0, max_tokens=8).choices[0].message.content
        for m in (plain, parts)
    ]
    assert answers[0] == answers[1]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 11}])
def test_chat_stream_joins_to_the_whole_answer(client, model_name, sampling):
    request = dict(model=model_name, messages=CHATS[0], max_tokens=MAX_TOKENS, **sampling)
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    *token_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].delta.content or "" for c in token_chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_completion_matches_generate(default_server, client, model_name, hf):
    prompt = "The capital of France is"
    native = default_server.generate(prompt, max_new_tokens=MAX_TOKENS)
    reply = client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    assert reply.choices[0].text == native["generated_text"][0]
    assert reply.usage.completion_tokens == native["count_output_tokens"]
    ids = hf[0].encode(prompt)  # the served model's own tokenizer
    by_ids = client.completions.create(model=model_name, prompt=ids, temperature=0, max_tokens=MAX_TOKENS)
    assert by_ids.choices[0].text == native["generated_text"][0]
    streamed = client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == native["generated_text"][0]


def test_a_batch_of_prompts_answers_each_prompt_as_alone(client, model_name, hf):
    """A list of prompts (texts or token ids) in one body: choice i answers prompt i // n as its
    choice i % n would alone (the same seed for every prompt, seed + c for choice c), usage counts
    each prompt once and every choice's tokens, and a stream carries the same texts by index."""
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):"]
    request = dict(model=model_name, n=2, temperature=1.0, seed=5, max_tokens=8)
    alone = [client.completions.create(prompt=p, **request) for p in prompts]
    batch = client.completions.create(prompt=prompts, **request)
    expected = [(i, c.text, c.finish_reason) for i, c in enumerate(c for reply in alone for c in reply.choices)]
    assert [(c.index, c.text, c.finish_reason) for c in batch.choices] == expected
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert batch.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    by_ids = client.completions.create(prompt=[hf[0].encode(p) for p in prompts], **request)
    assert [c.text for c in by_ids.choices] == [text for _, text, _ in expected]
    streamed = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                              **request))
    *token_chunks, usage_chunk = streamed
    texts = [""] * len(expected)
    for chunk in token_chunks:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
    assert texts == [text for _, text, _ in expected]
    assert usage_chunk.usage == batch.usage
    echoed = client.completions.create(prompt=prompts, echo=True, model=model_name, temperature=0, max_tokens=4)
    assert [c.text[: len(p)] for c, p in zip(echoed.choices, prompts)] == prompts


def test_a_continued_final_message_is_the_prompt_transformers_renders(default_server, client, model_name, hf):
    """continue_final_message (vLLM's) and /v1/messages' prefill (a last assistant turn): the
    prompt ends inside that message as transformers renders it, the answer is what greedy decoding
    adds to it, /tokenize and count_tokens count the same ids."""
    tokenizer, _ = hf
    prefill = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    text = tokenizer.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert text.endswith("My favourite is")
    ids = tokenizer.encode(text, add_special_tokens=False)
    greedy = dict(temperature=0, max_tokens=8)
    expected = client.completions.create(model=model_name, prompt=ids, **greedy).choices[0].text
    chat = client.chat.completions.create(model=model_name, messages=prefill, **greedy,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert (chat.choices[0].message.content, chat.usage.prompt_tokens) == (expected, len(ids))
    tokenized = default_server.post("/tokenize", {"messages": prefill, "continue_final_message": True}).json()
    assert tokenized["tokens"] == ids
    anthropic = default_server.post("/v1/messages", {"model": model_name, "messages": prefill, "max_tokens": 8,
                                                     "temperature": 0}).json()
    usage = anthropic["usage"]  # Anthropic's input_tokens leave out the prefix cache's
    assert anthropic["content"][0]["text"] == expected
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ids)
    counted = default_server.post("/v1/messages/count_tokens", {"model": model_name, "messages": prefill}).json()
    assert counted["input_tokens"] == len(ids)
    both = default_server.post("/v1/chat/completions", {"messages": prefill, "continue_final_message": True,
                                                        "add_generation_prompt": True})
    assert both.status_code == 400 and "cannot both be true" in both.json()["error"]["message"]


def test_stop_cuts_the_text(client, model_name):
    request = dict(model=model_name, prompt="Once upon a time, in a small village,", temperature=0, max_tokens=MAX_TOKENS)
    text = client.completions.create(**request).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    cut = client.completions.create(**request, stop=[stop]).choices[0]
    assert (cut.text, cut.finish_reason) == (text[: text.index(stop)], "stop")
    kept = client.completions.create(**request, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert (kept.choices[0].text, kept.choices[0].finish_reason) == (text[: text.index(stop) + len(stop)], "stop")


HI = [{"role": "user", "content": "hi"}]
BAD_CHATS = [
    ({"messages": []}, 400, "'messages': List should have at least 1 item"),
    ({"messages": "hi"}, 400, "'messages': Input should be a valid list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "'messages[0].role': Input should be 'system', 'developer'"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "'messages[0].content': Input should be a valid string"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content may be null only for role 'assistant'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "'messages[0].content[0].type': Input should be 'text', got 'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     400, "'messages[0].content[0].type': Input should be 'text', got 'input_audio'"),
    ({"messages": HI, "n": 129}, 400, "'n': Input should be less than or equal to 128"),
    ({"messages": HI, "n": 0}, 400, "'n': Input should be greater than or equal to 1"),
    ({"messages": HI, "top_logprobs": 2}, 400, "'top_logprobs' needs 'logprobs': true"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs': Input should be less than or equal to 20"),
    ({"messages": HI, "logit_bias": {"x": 1}}, 400, "'logit_bias' keys must be token ids in [0, 49152)"),
    ({"messages": HI, "stop_token_ids": [49152]}, 400, "'stop_token_ids' must be in [0, 49152)"),
    ({"messages": HI, "allowed_token_ids": [3, 49152]}, 400, "'allowed_token_ids' must be in [0, 49152)"),
    ({"messages": HI, "priority": 1}, 400, "'priority' = 1 is not served: requests are admitted by --schedule_policy lpt"),
    ({"messages": HI, "request_id": "two words"}, 400, "'request_id': String should match pattern"),
    ({"messages": HI, "allowed_token_ids": []}, 400, "'allowed_token_ids': List should have at least 1 item"),
    ({"messages": HI, "allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 1}, 400,
     "min_tokens=1 bans: no token could be sampled"),
    ({"messages": HI, "response_format": {"type": "json_schema"}}, 400, "needs a 'json_schema' object"),
    ({"messages": HI, "response_format": {"type": "xml"}}, 400, "'response_format.type': Input should be"),
    ({"messages": HI, "tools": [{"type": "function"}]}, 400, "'tools[0].function': required"),
    ({"messages": HI, "temperature": -1}, 400, "'temperature': Input should be greater than or equal to 0"),
    ({"messages": HI, "temperature": 2.5}, 400, "'temperature': Input should be less than or equal to 2"),
    ({"messages": HI, "top_p": 1.01}, 400, "'top_p': Input should be less than or equal to 1"),
    ({"messages": HI, "presence_penalty": 2.5}, 400, "'presence_penalty': Input should be less than or equal to 2"),
    ({"messages": HI, "frequency_penalty": -3}, 400, "'frequency_penalty': Input should be greater than or equal to -2"),
    ({"messages": HI, "logit_bias": {"1": 101}}, 400, "'logit_bias': Input should be less than or equal to 100"),
    ({"messages": HI, "max_tokens": 0}, 400, "'max_tokens': Input should be greater than or equal to 1"),
    ({"messages": HI, "max_completion_tokens": 0}, 400, "'max_completion_tokens': Input should be greater than or equal to 1"),
    ({"messages": HI, "stop": [""]}, 400, "'stop[0]': String should have at least 1 character"),
    ({"messages": HI, "stream": "yes"}, 400, "'stream': Input should be a valid boolean"),
    ({"messages": HI, "stream_options": {"include_usage": 1}}, 400, "'stream_options.include_usage': Input should be a valid boolean"),
    ({"messages": HI, "max_token": 5}, 400, "'max_token': unknown field"),
    ({"messages": HI, "max_tokens": 5000}, 400, "more than max_req_total_len"),
    ({"messages": HI, "model": "gpt-4"}, 404, "model 'gpt-4' does not exist"),
]
BAD_COMPLETIONS = [
    ({}, 400, "'prompt': required"),
    ({"prompt": ["one", [1, 2]]}, 400, "'prompt[1]': Input should be a valid string, got [1, 2]"),
    ({"prompt": ["hi"] * 2049}, 400, "'prompt': List should have at most 2048 items"),
    ({"prompt": ["hi"] * 2048, "n": 3}, 400, "6144 requests at once can never be queued"),
    ({"prompt": [1, 10**9]}, 400, "'prompt' token ids must be in [0, 49152)"),
    ({"prompt": [[1], [1, 10**9]]}, 400, "'prompt' token ids must be in [0, 49152)"),
    ({"prompt": ["hi", "hi " * 3000]}, 400, "'prompt[1]': the prompt has "),
    ({"prompt": [1, -1]}, 400, "'prompt[1]': Input should be greater than or equal to 0"),
    ({"prompt": "hi", "best_of": 2}, 400, "'best_of' = 2 is not supported"),
    ({"prompt": "hi", "logprobs": 21}, 400, "'logprobs': Input should be less than or equal to 20"),
    ({"prompt": "hi", "top_p": 2}, 400, "'top_p': Input should be less than or equal to 1"),
    ({"prompt": "hi", "temperature": 2.01}, 400, "'temperature': Input should be less than or equal to 2"),
    ({"prompt": "hi", "best_of": 21}, 400, "'best_of': Input should be less than or equal to 20"),
]


def test_bad_requests_get_a_clear_error(default_server, client, model_name):
    cases = [("/v1/chat/completions", *case) for case in BAD_CHATS]
    cases += [("/v1/completions", *case) for case in BAD_COMPLETIONS]
    for path, body, status, message in cases:
        response = default_server.post(path, body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]  # OpenAI's shape, which its clients read
        assert error["type"] == "validation" and message in error["message"] and error["code"] == status, body
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=CHATS[0])
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model=model_name, messages=CHATS[0], extra_body={"functions": [{"name": "f"}]})
    assert client.completions.create(model=model_name, prompt="still serving", max_tokens=2).usage.completion_tokens == 2


def test_closed_stream_frees_its_tokens(default_server, client, model_name):
    aborted = default_server.metrics()['lightllm:request_success_total{finished_reason="abort"}']
    stream = client.chat.completions.create(
        model=model_name, messages=CHATS[0], max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _ in zip(range(4), stream):
        pass
    assert default_server.metrics()["lightllm:kv_cache_used_tokens"] > 0
    stream.close()
    default_server.wait_for(
        lambda: (m := default_server.metrics())["lightllm:kv_cache_used_tokens"] == 0 and m["lightllm:num_requests_running"] == 0,
        what="the closed stream's request freed",
    )
    assert default_server.metrics()['lightllm:request_success_total{finished_reason="abort"}'] == aborted + 1
