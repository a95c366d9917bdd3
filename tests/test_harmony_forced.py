"""Forced tool calls (tool_choice required or a named function) for gpt-oss: the grammar admits a
harmony call (an optional bounded analysis message, then `<|start|>assistant<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`) and nothing else, with the harmony
tags special tokens of the tokenizer (as gpt-oss's) or plain text (our tiny models'); the routes
hand that grammar down and read what it admits back as tool calls; and a tiny gpt-oss server,
its random model held to the grammar, answers a forced request with a call whose arguments fit
the schema, through OpenAI's client on /v1/chat/completions and /v1/responses."""

import json

import pytest
from transformers import AutoTokenizer

from lightllm.frontend.chat.output import chat_parsers

HARMONY_TAGS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|end|>", "<|return|>"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"]}
ARGS = {"city": "Tokyo", "days": 3}
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"


def compact(args: dict) -> str:
    return json.dumps(args, separators=(",", ":"))


def call(name: str = "get_weather", args: dict | str = ARGS, head: str = "<|start|>assistant") -> str:
    """A call as gpt-oss writes it, its arguments compact JSON (the prompt's own `<|start|>assistant`
    comes before the first)."""
    text = args if isinstance(args, str) else compact(args)
    return f"{head}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{text}<|call|>"


FIRST = call(head="")
HERMES = f'<tool_call>\n{json.dumps({"name": "get_weather", "arguments": ARGS})}\n</tool_call>'


def gpt_oss_format():
    return chat_parsers(None, None, "GptOssForCausalLM", None).call_format


@pytest.fixture(scope="module", params=["plain", "special"])
def tokenizer_dir(request, default_model_dir, tmp_path_factory):
    """The default model's tokenizer, its harmony tags plain text, or special tokens as gpt-oss's."""
    if request.param == "plain":
        return default_model_dir
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TAGS})
    path = tmp_path_factory.mktemp("harmony_tokenizer")
    tokenizer.save_pretrained(path)
    return path


def grammar(choice: str, parallel: bool = False, max_new_tokens: int | None = None) -> str:
    from lightllm.server.httpserver.openai_params import FunctionDef, forced_call_grammar

    tools = [FunctionDef(name="get_weather", parameters=SCHEMA), FunctionDef(name="other")]
    return forced_call_grammar(gpt_oss_format(), tools, choice, parallel, max_new_tokens=max_new_tokens)[1]


def acceptor(tokenizer_dir, stop_tags: tuple[str, ...] = ()):
    """accepts(spec, text): the forced grammar takes the token ids of `text` and ends there (on the
    tokenizer's EOS, or on the text's last token where it is a stop token: `stop_tags`)."""
    from lightllm.engine.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    stops = [tokenizer.convert_tokens_to_ids(tag) for tag in stop_tags] + [tokenizer.eos_token_id]
    grammars = Grammars(str(tokenizer_dir), len(tokenizer), stop_token_ids=stops)

    def accepts(spec: str, text: str) -> bool:
        matcher = grammars.matcher("structural_tag", spec)
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids += [] if ids[-1] in stops else [tokenizer.eos_token_id]
        return all(matcher._matcher.accept_token(i) for i in ids) and matcher.terminated

    return accepts, tokenizer


def test_gpt_oss_forces_harmony_calls(tokenizer_dir):
    accepts, tokenizer = acceptor(tokenizer_dir)
    named, required, parallel = grammar("get_weather"), grammar("required"), grammar("required", parallel=True)
    for spec in (named, required):
        assert accepts(spec, FIRST) and accepts(spec, ANALYSIS + call())
        assert not accepts(spec, HERMES)  # the format the other models write
        assert not accepts(spec, "It is sunny.") and not accepts(spec, ANALYSIS.removesuffix("<|end|>"))
        assert not accepts(spec, call(head="", args={"city": "Tokyo", "days": "three"}))  # the schema's type
        assert not accepts(spec, call(head="", args={"city": "Rome", "days": 3}))
        assert not accepts(spec, FIRST + call())  # one call unless parallel
    assert not accepts(named, call("other", {}, head=""))  # the named function only
    assert accepts(required, call("other", {}, head=""))
    assert accepts(parallel, ANALYSIS + call() + call("other", {})) and accepts(parallel, FIRST)
    assert not accepts(parallel, ANALYSIS + ANALYSIS + call())
    if "<|call|>" in tokenizer.get_vocab():  # gpt-oss's generation config stops at <|call|>: it ends the grammar too
        ends_on_call, _ = acceptor(tokenizer_dir, stop_tags=("<|call|>", "<|return|>"))
        assert ends_on_call(named, ANALYSIS + call()) and ends_on_call(parallel, FIRST)


def test_forced_arguments_are_compact_json(default_model_dir):
    """A forced call's arguments admit no whitespace between JSON tokens (a model could pad them with
    it up to max_tokens), not even json.dumps' one space after ':' and ','; spaces inside a string stay."""
    accepts, _ = acceptor(default_model_dir)
    spec = grammar("get_weather")
    assert accepts(spec, call(args='{"city":"Tokyo","days":3}', head=""))
    for padded in ('{"city": "Tokyo", "days": 3}', '{ "city":"Tokyo","days":3}', '{"city":"Tokyo",\n"days":3}',
                   '{"city":"Tokyo","days":3 }', '{"city":\t"Tokyo","days":3}'):
        assert not accepts(spec, call(args=padded, head="")), padded
    spaced = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    from lightllm.server.httpserver.openai_params import FunctionDef, forced_call_grammar

    note = forced_call_grammar(gpt_oss_format(), [FunctionDef(name="n", parameters=spaced)], "n", False)[1]
    assert accepts(note, call("n", {"note": "two words,  a: b"}, head=""))


def test_reasoning_is_bounded_by_half_the_answer_budget(default_model_dir):
    """A forced call's reasoning may take at most half of max_new_tokens (and REASONING_MAX_TOKENS), so
    that the call fits in what is left: past that the mask (what the sampler draws from) allows only
    the way to the analysis' end."""
    import torch

    from lightllm.engine.grammar import Grammars, allocate_bitmask
    from lightllm.frontend.chat.harmony import REASONING_MAX_TOKENS

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    grammars = Grammars(str(default_model_dir), len(tokenizer))
    word = tokenizer.encode(" word", add_special_tokens=False)
    analysis = tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False) + word * 30

    def allowed_after_the_words(max_new_tokens: int) -> set[int]:
        matcher = grammars.matcher("structural_tag", grammar("get_weather", max_new_tokens=max_new_tokens))
        assert all(matcher.accept(i) for i in analysis)
        mask = allocate_bitmask(1, len(tokenizer))
        matcher.fill(mask, 0)
        bits = (mask[0].unsqueeze(1) >> torch.arange(32)) & 1
        return set(bits.flatten().nonzero().flatten().tolist())

    assert word[0] in allowed_after_the_words(62)  # 31 tokens of reasoning: one more word fits
    limited = allowed_after_the_words(60)
    assert word[0] not in limited and {tokenizer.decode([t]) for t in limited} <= {"<", "<|"}
    assert f'"max_tokens": {REASONING_MAX_TOKENS}' in grammar("get_weather", max_new_tokens=10 ** 6)
    assert "analysis" not in grammar("get_weather", max_new_tokens=1)


def test_harmony_calls_parse_back_and_write_as_harmony():
    fmt = gpt_oss_format()
    parsers = chat_parsers(None, None, "GptOssForCausalLM", None)
    assert parsers.tool_call_parser == "harmony"
    answer = parsers.answer_parser("<|start|>assistant", True).parse(ANALYSIS + call() + call("other", {}))
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [("get_weather", ARGS), ("other", {})]
    assert answer.content == "" and answer.reasoning == "The user wants the weather; call the tool."
    assert fmt.write("get_weather", ARGS) == FIRST
    assert chat_parsers("hermes", None, "GptOssForCausalLM", None).tool_call_parser == "hermes"  # the flag wins


# ---- end to end: a tiny gpt-oss server, its random model held to the forced grammar ----

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {}}}}]
WEATHER = [{"role": "user", "content": "Weather in Tokyo for three days?"}]


@pytest.fixture(scope="module")
def gpt_oss_server(tmp_path_factory):
    """tiny-gpt-oss (random weights, the default model's tokenizer: the harmony tags spelled out) with
    a harmony chat template; the reasoning and call formats are gpt-oss's defaults."""
    from server_utils import preset_server
    from test_harmony import HARMONY_TEMPLATE

    with preset_server(tmp_path_factory, "tiny-gpt-oss", ("--chat_template", HARMONY_TEMPLATE)) as (_, server):
        yield server


def test_a_forced_call_comes_back_as_a_harmony_call(gpt_oss_server):
    import openai

    client = openai.OpenAI(base_url=f"{gpt_oss_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=WEATHER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=320, temperature=0)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (only,) = choice.message.tool_calls
    fits_schema(only.function.name, only.function.arguments)
    assert "<|" not in (choice.message.reasoning_content or "")  # the tags are the parser's, not reasoning
    named = client.responses.create(model=model, input="Weather in Tokyo?", max_output_tokens=320, temperature=0,
                                    tools=[{"type": "function", **TOOLS[0]["function"]}],
                                    tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in named.output if item.type == "function_call"]
    assert len(calls) == 1 and named.output_text == "" and named.status == "completed", named.output
    assert calls[0].name == "get_weather"
    fits_schema("get_weather", calls[0].arguments)
    assert calls[0].arguments == compact(json.loads(calls[0].arguments))  # as the grammar had it written
    anthropic_any = anthropic_messages(gpt_oss_server, model)
    assert anthropic_any.stop_reason == "tool_use" and [b.type for b in anthropic_any.content][-1] == "tool_use"
    assert not [b for b in anthropic_any.content if b.type == "text"]
    use = anthropic_any.content[-1]
    fits_schema(use.name, json.dumps(use.input))


def anthropic_messages(server, model: str):
    """/v1/messages with tool_choice any, one call."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    return client.messages.create(model=model, max_tokens=320, messages=WEATHER, tools=tools,
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True})


def fits_schema(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "other":
        assert args == {}
        return
    assert name == "get_weather" and set(args) == {"city", "days"}
    assert args["city"] in ("Paris", "Tokyo") and isinstance(args["days"], int) and 1 <= args["days"] <= 7
