"""Anthropic's POST /v1/messages and /v1/messages/count_tokens end to end with Anthropic's client
on a tiny random model: whole and streamed answers agree (greedy), a tool round trip (tool_use
forced with tool_choice any, its tool_result, the answer), token counts, and bad bodies get 400
in Anthropic's error shape."""

import json

import anthropic
import pytest
import requests

from tool_model import WEATHER, matches

TOOLS = [{"name": "get_weather", "description": "a city's forecast", "input_schema": WEATHER}]
QUESTION = [{"role": "user", "content": "What will the weather be in Paris?"}]


@pytest.fixture(scope="module")
def client(tool_server):
    return anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(tool_server):
    return requests.get(f"{tool_server.url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_whole_and_streamed_agree(client, model):
    # greedy: this client no longer sends sampling fields of its own; the server still reads them
    request = dict(model=model, max_tokens=12, extra_body={"temperature": 0}, system="You are terse.",
                   messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}])
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    (block,) = whole.content
    assert block.type == "text" and block.text and final.content[0].text == block.text
    assert whole.stop_reason == final.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    counted = client.messages.count_tokens(model=model, system=request["system"], messages=request["messages"])
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_tool_round_trip(client, model):
    first = client.messages.create(model=model, max_tokens=200, messages=QUESTION, tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (tool_use,) = first.content
    assert first.stop_reason == "tool_use" and tool_use.type == "tool_use" and tool_use.name == "get_weather"
    assert matches(tool_use.input, WEATHER)
    history = [*QUESTION, {"role": "assistant", "content": [tool_use.model_dump(exclude_none=True)]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                             "content": "sunny, 21 C"}]}]
    answer = client.messages.create(model=model, max_tokens=8, extra_body={"temperature": 0}, messages=history,
                                    tools=TOOLS, tool_choice={"type": "none"})
    assert [block.type for block in answer.content] == ["text"] and answer.stop_reason == "max_tokens"
    with_result = client.messages.count_tokens(model=model, messages=history, tools=TOOLS).input_tokens
    without = client.messages.count_tokens(model=model, messages=history[:1], tools=TOOLS).input_tokens
    result_tokens = len(json.dumps(tool_use.input)) // 8  # the call and its result are in the prompt
    assert with_result > without + result_tokens


def test_streamed_named_tool(client, model):
    with client.messages.stream(model=model, max_tokens=200, messages=QUESTION, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        partial = "".join(event.delta.partial_json for event in stream
                          if event.type == "content_block_delta" and event.delta.type == "input_json_delta")
        final = stream.get_final_message()
    (tool_use,) = final.content
    assert json.loads(partial) == tool_use.input and matches(tool_use.input, WEATHER)


BAD_BODIES = {
    "no max_tokens": {"messages": QUESTION},
    "max_tokens 0": {"max_tokens": 0, "messages": QUESTION},
    "no messages": {"max_tokens": 4, "messages": []},
    "a system role": {"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
    "an image block": {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
    "a tool_result from the assistant": {"max_tokens": 4, "messages": [*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
    "tool_choice any without tools": {"max_tokens": 4, "messages": QUESTION, "tool_choice": {"type": "any"}},
    "a tool choice without its name": {"max_tokens": 4, "messages": QUESTION, "tools": TOOLS,
                                       "tool_choice": {"type": "tool"}},
    "temperature above 1": {"max_tokens": 4, "messages": QUESTION, "temperature": 1.5},
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_bodies_are_400_in_anthropic_shape(tool_server, model, body):
    response = requests.post(f"{tool_server.url}/v1/messages", json={"model": model, **body}, timeout=60)
    assert response.status_code == 400, response.text
    reply = response.json()
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]


def test_unknown_model_is_404_for_the_client(client):
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="claude-nonexistent", max_tokens=4, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="x", messages=[])
