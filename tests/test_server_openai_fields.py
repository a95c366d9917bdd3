"""The new OpenAI fields through OpenAI's own Python client, on the default model (fp32 on the CPU):
n, logprobs/top_logprobs, echo, logit_bias, seed, stop_token_ids, min_p, min_tokens,
stream_options.include_usage and response_format; and /generate's details (TGI).
Relies on transformers' Llama modeling code (its logits are the logprobs' oracle) and tokenizer encode/decode."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
from server_utils import openai_client
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TOL = 1e-3
PROMPT = "The capital of France is"
# A system prompt longer than SHARE_PROBE tokens, so that n choices share its KV through the prefix cache.
LONG = ("You are a careful assistant who answers questions about geography in short sentences, "
        "with one fact per sentence and no lists. Question: which river flows through Paris? Answer:")
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(default_server):
    return openai_client(default_server.url)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, local_files_only=True)
    return tokenizer, model


def hf_log_softmax(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf[1](torch.tensor([ids])).logits[0].float(), -1)


def test_n_greedy_choices_are_identical_and_share_the_prompt(default_server, client, model_name, hf):
    before = default_server.metrics()
    reply = client.completions.create(model=model_name, prompt=LONG, n=4, temperature=0, max_tokens=6)
    after = default_server.metrics()
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert len({c.text for c in reply.choices}) == 1
    prompt_len = len(hf[0].encode(LONG))
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.usage.completion_tokens == 4 * 6 or {c.finish_reason for c in reply.choices} == {"stop"}
    # the prompt is computed once: the other three choices take all of it but its last token from the cache
    hits = after["lightllm:prefix_cache_hits_total"] - before["lightllm:prefix_cache_hits_total"]
    assert hits >= 3 * (prompt_len - 1)


def test_seeded_n_choices_differ_and_reproduce(client, model_name):
    def draw(seed):
        reply = client.completions.create(model=model_name, prompt=PROMPT, n=3, temperature=1.0, seed=seed,
                                          max_tokens=12)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first = draw(7)
    assert len(set(first)) > 1
    assert draw(7) == first
    assert draw(8) != first


def test_completion_logprobs_and_echo_equal_transformers(client, model_name, hf):
    reply = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=3,
                                      echo=True)
    (choice,) = reply.choices
    assert choice.text.startswith(PROMPT)
    prompt_ids = hf[0].encode(PROMPT)
    lp = choice.logprobs
    n_prompt = len(prompt_ids)
    assert len(lp.tokens) == n_prompt + 5 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    generated = hf[0].encode(choice.text[len(PROMPT):])
    expected = hf_log_softmax(hf, prompt_ids + generated[:4])
    for pos in range(1, n_prompt + 4):
        token = (prompt_ids + generated)[pos]
        assert abs(lp.token_logprobs[pos] - expected[pos - 1, token].item()) < TOL, pos
        top = lp.top_logprobs[pos]
        assert lp.tokens[pos] in top and len(top) in (3, 4)  # the top 3 and the chosen token
        best = sorted(top.values(), reverse=True)[:3]
        assert abs(best[0] - expected[pos - 1].max().item()) < TOL


def test_streamed_logprobs_run_on_from_chunk_to_chunk(client, model_name):
    """A stream's logprobs, chunk after chunk, are the whole answer's: text_offset counts from the
    start of the text (the echoed prompt's), not from each chunk's."""
    request = dict(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True, n=2)
    whole = client.completions.create(**request)
    streamed = {0: ([], []), 1: ([], [])}
    for chunk in client.completions.create(**request, stream=True):
        (choice,) = chunk.choices
        streamed[choice.index][0].extend(choice.logprobs.tokens)
        streamed[choice.index][1].extend(choice.logprobs.text_offset)
    for choice in whole.choices:
        assert streamed[choice.index] == (choice.logprobs.tokens, choice.logprobs.text_offset)
        assert choice.logprobs.text_offset[-1] > len(PROMPT)


def test_chat_logprobs_top_k_sorted_with_the_greedy_token_first(client, model_name):
    messages = [{"role": "user", "content": "What is AI?"}]
    reply = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=6,
                                           logprobs=True, top_logprobs=4)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 4 and top == sorted(top, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    plain = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=6,
                                           logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * 6
    assert [e.logprob for e in plain.choices[0].logprobs.content] == pytest.approx([e.logprob for e in content], abs=TOL)


def test_logit_bias_min_tokens_and_stop_token_ids(client, model_name, hf):
    tokenizer = hf[0]
    eos = tokenizer.eos_token_id
    # EOS pushed to the top: min_tokens holds it back for exactly 3 tokens
    reply = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=10,
                                      logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (4, "stop")
    forced = tokenizer.encode(" Paris")[0]
    reply = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=3,
                                      logit_bias={str(forced): 100})
    assert reply.choices[0].text == tokenizer.decode([forced] * 3)
    greedy = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=8, logprobs=0)
    tokens = greedy.choices[0].logprobs.tokens
    stop_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(tokens[2]))[0]
    stopped = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=8,
                                        extra_body={"stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 3
    sampled = client.completions.create(model=model_name, prompt=PROMPT, temperature=1.0, seed=3, max_tokens=8,
                                        extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == greedy.choices[0].text  # min_p 1: only the most likely token is left


def test_allowed_token_ids_on_both_routes(client, model_name, hf, default_server):
    """Only the allowed tokens come, on the OpenAI routes and /generate (whose details give the ids):
    greedy, the likeliest of them under transformers' logits; the logprobs stay the raw ones."""
    tokenizer, model = hf
    allowed = sorted({tokenizer.encode(word)[0] for word in (" yes", " no", " maybe")})
    reply = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=1, logprobs=0,
                                      extra_body={"allowed_token_ids": allowed})
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode(PROMPT)])).logits[0, -1]
    best = allowed[int(logits[allowed].argmax())]
    assert reply.choices[0].text == tokenizer.decode([best])
    assert reply.choices[0].logprobs.token_logprobs[0] == pytest.approx(
        torch.log_softmax(logits, -1)[best].item(), abs=TOL)
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          temperature=1.0, seed=5, max_tokens=8, logprobs=True,
                                          extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    tokens = [entry.token for entry in chat.choices[0].logprobs.content]
    assert len(tokens) == 8 and set(tokens) <= {tokenizer.decode([t]) for t in allowed}
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True, "do_sample": True, "seed": 1,
                                             "allowed_token_ids": allowed}}
    answer = default_server.post("/generate", body).json()
    assert {t["id"] for t in answer["details"]["tokens"]} <= set(allowed)


def test_bad_words_on_both_routes(client, model_name, default_server):
    """A word the greedy answer holds is never generated once it is a bad word, on the OpenAI
    route and on /generate; bad_words is bounded."""
    greedy = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=8)
    assert "Paris" in greedy.choices[0].text
    banned = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=8,
                                       extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].text and banned.usage.completion_tokens == 8
    generate = default_server.post("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 8,
                                                                                  "bad_words": ["Paris"]}})
    assert generate.json()["generated_text"][0] == banned.choices[0].text
    too_many = default_server.post("/generate", {"inputs": PROMPT, "parameters": {"bad_words": ["x"] * 257}})
    assert too_many.status_code == 400 and "bad_words" in too_many.text


def test_stream_n_with_usage(client, model_name):
    stream = client.completions.create(model=model_name, prompt=PROMPT, n=2, temperature=0, max_tokens=5, stream=True,
                                       stream_options={"include_usage": True})
    texts, usage = {0: "", 1: ""}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts[0] == texts[1] != ""
    assert usage.completion_tokens == 10 and usage.total_tokens == usage.prompt_tokens + 10


def test_continuous_usage_counts_each_choice_chunk_by_chunk(client, model_name):
    """vLLM's continuous_usage_stats: every chunk carries its choice's usage so far, from 0 at the
    role chunk up to that choice's count; the last chunk, the whole request's."""
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], n=2, temperature=0, max_tokens=5,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})
    *chunks, last = list(stream)
    counts = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk.choices
        counts[choice.index].append(chunk.usage.completion_tokens)
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    for seen in counts.values():
        assert seen[0] == 0 and seen == sorted(seen) and seen[-1] == 5
    assert last.choices == [] and last.usage.completion_tokens == 10


def test_json_schema_output_in_a_batch_with_free_requests(client, model_name):
    messages = [{"role": "user", "content": "Is the sky blue? Reply in JSON with an answer and a score."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}

    def constrained(seed):
        return client.chat.completions.create(model=model_name, messages=messages, max_tokens=40, seed=seed,
                                              response_format=response_format)

    def free(seed):
        return client.chat.completions.create(model=model_name, messages=messages, max_tokens=20, seed=seed)

    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(constrained if i % 2 == 0 else free, i) for i in range(6)]
        replies = [job.result() for job in jobs]
    for i, reply in enumerate(replies):
        if i % 2 == 0:
            value = json.loads(reply.choices[0].message.content)
            assert set(value) == {"answer", "score"} and value["answer"] in ("yes", "no")
            assert isinstance(value["score"], int) and 0 <= value["score"] <= 9
    anything = client.chat.completions.create(model=model_name, messages=messages, max_tokens=40,
                                              response_format={"type": "json_object"}, temperature=0)
    content = anything.choices[0].message.content
    assert content.startswith("{")  # a free-form object may run past max_tokens; if it ends, it parses
    assert anything.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict)
    with pytest.raises(openai.BadRequestError, match="structured output"):
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nope"}}})


CHOICES = ["strongly agree", "agree", "disagree", "it depends: \"maybe\""]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_structured_outputs_hold_on_both_routes(client, model_name, route):
    """vLLM's structured_outputs (and its old guided_* names): each constraint holds on every
    sampled answer, on the chat route and on plain completions."""
    def ask(extra, max_tokens=24, seed=0):
        common = dict(model=model_name, max_tokens=max_tokens, seed=seed, temperature=1.0, extra_body=extra)
        if route == "chat":
            messages = [{"role": "user", "content": "Do you like rain? Answer briefly."}]
            return client.chat.completions.create(messages=messages, **common).choices[0]
        return client.completions.create(prompt="Q: Do you like rain?\nA:", **common).choices[0]

    def text(choice):
        return choice.message.content if route == "chat" else choice.text

    grammar = 'root ::= "rain is " ("good" | "bad") "."'
    asks = [(extra, max_tokens, seed) for seed in range(2) for extra, max_tokens in (
        ({"structured_outputs": {"choice": CHOICES}}, 24), ({"guided_choice": CHOICES}, 24),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, 24), ({"structured_outputs": {"grammar": grammar}}, 24),
        ({"structured_outputs": {"json": SCHEMA}}, 40), ({"guided_json": json.dumps(SCHEMA)}, 40))]
    with ThreadPoolExecutor(len(asks)) as pool:  # at once, as a batch: each constraint holds beside the others
        choices = list(pool.map(lambda a: ask(a[0], max_tokens=a[1], seed=a[2]), asks))
    for seed in range(2):
        chose, guided, regex, ebnf, json_outputs, guided_json = choices[6 * seed:6 * seed + 6]
        for choice in (chose, guided):
            assert text(choice) in CHOICES and choice.finish_reason == "stop"
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text(regex))
        assert text(ebnf) in ("rain is good.", "rain is bad.")
        for choice in (json_outputs, guided_json):
            value = json.loads(text(choice))
            assert set(value) == {"answer", "score"} and value["answer"] in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="takes exactly one of json, regex"):
        ask({"structured_outputs": {"regex": "a", "choice": ["b"]}})
    with pytest.raises(openai.BadRequestError, match="give one of 'response_format', 'guided_regex'"):
        ask({"guided_regex": "a+", "response_format": {"type": "json_object"}})
    with pytest.raises(openai.BadRequestError, match="the ebnf cannot be used for structured output"):
        ask({"structured_outputs": {"grammar": "root ::= "}})


def test_generate_details_and_grammar(default_server, hf):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True, "decoder_input_details": True,
                                             "top_n_tokens": 2, "n": 2}}
    reply = default_server.post("/generate", body).json()
    assert len(reply["generated_text"]) == 2 and reply["generated_text"][0] == reply["generated_text"][1]
    details = reply["details"]
    prompt_ids = hf[0].encode(PROMPT)
    assert [t["id"] for t in details["prefill"]] == prompt_ids and details["prefill"][0]["logprob"] is None
    assert len(details["tokens"]) == 4 and all(len(top) == 2 for top in details["top_tokens"])
    assert [t["id"] for t in details["tokens"]] == [t["id"] for t in details["best_of_sequences"][0]["tokens"]]
    expected = hf_log_softmax(hf, prompt_ids)
    assert abs(details["prefill"][1]["logprob"] - expected[0, prompt_ids[1]].item()) < TOL
    regex = default_server.post("/generate", {"inputs": "My phone number is", "parameters": {
        "max_new_tokens": 12, "grammar": {"type": "regex", "value": "[0-9]{3}-[0-9]{4}"}}}).json()
    assert len(regex["generated_text"][0]) == 8 and regex["generated_text"][0][3] == "-"
    bad = default_server.post("/generate_stream", {"inputs": PROMPT, "parameters": {"n": 2}})
    assert bad.status_code == 400 and "n" in bad.json()["error"]
