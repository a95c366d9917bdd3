"""Tool calls on /v1/chat/completions, end to end with OpenAI's client on a tiny random model:
`required` and a named function are forced by the grammar, so that even this model answers with
a call whose arguments parse and match the function's schema, whole and streamed. Histories with
calls and results, and chat_template_kwargs, reach the template (/tokenize shows the prompt)."""

import json

import pytest
import requests

from tool_model import TIME, WEATHER, matches

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "a city's forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What will the weather be in Paris?"}]


def check_call(name: str, arguments: str, allowed) -> None:
    assert name in allowed
    assert matches(json.loads(arguments), SCHEMAS[name]), arguments


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_returns_a_valid_call(client, model, seed):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, seed=seed, max_tokens=200)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    check_call(call.function.name, call.function.arguments, SCHEMAS)
    assert call.id.startswith("call_") and call.type == "function"


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_streamed(client, model, name):
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=200, stream=True, temperature=1.0))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first, *rest = deltas
    assert (first.index, first.type, first.function.name) == (0, "function", name) and first.id
    assert all(d.index == 0 and d.id is None for d in rest)
    check_call(name, "".join(d.function.arguments or "" for d in deltas), [name])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_history_and_template_kwargs_reach_the_prompt(tool_server):
    call = {"id": "call_7", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 2}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"}]
    body = {"messages": messages, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    response = tool_server.post("/tokenize", body)
    assert response.status_code == 200, response.text
    detokenized = tool_server.post("/detokenize", {"tokens": response.json()["tokens"]}).json()["prompt"]
    assert '"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 2}' in detokenized
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in detokenized
    assert json.dumps(TOOLS[1]) in detokenized
    assert detokenized.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


BAD_BODIES = {
    "required without tools": {"tool_choice": "required"},
    "a function not in tools": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    "an unknown tool_choice": {"tools": TOOLS, "tool_choice": "sometimes"},
    "a tool that is not a function": {"tools": [{"type": "retrieval"}]},
    "a bad function name": {"tools": [{"type": "function", "function": {"name": "has space"}}]},
    "two functions of one name": {"tools": [TOOLS[0], TOOLS[0]]},
    "a schema xgrammar refuses": {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}}}],
        "tool_choice": "required"},
    "response_format with a forced call": {"tools": TOOLS, "tool_choice": "required",
                                           "response_format": {"type": "json_object"}},
    "history arguments that are no object": {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2"}}]}]},
    "a reserved template kwarg": {"chat_template_kwargs": {"add_generation_prompt": False}},
    "the legacy functions": {"functions": [{"name": "f"}]},
}


@pytest.mark.parametrize("extra", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_tool_bodies_are_400(tool_server, extra):
    body = {"messages": MESSAGES, "max_tokens": 4, **extra}
    response = requests.post(f"{tool_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
