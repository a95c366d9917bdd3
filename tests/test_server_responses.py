"""POST /v1/responses end to end with OpenAI's client on a tiny random model: whole and streamed
answers agree (greedy), a tool round trip (a forced call, its output, the answer), and bad bodies
get 400 in OpenAI's shape."""

import json

import openai
import pytest
import requests

from tool_model import WEATHER, matches

TOOLS = [{"type": "function", "name": "get_weather", "description": "a city's forecast", "parameters": WEATHER}]


@pytest.mark.parametrize("request_input", [
    "What is the capital of France?",
    [{"role": "developer", "content": "Answer briefly."},
     {"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
], ids=["text", "messages"])
def test_whole_and_streamed_agree(client, model, request_input):
    request = dict(model=model, input=request_input, instructions="You are terse.", temperature=0,
                   max_output_tokens=12)
    whole = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert whole.output_text and final.output_text == whole.output_text
    assert whole.status == final.status == "incomplete"  # max_output_tokens ran out: no EOS from a random model
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens == final.usage.input_tokens
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]


def test_tool_round_trip(client, model, tool_server):
    question = [{"role": "user", "content": "What will the weather be in Paris?"}]
    first = client.responses.create(model=model, input=question, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert matches(json.loads(call.arguments), WEATHER)
    history = [*question, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    answer = client.responses.create(model=model, input=history, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=8, temperature=0)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    # the call and its output reached the prompt
    tokens = tool_server.post("/tokenize", {"messages": [
        *question, {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
        "tools": [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]}).json()
    assert answer.usage.input_tokens == tokens["count"]


def test_streamed_forced_call(client, model):
    with client.responses.stream(model=model, input="Weather in Oslo?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=200) as stream:
        deltas = [event.delta for event in stream if event.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (call,) = final.output
    assert "".join(deltas) == call.arguments and matches(json.loads(call.arguments), WEATHER)


BAD_BODIES = {
    "previous_response_id": {"input": "hi", "previous_response_id": "resp_123"},
    "empty input": {"input": ""},
    "an unknown item type": {"input": [{"type": "image_generation_call", "id": "x"}]},
    "an image part": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    "required without tools": {"input": "hi", "tool_choice": "required"},
    "call arguments that are no object": {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                                     "arguments": "nope"}]},
    "background": {"input": "hi", "background": True},
    "an unknown field": {"input": "hi", "frobnicate": 1},
    "a negative max_output_tokens": {"input": "hi", "max_output_tokens": -1},
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_bodies_are_400_in_openai_shape(tool_server, body):
    response = requests.post(f"{tool_server.url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] == 400


def test_previous_response_id_says_why(client, model):
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        client.responses.create(model=model, input="hi", previous_response_id="resp_1")
