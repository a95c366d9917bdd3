"""vLLM's tokenizer routes: POST /tokenize (a prompt or chat messages -> token ids) and
POST /detokenize (token ids -> text), with the tokenizer the server generates with.

Tokenizing and decoding run in the thread pool, like a generation's prompt; a prompt is bounded
in characters as there (check_prompt_chars), but not in tokens: counting them is the point.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from lightllm.frontend.errors import RequestError
from lightllm.frontend.limits import check_prompt_chars
from lightllm.server.httpserver.chat_prompt import chat_prompt
from lightllm.server.httpserver.generation import off_loop
from lightllm.server.httpserver.json_body import add_json_route
from lightllm.server.httpserver.lora_api import lora_id_of
from lightllm.server.httpserver.openai_params import (MAX_CHAT_TEMPLATE_CHARS, Message, Tool, check_tools, prompt_ending,
                                                    template_tool)
from lightllm.server.httpserver.params import STRICT, NonEmptyStr


class TokenizeRequest(BaseModel):
    """Either `prompt` (with add_special_tokens) or `messages` (with add_generation_prompt)."""

    model_config = STRICT

    model: str | None = Field(None, description="the served model's name, or left out")
    prompt: str | None = Field(None, description="text to tokenize; or give messages")
    add_special_tokens: bool | None = Field(None, description="with prompt: add the tokenizer's special tokens "
                                                              "(BOS, ...); default true")
    messages: Annotated[list[Message], Field(min_length=1)] | None = Field(
        None, description="chat messages, rendered with the model's chat template; or give prompt")
    add_generation_prompt: bool | None = Field(None, description="with messages: end with the template's "
                                                                 "assistant header; default true")
    continue_final_message: bool | None = Field(None, description="with messages: end inside the last message, "
                                                                  "as a chat request that continues it")
    tools: list[Tool] | None = Field(None, description="with messages: functions, as /v1/chat/completions takes them")
    chat_template_kwargs: dict | None = Field(None, description="with messages: variables for the chat template")
    chat_template: NonEmptyStr | None = Field(
        None, max_length=MAX_CHAT_TEMPLATE_CHARS,
        description="with messages: a chat template in place of the model's (--trust_request_chat_template)")
    return_token_strs: bool = Field(False, description="also return each token's vocabulary entry")

    def check_form(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give either 'prompt' or 'messages'")
        for_messages = ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs",
                        "chat_template")
        wrong = for_messages if self.prompt is not None else ("add_special_tokens",)
        for name in wrong:
            if getattr(self, name) is not None:
                raise RequestError(f"'{name}' goes with '{'messages' if self.prompt is not None else 'prompt'}'")


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = Field(None, description="the served model's name, or left out")
    tokens: list[int] = Field(description="token ids, each in [0, vocab_size)")


def add_tokenize_routes(app: FastAPI) -> None:
    add_json_route(app, "/tokenize", tokenize_route)
    add_json_route(app, "/detokenize", detokenize_route)


def check_model(model: str | None, state) -> None:
    lora_id_of(model, state)  # a LoRA adapter's name too: it tokenizes as the base model


async def tokenize_route(request: Request, body: TokenizeRequest) -> JSONResponse:
    state = request.app.state.server
    check_model(body.model, state)
    body.check_form()
    if body.prompt is not None:
        check_prompt_chars(len(body.prompt), state.limits)
        add_special = body.add_special_tokens is not False
        ids = await state.encoder.encode(body.prompt, add_special_tokens=add_special)
    else:
        messages = [message.for_template(i) for i, message in enumerate(body.messages)]
        check_tools([tool.function for tool in body.tools or ()], None)
        tools = [template_tool(tool.function) for tool in body.tools or ()]
        _, ids = await chat_prompt(state, messages, tools, body.chat_template_kwargs,
                                   **prompt_ending(body.add_generation_prompt, body.continue_final_message),
                                   template=body.chat_template)
    reply = {"count": len(ids), "max_model_len": state.limits.max_req_total_len, "tokens": ids}
    if body.return_token_strs:
        reply["token_strs"] = await off_loop(state.tokenizer.convert_ids_to_tokens, ids)
    return JSONResponse(reply)


async def detokenize_route(request: Request, body: DetokenizeRequest) -> JSONResponse:
    state = request.app.state.server
    check_model(body.model, state)
    vocab_size = state.model_info["vocab_size"]
    if len(body.tokens) > state.limits.max_req_total_len:
        raise RequestError(f"'tokens' holds {len(body.tokens)} ids, more than max_req_total_len="
                           f"{state.limits.max_req_total_len}, the longest sequence this server handles")
    if any(not 0 <= token < vocab_size for token in body.tokens):
        raise RequestError(f"'tokens' must be token ids in [0, {vocab_size})")
    return JSONResponse({"prompt": await off_loop(state.tokenizer.decode, body.tokens)})
