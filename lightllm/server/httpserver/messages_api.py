"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

`system` and `messages` (text, tool_use, tool_result and thinking blocks) are written into the
chat template like /v1/chat/completions' messages; the answer's content blocks are its thinking
(--reasoning_parser), its text and its tool_use calls, whole or as Anthropic's streamed events
(message_start ... message_stop). Errors have Anthropic's shape (errors.py).
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

from lightllm.frontend.chat.output import Block, Blocks, answer_blocks
from lightllm.server.httpserver.chat_prompt import chat_inputs, chat_prompt
from lightllm.server.httpserver.errors import anthropic_error
from lightllm.server.httpserver.generation import Generation, failure, sampling_of
from lightllm.frontend.errors import RequestError
from lightllm.server.httpserver.json_body import add_json_route
from lightllm.server.httpserver.lora_api import lora_id_of
from lightllm.server.httpserver.openai_api import check_request
from lightllm.server.httpserver.openai_params import (LENIENT, FunctionDef, FunctionName, OpenAIBody, check_tools,
                                                      template_tool)
from lightllm.server.httpserver.params import STRICT, NonEmptyStr
from lightllm.engine.request import FinishReason
from lightllm.server.io_struct import TextOut

STOP_REASONS = {FinishReason.LENGTH: "max_tokens", FinishReason.EOS: "end_turn", FinishReason.STOP: "stop_sequence"}


class TextBlock(BaseModel):
    model_config = LENIENT
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = LENIENT
    type: Literal["tool_use"]
    id: str
    name: FunctionName
    input: dict


class ToolResultBlock(BaseModel):
    model_config = LENIENT
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)


class ThinkingBlock(BaseModel):
    model_config = LENIENT
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = LENIENT
    type: Literal["redacted_thinking"]


def _block_type(block) -> str | None:
    return block.get("type") if isinstance(block, dict) else getattr(block, "type", None)


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type),
]


class AnthropicMessage(BaseModel):
    model_config = LENIENT
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class AnthropicTool(BaseModel):
    model_config = LENIENT
    name: FunctionName
    description: str | None = None
    input_schema: dict = Field(description="a JSON schema of the tool's input (an object)")
    type: Literal["custom"] | None = Field(None, description="only client tools")


class AnthropicToolChoice(BaseModel):
    model_config = LENIENT
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = LENIENT
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(BaseModel):
    model_config = STRICT

    model: NonEmptyStr
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = Field(None, description="disabled: enable_thinking false for the chat template")

    @property
    def functions(self) -> list[FunctionDef]:
        return [FunctionDef(name=t.name, description=t.description, parameters=t.input_schema)
                for t in self.tools or ()]

    @property
    def choice(self) -> str:
        """none, auto, required or a tool's name."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if choice.type == "tool":
            if choice.name is None:
                raise RequestError("'tool_choice': type 'tool' needs a 'name'")
            return choice.name
        return {"any": "required"}.get(choice.type, choice.type)

    def check(self) -> None:
        check_tools(self.functions, self.choice if self.tool_choice is not None else None)

    def template_options(self) -> dict | None:
        if self.thinking is None:
            return None
        return {"enable_thinking": self.thinking.type != "disabled"}

    @property
    def prompt_ending(self) -> dict:
        """Anthropic's prefill: a last assistant turn is continued, not followed by a new one."""
        prefill = self.messages[-1].role == "assistant"
        return {"add_generation_prompt": not prefill, "continue_final_message": prefill}

    def template_messages(self) -> list[dict]:
        system = self.system if isinstance(self.system, str) or self.system is None \
            else "".join(block.text for block in self.system)
        messages = [{"role": "system", "content": system}] if system else []
        for i, message in enumerate(self.messages):
            messages += turn_for_template(message, i)
        return messages


def turn_for_template(message: AnthropicMessage, i: int) -> list[dict]:
    """One Anthropic turn as template messages: a user's tool results are "tool" messages (before
    its text), an assistant's tool_use blocks its tool_calls, its thinking the reasoning_content."""
    blocks = message.blocks()
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    if message.role == "user":
        if any(isinstance(block, (ToolUseBlock, ThinkingBlock)) for block in blocks):
            raise RequestError(f"messages[{i}]: a user's turn holds text and tool_result blocks")
        results = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text}
                   for block in blocks if isinstance(block, ToolResultBlock)]
        return results + ([{"role": "user", "content": text}] if text or not results else [])
    if any(isinstance(block, ToolResultBlock) for block in blocks):
        raise RequestError(f"messages[{i}]: tool_result blocks belong in a user's turn")
    turn = {"role": "assistant", "content": text}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    thinking = "".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
    return [turn | ({"tool_calls": calls} if calls else {}) | ({"reasoning_content": thinking} if thinking else {})]


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[NonEmptyStr] | None = Field(None, max_length=16)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    metadata: dict | None = None
    service_tier: str | None = None

    def openai_body(self) -> OpenAIBody:
        # Anthropic's temperature defaults to 1.0 too
        return OpenAIBody(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                          top_k=self.top_k, stop=self.stop_sequences)

    @property
    def parallel(self) -> bool:
        return not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)


def add_messages_routes(app: FastAPI) -> None:
    add_json_route(app, "/v1/messages", messages)
    add_json_route(app, "/v1/messages/count_tokens", count_tokens)


def check_model(model: str, state) -> int:
    """The engine id of the LoRA adapter `model` names (0: the base model); 404 for a name not served."""
    return lora_id_of(model, state)


async def count_tokens(request: Request, body: CountTokensRequest) -> JSONResponse:
    state = request.app.state.server
    check_model(body.model, state)
    body.check()
    tools = [template_tool(f) for f in body.functions]
    _, prompt_ids = await chat_prompt(state, body.template_messages(), tools, body.template_options(),
                                      **body.prompt_ending)
    return JSONResponse({"input_tokens": len(prompt_ids)})


async def messages(request: Request, body: MessagesRequest) -> Response:
    start = time.monotonic()
    state = request.app.state.server
    lora_id = check_model(body.model, state)
    body.check()
    openai_body = body.openai_body()
    check_request(openai_body, state)
    sampling = await sampling_of(state, openai_body, state.sampling_defaults)
    text, prompt_ids = await chat_inputs(state, body.template_messages(), body.functions, body.choice, body.parallel,
                                         body.template_options(), sampling, max_tokens_given=True,
                                         max_tokens_field="max_tokens", **body.prompt_ending)
    parser = state.chat.answer_parser(text, body.choice != "none", body.functions)
    generation = Generation(request, [prompt_ids], sampling, start, "max_tokens", lora_id=lora_id)
    fmt = MessageFormatter(body, body.model if lora_id else state.config.served_model_name, generation)
    if not body.stream:
        (choice,) = await generation.result()
        return JSONResponse(fmt.message(answer_blocks(parser, choice.text), choice.last))
    firsts = await generation.first()
    return generation.event_stream(fmt.events(firsts, parser))


def content_block(block: Block, done: bool) -> dict:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if done else "", "signature": ""}
    if block.kind == "call":
        return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": call_input(block) if done else {}}
    return {"type": "text", "text": block.text if done else ""}


def call_input(block: Block) -> dict:
    """A call's arguments as tool_use's input (an object); arguments that do not parse, as an
    unforced model may write them, are kept as text."""
    try:
        value = json.loads(block.text)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": block.text}


class MessageFormatter:
    def __init__(self, body: MessagesRequest, model: str, generation: Generation):
        self.body, self.model, self.generation = body, model, generation
        self.id = f"msg_{uuid.uuid4().hex}"

    def stop(self, last: TextOut, called: bool) -> dict:
        reason = STOP_REASONS.get(last.finish_reason, "end_turn")
        if called and reason == "end_turn":
            reason = "tool_use"
        stops = self.body.stop_sequences or []
        # the detokenizer cut the text at the stop sequence; which one is known when there is one
        sequence = stops[0] if reason == "stop_sequence" and len(stops) == 1 else None
        return {"stop_reason": reason, "stop_sequence": sequence}

    def usage(self, output_tokens: int) -> dict:
        cached = self.generation.cached_tokens
        return {"input_tokens": self.generation.prompt_len - cached, "output_tokens": output_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def message(self, blocks: list[Block], last: TextOut | None) -> dict:
        content = [content_block(block, done=True) for block in blocks]
        stop = self.stop(last, any(b.kind == "call" for b in blocks)) if last is not None else \
            {"stop_reason": None, "stop_sequence": None}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                **stop, "usage": self.usage(last.count_output_tokens if last is not None else 0)}

    async def events(self, firsts: list[TextOut], parser) -> AsyncIterator[str]:
        yield sse("message_start", message=self.message([], None))
        blocks, called = Blocks(), False
        async for _, out in self.generation.outputs(firsts):
            if out.finish_reason is FinishReason.ERROR:
                error = failure(out)
                yield sse("error", **anthropic_error(str(error), error.status_code))
                return
            steps = blocks.feed(parser.feed(out.text) + (parser.finish() if out.finish_reason is not None else []))
            if out.finish_reason is not None:
                steps += blocks.close()
            for step, block, *text in steps:
                called = called or block.kind == "call"
                yield self.block_event(step, block, *text)
            if out.finish_reason is not None:
                yield sse("message_delta", delta=self.stop(out, called),
                          usage={"output_tokens": out.count_output_tokens})
                yield sse("message_stop")

    @staticmethod
    def block_event(step: str, block: Block, text: str = "") -> str:
        if step == "start":
            return sse("content_block_start", index=block.position, content_block=content_block(block, done=False))
        if step == "stop":
            return sse("content_block_stop", index=block.position)
        delta = {"reasoning": {"type": "thinking_delta", "thinking": text},
                 "call": {"type": "input_json_delta", "partial_json": text}}.get(block.kind,
                                                                                 {"type": "text_delta", "text": text})
        return sse("content_block_delta", index=block.position, delta=delta)


def sse(kind: str, **fields) -> str:
    """One server-sent event as Anthropic sends them: its type named in the event line and in the data."""
    data = {"type": kind, **fields} if kind != "error" else fields
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
