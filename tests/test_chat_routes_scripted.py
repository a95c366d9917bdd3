"""The chat routes' parsing path with the model's text given: an engine stand-in answers every
request with a scripted text (a random model never writes a tool call of its own accord), and
OpenAI's and Anthropic's clients read the answers of /v1/chat/completions, /v1/responses and
/v1/messages in process. What must hold: the calls and the reasoning in the text come back as
each API's fields, whole and streamed alike, and the tools reach the prompt."""

import asyncio
import json
import multiprocessing

import anthropic
import httpx2
import openai
import pytest
from transformers import AutoTokenizer

from lightllm.server.config import ServerConfig
from lightllm.server.httpserver.app import create_app
from lightllm.engine.request import FinishReason
from lightllm.server.io_struct import RouterHeartbeat, RouterReady, TextOut
from tool_model import TOOL_TEMPLATE

CALL_ARGS = {"city": "Paris", "days": 3, "note": "a \"quoted\" </tool_call> inside"}
THINK = "The user asks for the weather; I should call the tool."
TEXTS = {
    "call": f'<think>\n{THINK}\n</think>\n\nLet me check.\n<tool_call>\n'
            f'{json.dumps({"name": "get_weather", "arguments": CALL_ARGS})}\n</tool_call>',
    "plain": f"<think>\n{THINK}\n</think>\n\nIt is sunny in Paris.",
}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": CITY}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedEngine:
    """HttpServerManager's part that the routes use: each request's answer is `self.text`, a few
    characters per output; the prompts it was given are kept."""

    def __init__(self):
        self.text = ""
        self.prompts: list[list[int]] = []

    def check_queue(self, count: int = 1) -> None:
        pass

    def backlog(self, req_id: int) -> int:
        return 0  # each output is made when the stream asks for it: none ever waits

    async def generate(self, prompt_ids, sampling, *, bounded=True, lora_id=0):
        self.prompts.append(prompt_ids)
        pieces = [self.text[i:i + 3] for i in range(0, len(self.text), 3)] or [""]
        for n, piece in enumerate(pieces, 1):
            await asyncio.sleep(0)
            yield TextOut(0, n, piece, 0.0, False, n, FinishReason.EOS if n == len(pieces) else None)


@pytest.fixture(scope="module")
def served(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    tokenizer.chat_template = TOOL_TEMPLATE
    config = ServerConfig(model_dir=str(default_model_dir), served_model_name="scripted", reasoning_parser="qwen3")
    info = {"architecture": "Qwen3ForCausalLM", "vocab_size": len(tokenizer), "eos_token_ids": [tokenizer.eos_token_id],
            "sampling_defaults": []}
    app = create_app(config, tokenizer, [RouterReady(100_000, info)], [RouterHeartbeat(multiprocessing)])
    engine = ScriptedEngine()
    app.state.server.manager = engine
    return app, engine, tokenizer


def http(app) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://scripted")


def run(coro):
    return asyncio.run(coro)


def chat(served, text: str, stream: bool, **request):
    app, engine, _ = served
    engine.text = text

    async def ask():
        async with http(app) as client:
            api = openai.AsyncOpenAI(base_url="http://scripted/v1", api_key="unused", http_client=client)
            reply = await api.chat.completions.create(model="scripted", messages=MESSAGES, stream=stream, **request)
            return [chunk async for chunk in reply] if stream else reply

    return run(ask())


def joined(chunks) -> dict:
    """A stream's deltas, gathered as a client gathers them."""
    content, reasoning, calls, reasons = "", "", {}, []
    for chunk in chunks:
        (choice,) = chunk.choices
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            assert call.id is None or call.id == entry["id"]
            entry["arguments"] += call.function.arguments or ""
        reasons.append(choice.finish_reason)
    return {"content": content, "reasoning": reasoning, "calls": list(calls.values()), "finish": reasons[-1]}


def test_chat_auto_returns_the_call_and_the_reasoning(served):
    reply = chat(served, TEXTS["call"], stream=False, tools=TOOLS)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == THINK
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == CALL_ARGS


def test_chat_stream_gathers_into_the_whole_answer(served):
    chunks = chat(served, TEXTS["call"], stream=True, tools=TOOLS)
    whole = chat(served, TEXTS["call"], stream=False, tools=TOOLS).choices[0]
    got = joined(chunks)
    assert (got["content"], got["reasoning"], got["finish"]) == ("Let me check.", THINK, "tool_calls")
    (call,) = got["calls"]
    assert call["name"] == "get_weather" and call["arguments"] == whole.message.tool_calls[0].function.arguments
    # as OpenAI streams a call: its first delta has the id, type and name; the arguments come in several
    firsts = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert firsts[0].id and firsts[0].type == "function" and firsts[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in firsts[1:]) and len(firsts) > 3


def test_no_tools_no_calls(served):
    """tool_choice none: a call in the text is text; without calls the finish reason is stop."""
    reply = chat(served, TEXTS["call"], stream=False, tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.tool_calls is None and "<tool_call>" in reply.choices[0].message.content
    plain = chat(served, TEXTS["plain"], stream=False, tools=TOOLS).choices[0]
    assert (plain.finish_reason, plain.message.content) == ("stop", "It is sunny in Paris.")
    assert plain.message.tool_calls is None


def test_tools_reach_the_prompt(served):
    app, engine, tokenizer = served
    chat(served, TEXTS["plain"], stream=False, tools=TOOLS)
    prompt = tokenizer.decode(engine.prompts[-1])
    assert json.dumps(TOOLS[0]) in prompt


def responses(served, text: str, stream: bool, **request):
    app, engine, _ = served
    engine.text = text

    async def ask():
        async with http(app) as client:
            api = openai.AsyncOpenAI(base_url="http://scripted/v1", api_key="unused", http_client=client)
            if not stream:
                return await api.responses.create(model="scripted", input="Weather in Paris?", **request)
            async with api.responses.stream(model="scripted", input="Weather in Paris?", **request) as events:
                kinds = [event.type async for event in events]
                return kinds, await events.get_final_response()

    return run(ask())


def test_responses_items_whole_and_streamed(served):
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    whole = responses(served, TEXTS["call"], stream=False, tools=tools)
    kinds, final = responses(served, TEXTS["call"], stream=True, tools=tools)
    for response in (whole, final):
        reasoning, message, call = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == THINK
        assert message.type == "message" and response.output_text == "Let me check."
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == CALL_ARGS and response.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert {"response.reasoning_text.delta", "response.output_text.delta",
            "response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(kinds)
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3


def messages(served, text: str, stream: bool, **request):
    app, engine, _ = served
    engine.text = text

    async def ask():
        async with http(app) as client:
            api = anthropic.AsyncAnthropic(base_url="http://scripted", api_key="unused", http_client=client)
            body = dict(model="scripted", max_tokens=64, messages=MESSAGES, **request)
            if not stream:
                return await api.messages.create(**body)
            async with api.messages.stream(**body) as events:
                kinds = [event.type async for event in events]
                return kinds, await events.get_final_message()

    return run(ask())


def test_messages_blocks_whole_and_streamed(served):
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    whole = messages(served, TEXTS["call"], stream=False, tools=tools)
    kinds, final = messages(served, TEXTS["call"], stream=True, tools=tools)
    for message in (whole, final):
        thinking, text, tool_use = message.content
        assert (thinking.type, thinking.thinking) == ("thinking", THINK)
        assert (text.type, text.text) == ("text", "Let me check.")
        assert (tool_use.type, tool_use.name, tool_use.input) == ("tool_use", "get_weather", CALL_ARGS)
        assert message.stop_reason == "tool_use"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    plain = messages(served, TEXTS["plain"], stream=False)
    assert [block.type for block in plain.content] == ["thinking", "text"] and plain.stop_reason == "end_turn"
