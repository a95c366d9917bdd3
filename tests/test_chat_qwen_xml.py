"""Qwen3.5's chat format (--tool_call_parser qwen3_xml): tool calls as <function=NAME><parameter=ARG>
blocks whose values are typed by the tool's schema, and thinking that the prompt opens. The parser
whole and streamed at every split, the forced-call grammar, the default choice, and the OpenAI
route end to end with a scripted model text: a call, its result sent back, the final answer."""

import asyncio
import json
import multiprocessing

import openai
import pytest
from helpers.scripted import ScriptedEngine
from transformers import AutoTokenizer

from lightllm.frontend.chat.output import (FORMATS, Answer, AnswerParser,
                                           chat_parsers)
from lightllm.frontend.chat.reasoning import Qwen3Reasoning
from lightllm.frontend.chat.tool_calls import CallArgs, CallStart
from lightllm.server.config import ServerConfig
from lightllm.server.httpserver.app import create_app
from lightllm.server.io_struct import RouterHeartbeat, RouterReady

XML = FORMATS["qwen3_xml"]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "threshold": {"type": ["number", "null"]}, "hours": {"type": "array", "items": {"type": "integer"}},
    "where": {"type": "object"}, "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
    "required": ["city"]}
SCHEMAS = {"get_weather": WEATHER}


def block(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (text, content, reasoning, [(name, arguments as parsed JSON)])
CASES = [
    (block("get_weather", ("city", "Paris"), ("days", "3")), "", "", [("get_weather", {"city": "Paris", "days": 3})]),
    ("Let me look.\n\n" + block("get_weather", ("city", "São Paulo\n  two lines </tool_call>?"), ("metric", "true"),
                                ("threshold", "2.5"), ("hours", "[9, 12]"), ("where", '{"lat": 1}'), ("mode", "7"))
     + "\n" + block("get_weather", ("city", "Oslo"), ("threshold", "null")) + "\n",
     "Let me look.", "",
     [("get_weather", {"city": "São Paulo\n  two lines </tool_call>?", "metric": True, "threshold": 2.5,
                       "hours": [9, 12], "where": {"lat": 1}, "mode": 7}),
      ("get_weather", {"city": "Oslo", "threshold": None})]),
    # a value that does not read as its type stays the model's text; an unknown parameter is text
    (block("get_weather", ("days", "three"), ("hours", "[9,"), ("extra", "42")), "", "",
     [("get_weather", {"days": "three", "hours": "[9,", "extra": "42"})]),
    (block("no_schema", ("n", "1"), ("quote", 'say "hi"\\')), "", "",
     [("no_schema", {"n": "1", "quote": 'say "hi"\\'})]),
    # a missing </parameter> ends at the next tag; a call cut off keeps what it has
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>\n</tool_call>",
     "", "", [("get_weather", {"city": "Rome", "days": 2})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLim", "", "", [("get_weather", {"city": "Lim"})]),
    # malformed blocks are content, as the model wrote them
    *[(text, text, "", []) for text in ('Broken: <tool_call>\n{"name": "f"}\n</tool_call> end',
                                        "<tool_call><function=has space>\n</function></tool_call>")],
    ("<tool_call>\n<function=", "<tool_call>\n<function=", "", []),
    ("No call: <function=f> and <tool and < alone.", "No call: <function=f> and <tool and < alone.", "", []),
]
THINKING = [  # the prompt opened <think>: the answer starts inside it
    ("Weighing it.\n</think>\n\n" + block("get_weather", ("city", "Paris")), "", "Weighing it.",
     [("get_weather", {"city": "Paris"})]),
    ("Still thinking when cut", "", "Still thinking when cut", []),
    ("\n</think>\n\nNo need to think.", "No need to think.", "", []),
]


def xml_parser(prompt: str = ""):
    reasoning = Qwen3Reasoning.for_prompt(prompt) if prompt else None
    return AnswerParser(reasoning, XML.new_parser(SCHEMAS))


def summary(answer: Answer) -> tuple:
    return answer.content, answer.reasoning, [(c.name, json.loads(c.arguments)) for c in answer.calls]


def streamed(pieces: list[str], prompt: str = "") -> Answer:
    parser, answer = xml_parser(prompt), Answer()
    for piece in pieces:
        answer.add(parser.feed(piece))
    answer.add(parser.finish())
    return answer


ALL = [(text, *rest, "") for text, *rest in CASES] + [(text, *rest, "<|im_start|>assistant\n<think>\n")
                                                     for text, *rest in THINKING]


@pytest.mark.parametrize("text,content,reasoning,calls,prompt", ALL)
def test_whole_and_streamed_at_every_split(text, content, reasoning, calls, prompt):
    expected = (content, reasoning, calls)
    whole = xml_parser(prompt).parse(text)
    assert summary(whole) == expected
    arguments = [c.arguments for c in whole.calls]
    for cut in range(len(text) + 1):
        answer = streamed([text[:cut], text[cut:]], prompt)
        assert summary(answer) == expected and [c.arguments for c in answer.calls] == arguments, cut
    one_by_one = streamed(list(text), prompt)
    assert summary(one_by_one) == expected and [c.arguments for c in one_by_one.calls] == arguments


def test_a_call_streams_its_name_first_and_a_string_as_it_is_written():
    text = block("get_weather", ("city", "Buenos Aires"), ("days", "12"))
    parser = XML.new_parser(SCHEMAS)
    events = [(i, e) for i in range(len(text)) for e in parser.feed(text[i])]
    events += [(len(text), e) for e in parser.finish()]
    (start_at, start), *args = events
    assert isinstance(start, CallStart) and start.name == "get_weather" and start_at < text.index("Buenos")
    assert all(isinstance(e, CallArgs) for _, e in args)
    inside = [at for at, _ in args if text.index("Buenos") < at < text.index("Aires") + 5]
    assert len(inside) >= 5  # the string streams character by character
    assert "".join(e.text for _, e in args) == '{"city": "Buenos Aires", "days": 12}'


def test_written_calls_parse_back_typed():
    args = {"city": "Zürich\nline", "days": 4, "metric": False, "hours": [1, 2], "where": {"q": "\"}"}}
    (call,) = AnswerParser(None, XML.new_parser(SCHEMAS)).parse(XML.write("get_weather", args)).calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", args)


def test_the_template_chooses_the_format():
    qwen35_template = "{%- for call in message.tool_calls %}<tool_call>\n<function={{ call.name }}>\n"
    assert chat_parsers(None, None, "Qwen3ForCausalLM", qwen35_template).call_format is XML
    assert chat_parsers(None, None, "Qwen3ForCausalLM", "... <tool_call> ...").call_format is FORMATS["hermes"]
    qwen35 = chat_parsers(None, None, "Qwen3_5MoeForConditionalGeneration", None)
    assert qwen35.call_format is XML and qwen35.reasoning is Qwen3Reasoning
    assert chat_parsers(None, None, "Qwen3ForCausalLM", None).reasoning is None


def test_forced_grammar_takes_exactly_the_calls_it_should(default_model_dir):
    from lightllm.engine.grammar import Grammars
    from lightllm.frontend.errors import RequestError
    from lightllm.server.httpserver.openai_params import FunctionDef, check_parameters, forced_call_grammar

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"]}
    tools = [FunctionDef(name="get_weather", parameters=schema), FunctionDef(name="other")]
    _, spec = forced_call_grammar(XML, tools, "get_weather", parallel=False)
    grammars = Grammars(default_model_dir, len(tokenizer))

    def accepts(text: str, spec: str = spec) -> bool:
        matcher = grammars.matcher("structural_tag", spec)
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return all(matcher._matcher.accept_token(i) for i in ids) and matcher.terminated

    good = XML.write("get_weather", {"city": "Paris </x>", "days": 3})
    assert accepts(good)
    assert not accepts(XML.write("get_weather", {"city": "Paris", "days": "three"}))  # its type
    assert not accepts(XML.write("get_weather", {"city": "Paris"}))  # a required parameter
    assert not accepts(XML.write("other", {}))  # another function than the named one
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>')
    assert not accepts("Paris is sunny.")
    two = good + XML.separator + good
    assert not accepts(two)
    _, parallel = forced_call_grammar(XML, tools, "required", parallel=True)
    no_arguments = "<tool_call>\n<function=other>\n\n</function>\n</tool_call>"  # xgrammar's layout of none
    assert accepts(two, parallel) and accepts(no_arguments, parallel)
    unusable = FunctionDef(name="unusable", parameters={"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}})
    with pytest.raises(RequestError, match="function 'unusable'"):  # a 400 that names it, before any parse
        check_parameters(unusable)
    assert AnswerParser(None, XML.new_parser()).parse(no_arguments).calls[0].arguments == "{}"


# ---- end to end: the OpenAI route, a scripted model text ----

QWEN35_TEMPLATE = """\
{%- if tools -%}
<|im_start|>system
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>
<function=NAME>
<parameter=ARG>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
<function={{ call.function.name }}>
{% for key, value in call.function.arguments | items %}<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
<think>
{% if enable_thinking is defined and not enable_thinking %}
</think>

{% endif %}
{%- endif -%}
"""
THINK = "The user wants the weather in Paris for three days."
CALL_ARGS = {"city": "Paris", "days": 3, "metric": True}
CALL_TEXT = f"{THINK}\n</think>\n\nChecking.\n" + block("get_weather", ("city", "Paris"), ("days", "3"),
                                                         ("metric", "true"))
FINAL_TEXT = f"{THINK}\n</think>\n\nSunny, 21 degrees."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]




@pytest.fixture(scope="module")
def served(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    tokenizer.chat_template = QWEN35_TEMPLATE
    config = ServerConfig(model_dir=str(default_model_dir), served_model_name="scripted")  # parsers by default
    info = {"architecture": "Qwen3_5ForConditionalGeneration", "vocab_size": len(tokenizer),
            "eos_token_ids": [tokenizer.eos_token_id], "sampling_defaults": []}
    app = create_app(config, tokenizer, [RouterReady(100_000, info)], [RouterHeartbeat(multiprocessing)])
    app.state.server.manager = engine = ScriptedEngine()
    return app, engine, tokenizer


def chat(served, text: str, messages: list[dict], stream: bool):
    import httpx2

    app, engine, _ = served
    engine.text = text

    async def ask():
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://scripted") as client:
            api = openai.AsyncOpenAI(base_url="http://scripted/v1", api_key="unused", http_client=client)
            reply = await api.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, stream=stream)
            return [chunk async for chunk in reply] if stream else reply

    return asyncio.run(ask())


def gathered(chunks) -> tuple:
    content, reasoning, calls = "", "", {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, [call.function.name, ""])
            entry[1] += call.function.arguments or ""
    calls = [(name, json.loads(args)) for name, args in calls.values()]
    return content, reasoning, calls, chunks[-1].choices[0].finish_reason


def test_openai_chat_round_trip(served):
    """The call comes back typed, whole and streamed, its reasoning apart; the call and its result,
    sent back, reach the prompt in the model's own form; the final answer is content."""
    app, engine, tokenizer = served
    question = [{"role": "user", "content": "Weather in Paris for three days?"}]
    reply = chat(served, CALL_TEXT, question, stream=False).choices[0]
    assert (reply.finish_reason, reply.message.content, reply.message.reasoning_content) == ("tool_calls", "Checking.",
                                                                                          THINK)
    (call,) = reply.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", CALL_ARGS)
    assert tokenizer.decode(engine.prompts[-1]).endswith("<|im_start|>assistant\n<think>\n")
    streamed_reply = gathered(chat(served, CALL_TEXT, question, stream=True))
    assert streamed_reply == ("Checking.", THINK, [("get_weather", CALL_ARGS)], "tool_calls")

    history = question + [reply.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    final = chat(served, FINAL_TEXT, history, stream=False).choices[0]
    prompt = tokenizer.decode(engine.prompts[-1])
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n" \
           "<parameter=metric>\ntrue\n</parameter>\n</function>" in prompt
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in prompt
    answer = (final.finish_reason, final.message.content, final.message.reasoning_content)
    assert answer == ("stop", "Sunny, 21 degrees.", THINK)
    assert final.message.tool_calls is None


def test_anthropic_messages_thinking_and_typed_tool_use(served):
    """/v1/messages: the thinking block, the text, and the call's input typed by its input_schema,
    whole and streamed."""
    import anthropic
    import httpx2

    app, engine, _ = served
    engine.text = CALL_TEXT
    tools = [{"name": "get_weather", "input_schema": WEATHER}]

    async def ask(stream: bool):
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://scripted") as client:
            api = anthropic.AsyncAnthropic(base_url="http://scripted", api_key="unused", http_client=client)
            body = dict(model="scripted", max_tokens=64, tools=tools,
                        messages=[{"role": "user", "content": "Weather in Paris?"}])
            if not stream:
                return await api.messages.create(**body)
            async with api.messages.stream(**body) as events:
                return await events.get_final_message()

    for message in (asyncio.run(ask(False)), asyncio.run(ask(True))):
        thinking, text, tool_use = message.content
        assert (thinking.type, thinking.thinking) == ("thinking", THINK)
        assert (text.type, text.text) == ("text", "Checking.")
        assert (tool_use.type, tool_use.name, tool_use.input) == ("tool_use", "get_weather", CALL_ARGS)
        assert message.stop_reason == "tool_use"
