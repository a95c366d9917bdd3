"""gpt-oss's harmony format parsed out of a chat answer (frontend/chat/harmony.py): the analysis
channel as reasoning, the final channel (and a commentary preamble) as content, a message to
functions.NAME as a tool call, whole or fed a character at a time; chosen for gpt-oss by default,
its special tokens kept in the text it reads; reasoning_effort reaches the chat template."""

import json

import pytest

from lightllm.frontend.chat.harmony import HarmonyParser
from lightllm.frontend.chat.output import chat_parsers, merge_events
from lightllm.frontend.chat.tool_calls import CallArgs, CallStart, Text

REASONING = "<|channel|>analysis<|message|>The user asks for the weather; call the tool.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"location": "Tokyo", "unit": "c"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 21 degrees in Tokyo.<|return|>"


def parse(text: str, step: int | None = None, calls: bool = True):
    """The answer of `text` fed whole, or `step` characters at a time, as a gpt-oss server parses it;
    `calls`: the request allows tool calls (tool_choice not none)."""
    parser = chat_parsers(None, None, "GptOssForCausalLM", None).answer_parser("<|start|>assistant", calls)
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return merge_events(events)


def plain(events) -> list:
    """Events without the calls' random ids."""
    return [(type(e).__name__, e.index, e.name) if isinstance(e, CallStart) else e for e in events]


@pytest.mark.parametrize("step", [None, 1, 3, 7])
def test_reasoning_then_a_call(step):
    got = parse(REASONING + CALL, step)
    assert plain(got) == [Text("The user asks for the weather; call the tool.", reasoning=True),
                          ("CallStart", 0, "get_weather"), CallArgs(0, '{"location": "Tokyo", "unit": "c"}')]
    assert json.loads(got[-1].text) == {"location": "Tokyo", "unit": "c"}


@pytest.mark.parametrize("step", [None, 1, 5])
def test_reasoning_then_the_final_answer(step):
    assert parse(REASONING + FINAL, step) == [Text("The user asks for the weather; call the tool.", reasoning=True),
                                              Text("It is 21 degrees in Tokyo.")]


def test_recipient_before_the_channel_a_preamble_and_two_calls():
    text = ("<|channel|>commentary<|message|>Checking both.<|end|>"
            '<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{"x": 1}<|call|>'
            '<|start|>assistant to=functions.b<|channel|>commentary json<|message|>{}<|call|>')
    assert plain(parse(text, 2)) == [Text("Checking both."), ("CallStart", 0, "a"), CallArgs(0, '{"x": 1}'),
                                     ("CallStart", 1, "b"), CallArgs(1, "{}")]


@pytest.mark.parametrize("step", [None, 1, 4])
def test_no_calls_parsed_under_tool_choice_none(step):
    """tool_choice none: a call the model writes anyway is dropped (it is addressed to the function),
    the reasoning and the final answer around it are kept; with calls allowed the same text is a call."""
    text = REASONING + CALL + FINAL
    assert parse(text, step, calls=False) == [Text("The user asks for the weather; call the tool.", reasoning=True),
                                              Text("It is 21 degrees in Tokyo.")]
    assert ("CallStart", 0, "get_weather") in plain(parse(text, step, calls=True))


def test_text_without_harmony_is_content_and_an_unfinished_message_is_kept():
    assert parse("just words", 1) == [Text("just words")]
    assert parse("<|channel|>analysis<|message|>thinking but cut", 4) == [Text("thinking but cut", reasoning=True)]


def test_gpt_oss_reads_harmony_by_default_and_keeps_special_tokens():
    parsers = chat_parsers(None, None, "GptOssForCausalLM", None)
    assert parsers.reasoning is HarmonyParser and parsers.keeps_special_tokens
    others = chat_parsers(None, "qwen3", "Qwen3ForCausalLM", None)
    assert not others.keeps_special_tokens
    assert not chat_parsers(None, None, "LlamaForCausalLM", None).keeps_special_tokens
    answer = parsers.answer_parser("<|start|>assistant", True).parse(REASONING + CALL)
    assert answer.content == "" and answer.reasoning.startswith("The user asks")
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [("get_weather", {"location": "Tokyo",
                                                                                          "unit": "c"})]


def test_reasoning_effort_joins_the_template_kwargs():
    from lightllm.server.httpserver.openai_params import ChatRequest

    body = ChatRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="high")
    assert body.template_kwargs == {"reasoning_effort": "high"}
    body = ChatRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="low",
                       chat_template_kwargs={"reasoning_effort": "medium", "x": 1})
    assert body.template_kwargs == {"reasoning_effort": "medium", "x": 1}
    assert ChatRequest(messages=[{"role": "user", "content": "hi"}]).template_kwargs is None


HARMONY_TEMPLATE = ("effort={{ reasoning_effort | default('none') }}{% for m in messages %}<|start|>{{ m['role'] }}"
                    "<|message|>{{ m['content'] }}<|end|>{% endfor %}<|start|>assistant")
LOCATION = {"type": "object", "properties": {"location": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": LOCATION}}]


@pytest.fixture(scope="module")
def gpt_oss_served(default_model_dir):
    """The chat routes of a gpt-oss server (no --reasoning_parser: harmony by default) over a scripted engine
    that keeps the sampling parameters it is given."""
    import multiprocessing

    from test_chat_routes_scripted import ScriptedEngine
    from transformers import AutoTokenizer

    from lightllm.server.config import ServerConfig
    from lightllm.server.httpserver.app import create_app
    from lightllm.server.io_struct import RouterHeartbeat, RouterReady

    class Recording(ScriptedEngine):
        def generate(self, prompt_ids, sampling, **kw):
            self.sampling = sampling
            return super().generate(prompt_ids, sampling, **kw)

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    tokenizer.chat_template = HARMONY_TEMPLATE
    config = ServerConfig(model_dir=str(default_model_dir), served_model_name="scripted")
    info = {"architecture": "GptOssForCausalLM", "vocab_size": len(tokenizer),
            "eos_token_ids": [tokenizer.eos_token_id], "sampling_defaults": []}
    app = create_app(config, tokenizer, [RouterReady(100_000, info)], [RouterHeartbeat(multiprocessing)])
    app.state.server.manager = engine = Recording()
    return app, engine, tokenizer


@pytest.mark.parametrize("stream", [False, True])
def test_chat_route_returns_harmony_reasoning_and_call_apart(gpt_oss_served, stream):
    from test_chat_routes_scripted import chat, joined

    app, engine, tokenizer = gpt_oss_served
    reply = chat(gpt_oss_served, REASONING + CALL, stream=stream, tools=TOOLS, reasoning_effort="high")
    assert engine.sampling.skip_special_tokens is False  # the parser reads the tags
    assert tokenizer.decode(engine.prompts[-1]).startswith("effort=high")
    if stream:
        got = joined(reply)
        content, reasoning, finish = got["content"], got["reasoning"], got["finish"]
        calls = [(c["name"], c["arguments"]) for c in got["calls"]]
    else:
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        content, reasoning = message.content, message.reasoning_content
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert not content and reasoning == "The user asks for the weather; call the tool." and finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", {"location": "Tokyo", "unit": "c"})]
    final = chat(gpt_oss_served, REASONING + FINAL, stream=False)
    assert final.choices[0].message.content == "It is 21 degrees in Tokyo."


def test_responses_round_trip_of_a_call_and_its_result(gpt_oss_served):
    """/v1/responses through OpenAI's client: the harmony answer's reasoning and call come back as
    items (no reasoning in the output text); the call's result, sent back, reaches the prompt, and
    the final channel is the output text."""
    import openai
    from test_chat_routes_scripted import http, run

    app, engine, tokenizer = gpt_oss_served
    tools = [{"type": "function", **TOOLS[0]["function"]}]

    async def ask(text, input, **request):
        engine.text = text
        async with http(app) as client:
            api = openai.AsyncOpenAI(base_url="http://scripted/v1", api_key="unused", http_client=client)
            return await api.responses.create(model="scripted", input=input, tools=tools, **request)

    first = run(ask(REASONING + CALL, "Weather in Tokyo?", reasoning={"effort": "low"}))
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text.startswith("The user asks")
    assert call.type == "function_call" and call.name == "get_weather" and first.output_text == ""
    assert tokenizer.decode(engine.prompts[-1]).startswith("effort=low")
    history = [{"role": "user", "content": "Weather in Tokyo?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}]
    second = run(ask(REASONING + FINAL, history))
    assert "21 C, sunny" in tokenizer.decode(engine.prompts[-1])
    assert second.output_text == "It is 21 degrees in Tokyo." and second.output[-1].type == "message"


def ask_route(served, route: str, choice: str, text: str) -> tuple[str, str, list]:
    """(content, reasoning, [(name, arguments)]) of a harmony answer `text` to a request on `route`
    (chat, chat-stream, responses or messages) with get_weather as a tool and tool_choice `choice`."""
    import anthropic
    import openai
    from test_chat_routes_scripted import http, joined, run

    app, engine, tokenizer = served
    engine.text = text
    messages = [{"role": "user", "content": "Weather in Tokyo?"}]

    async def ask():
        async with http(app) as client:
            api = openai.AsyncOpenAI(base_url="http://scripted/v1", api_key="unused", http_client=client)
            if route.startswith("chat"):
                reply = await api.chat.completions.create(model="scripted", messages=messages, tools=TOOLS,
                                                          tool_choice=choice, stream=route == "chat-stream")
                if route == "chat-stream":
                    got = joined([chunk async for chunk in reply])
                    return got["content"], got["reasoning"], [(c["name"], c["arguments"]) for c in got["calls"]]
                message = reply.choices[0].message
                return (message.content or "", message.reasoning_content or "",
                        [(c.function.name, c.function.arguments) for c in message.tool_calls or ()])
            if route == "responses":
                reply = await api.responses.create(model="scripted", input=messages, tool_choice=choice,
                                                   tools=[{"type": "function", **TOOLS[0]["function"]}])
                reasoning = "".join(c.text for i in reply.output if i.type == "reasoning" for c in i.content)
                return reply.output_text, reasoning, [(i.name, i.arguments) for i in reply.output
                                                      if i.type == "function_call"]
            api = anthropic.AsyncAnthropic(base_url="http://scripted", api_key="unused", http_client=client)
            reply = await api.messages.create(model="scripted", max_tokens=64, messages=messages,
                                              tools=[{"name": "get_weather", "input_schema": LOCATION}],
                                              tool_choice={"type": choice})
            blocks = reply.content
            return ("".join(b.text for b in blocks if b.type == "text"),
                    "".join(b.thinking for b in blocks if b.type == "thinking"),
                    [(b.name, json.dumps(b.input)) for b in blocks if b.type == "tool_use"])

    return run(ask())


@pytest.mark.parametrize("route", ["chat", "chat-stream", "responses", "messages"])
def test_tool_choice_none_offers_no_tools_and_returns_no_calls(gpt_oss_served, route):
    """gpt-oss under tool_choice none: the prompt lists no tools, and a call the model writes anyway
    is no tool call (dropped), on each chat route; under auto the same answer is the call."""
    app, engine, tokenizer = gpt_oss_served
    content, reasoning, calls = ask_route(gpt_oss_served, route, "none", REASONING + CALL + FINAL)
    assert "get_weather" not in tokenizer.decode(engine.prompts[-1])
    assert (content, calls) == ("It is 21 degrees in Tokyo.", [])
    assert reasoning == "The user asks for the weather; call the tool."
    content, _, calls = ask_route(gpt_oss_served, route, "auto", REASONING + CALL + FINAL)
    assert "get_weather" in tokenizer.decode(engine.prompts[-1])
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", {"location": "Tokyo", "unit": "c"})]
