"""OpenAI's Responses API, stateless: POST /v1/responses.

`input` is a text or a list of items: messages, function_call and function_call_output items
(a tool round trip) and reasoning items, written into the chat template like /v1/chat/completions'
messages; `instructions` is the system message. The answer's output items are its reasoning
(--reasoning_parser), its text (a message) and its function calls, whole or as the API's streamed
events (response.created ... response.completed). Nothing is stored: `previous_response_id`
is refused; send the whole conversation as `input`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Discriminator, Field, Tag

from lightllm.engine.request import FinishReason
from lightllm.frontend.chat.output import Block, Blocks, answer_blocks
from lightllm.frontend.errors import RequestError
from lightllm.frontend.sampling_ranges import SEED_BOUND
from lightllm.server.httpserver.chat_prompt import chat_inputs
from lightllm.server.httpserver.generation import Generation, failure, sampling_of
from lightllm.server.httpserver.json_body import add_json_route
from lightllm.server.httpserver.openai_api import check_request
from lightllm.server.httpserver.openai_params import (LENIENT, FunctionDef, FunctionName, JsonSchemaFormat, OpenAIBody,
                                                      ResponseFormat, call_for_template, check_tools)
from lightllm.server.httpserver.params import STRICT
from lightllm.server.io_struct import TextOut


class InputText(BaseModel):
    model_config = LENIENT
    type: Literal["input_text", "output_text", "text"] = Field(description="only text parts are supported")
    text: str


class InputMessage(BaseModel):
    model_config = LENIENT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = LENIENT
    type: Literal["function_call"]
    call_id: str
    name: FunctionName
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = LENIENT
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningText(BaseModel):
    model_config = LENIENT
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    model_config = LENIENT
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


def _item_type(item) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(FunctionDef):
    type: Literal["function"] = Field(description="only functions")


class NamedFunctionChoice(BaseModel):
    model_config = LENIENT
    type: Literal["function"]
    name: FunctionName


class TextFormat(JsonSchemaFormat):
    type: Literal["text", "json_object", "json_schema"]


class TextConfig(BaseModel):
    model_config = LENIENT
    format: TextFormat | None = None


class Reasoning(BaseModel):
    model_config = LENIENT
    effort: str | None = Field(None, description="passed to the chat template as reasoning_effort")
    summary: str | None = None


class ResponsesRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = Field(None, description="the system message")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    text: TextConfig | None = Field(None, description="{'format': {'type': 'json_schema', 'schema': ...}}: "
                                                      "structured output (xgrammar)")
    reasoning: Reasoning | None = None
    previous_response_id: str | None = Field(None, description="refused: nothing is stored")
    store: bool | None = Field(None, description="ignored: nothing is stored")
    background: bool | None = Field(None, description="only false")
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = Field(None, description="only 'disabled': a long input is refused")
    seed: int | None = Field(None, ge=0, lt=SEED_BOUND)  # the shared range: OpenAIBody refuses the rest (a 500 before)
    chat_template_kwargs: dict | None = None

    def check(self) -> None:
        if self.previous_response_id is not None:
            raise RequestError("'previous_response_id' is not supported: this server stores no responses; "
                               "send the whole conversation as 'input'")
        if self.background:
            raise RequestError("'background' is not supported: responses are answered while the request is open")
        check_tools(self.tools, self.choice if self.tool_choice is not None else None)
        if self.choice not in ("none", "auto") and self.text is not None and self.text.format is not None \
                and self.text.format.type != "text":
            raise RequestError("'text.format' cannot be combined with a forced tool call ('tool_choice')")

    @property
    def choice(self) -> str:
        if isinstance(self.tool_choice, NamedFunctionChoice):
            return self.tool_choice.name
        return self.tool_choice or ("auto" if self.tools else "none")

    def openai_body(self) -> OpenAIBody:
        """The sampling fields, as /v1/chat/completions reads them."""
        fmt = self.text.format if self.text is not None else None
        response_format = None if fmt is None else ResponseFormat(type=fmt.type, json_schema=JsonSchemaFormat(
            name=fmt.name, schema=fmt.schema_, strict=fmt.strict) if fmt.type == "json_schema" else None)
        return OpenAIBody(model=self.model, max_tokens=self.max_output_tokens, temperature=self.temperature,
                          top_p=self.top_p, seed=self.seed, response_format=response_format)

    def template_options(self) -> dict | None:
        if self.reasoning is None or self.reasoning.effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning.effort, **(self.chat_template_kwargs or {})}

    def template_messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        reasoning = ""  # a reasoning item's text goes with the assistant turn that follows it
        for i, item in enumerate(self.input):
            if isinstance(item, ReasoningItem):
                reasoning += "".join(part.text for part in item.content or item.summary)
            elif isinstance(item, FunctionCallItem):
                call = call_for_template(item.name, item.arguments, item.call_id, f"input[{i}]")
                assistant_turn(messages, reasoning)["tool_calls"].append(call)
                reasoning = ""
            elif isinstance(item, FunctionCallOutputItem):
                output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output,
                                 **called_name(messages, item.call_id)})
            elif item.role == "assistant":
                messages.append({"role": "assistant", "content": item.text, "tool_calls": []})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = reasoning, ""
            else:
                messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text})
        return [{k: v for k, v in m.items() if v != [] or k != "tool_calls"} for m in messages]


def assistant_turn(messages: list[dict], reasoning: str) -> dict:
    """The assistant message that a function call belongs to: the last one, unless a result or a
    user's turn came after it."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": "", "tool_calls": []})
    if reasoning:
        messages[-1]["reasoning_content"] = messages[-1].get("reasoning_content", "") + reasoning
    return messages[-1]


def called_name(messages: list[dict], call_id: str) -> dict:
    for message in reversed(messages):
        for call in message.get("tool_calls", ()):
            if call["id"] == call_id:
                return {"name": call["function"]["name"]}
    return {}


def add_responses_routes(app: FastAPI) -> None:
    add_json_route(app, "/v1/responses", responses)


async def responses(request: Request, body: ResponsesRequest) -> Response:
    start = time.monotonic()
    state = request.app.state.server
    body.check()
    openai_body = body.openai_body()
    lora_id = check_request(openai_body, state)
    sampling = await sampling_of(state, openai_body, state.sampling_defaults)
    text, prompt_ids = await chat_inputs(state, body.template_messages(), body.tools or [], body.choice,
                                         body.parallel_tool_calls is not False, body.template_options(), sampling,
                                         body.max_output_tokens is not None, "max_output_tokens")
    parser = state.chat.answer_parser(text, body.choice != "none", body.tools)
    generation = Generation(request, [prompt_ids], sampling, start, "max_output_tokens", lora_id=lora_id)
    fmt = ResponseFormatter(body, body.model if lora_id else state.config.served_model_name)
    if not body.stream:
        (choice,) = await generation.result()
        blocks = answer_blocks(parser, choice.text)
        return JSONResponse(fmt.response(blocks, choice.last, usage(generation, choice.last)))
    firsts = await generation.first()
    return generation.event_stream(fmt.events(generation, firsts, parser))


def usage(generation: Generation, last: TextOut) -> dict:
    prompt, output = generation.prompt_len, last.count_output_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": generation.cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseFormatter:
    """The response object, its output items and its stream of events."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id, self.created_at = _new_id("resp"), int(time.time())
        self.item_ids: dict[int, str] = {}  # block position -> item id
        self.sequence = 0

    def response(self, blocks: list[Block], last: TextOut | None, usage: dict | None) -> dict:
        """The response object; `last` None: still in progress."""
        status = "in_progress" if last is None else \
            "incomplete" if last.finish_reason is FinishReason.LENGTH else "completed"
        items = [self.item(block, status="completed") for block in blocks]
        if last is not None and not any(block.kind == "text" for block in blocks) \
                and not any(block.kind == "call" for block in blocks):
            items.append(self.item(Block("text", len(blocks)), status="completed"))  # an empty answer
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": items, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel)
            else body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "store": False, "metadata": body.metadata or {},
            "text": {"format": {"type": "text"}}, "usage": usage,
        }

    def item(self, block: Block, status: str) -> dict:
        done = status == "completed"
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": self._item_id(block, "rs"), "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": block.text}] if done else []}
        if block.kind == "call":
            return {"type": "function_call", "id": self._item_id(block, "fc"), "call_id": block.call_id,
                    "name": block.name, "arguments": block.text if done else "", "status": status}
        return {"type": "message", "id": self._item_id(block, "msg"), "role": "assistant", "status": status,
                "content": [self.part(block.text)] if done else []}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item_id(self, block: Block, prefix: str) -> str:
        return self.item_ids.setdefault(block.position, _new_id(prefix))

    # ---- streaming ----

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def events(self, generation: Generation, firsts: list[TextOut], parser) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.response([], None, None))
        yield self.event("response.in_progress", response=self.response([], None, None))
        blocks = Blocks()
        async for _, out in generation.outputs(firsts):
            if out.finish_reason is FinishReason.ERROR:
                error = failure(out)
                yield self.event("error", code=error.error_type, message=str(error), param=None)
                return
            steps = blocks.feed(parser.feed(out.text) + (parser.finish() if out.finish_reason is not None else []))
            if out.finish_reason is not None:
                steps += blocks.close()
            for step in steps:
                for event in self.block_events(*step):
                    yield event
            if out.finish_reason is not None:
                if not blocks.blocks:  # an empty answer is an empty message
                    empty = Block("text", 0)
                    for step in (("start", empty), ("stop", empty)):
                        for event in self.block_events(*step):
                            yield event
                    blocks.blocks.append(empty)
                # response.completed even when max_output_tokens cut it (the response's status says
                # so): OpenAI's client waits for that event to hand over the final response
                final = self.response(blocks.blocks, out, usage(generation, out))
                yield self.event("response.completed", response=final)

    def block_events(self, step: str, block: Block, text: str = "") -> list[str]:
        where = {"item_id": self._item_id(block, {"reasoning": "rs", "call": "fc"}.get(block.kind, "msg")),
                 "output_index": block.position}
        if step == "start":
            events = [self.event("response.output_item.added", output_index=block.position,
                                 item=self.item(block, "in_progress"))]
            if block.kind != "call":
                events.append(self.event("response.content_part.added", **where, content_index=0,
                                         part=self._part_of(block, "")))
            return events
        if step == "delta":
            if block.kind == "call":
                return [self.event("response.function_call_arguments.delta", **where, delta=text)]
            if block.kind == "reasoning":
                return [self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)]
            return [self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])]
        if block.kind == "call":
            events = [self.event("response.function_call_arguments.done", **where, name=block.name,
                                 arguments=block.text)]
        elif block.kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=block.text)]
        else:
            events = [self.event("response.output_text.done", **where, content_index=0, text=block.text, logprobs=[])]
        if block.kind != "call":
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=self._part_of(block, block.text)))
        events.append(self.event("response.output_item.done", output_index=block.position,
                                 item=self.item(block, "completed")))
        return events

    def _part_of(self, block: Block, text: str) -> dict:
        return {"type": "reasoning_text", "text": text} if block.kind == "reasoning" else self.part(text)
