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

from lightllm.server.httpserver.generation import off_loop
from lightllm.server.httpserver.json_body import RequestError, add_json_route
from lightllm.server.httpserver.openai_api import chat_prompt_ids
from lightllm.server.httpserver.openai_params import Message
from lightllm.server.httpserver.params import STRICT, check_prompt_chars


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
    return_token_strs: bool = Field(False, description="also return each token's vocabulary entry")

    def check_form(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give either 'prompt' or 'messages'")
        wrong = "add_generation_prompt" if self.prompt is not None else "add_special_tokens"
        if getattr(self, wrong) is not None:
            raise RequestError(f"'{wrong}' goes with '{'messages' if self.prompt is not None else 'prompt'}'")


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = Field(None, description="the served model's name, or left out")
    tokens: list[int] = Field(description="token ids, each in [0, vocab_size)")


def add_tokenize_routes(app: FastAPI) -> None:
    add_json_route(app, "/tokenize", tokenize_route)
    add_json_route(app, "/detokenize", detokenize_route)


def check_model(model: str | None, state) -> None:
    served = state.config.served_model_name
    if model is not None and model != served:
        raise RequestError(f"model {model!r} does not exist; this server serves {served!r}", 404)


async def tokenize_route(request: Request, body: TokenizeRequest) -> JSONResponse:
    state = request.app.state.server
    check_model(body.model, state)
    body.check_form()
    if body.prompt is not None:
        check_prompt_chars(len(body.prompt), state.limits)
        add_special = body.add_special_tokens is not False
        ids = await off_loop(lambda: state.tokenizer.encode(body.prompt, add_special_tokens=add_special))
    else:
        messages = [message.for_template(i) for i, message in enumerate(body.messages)]
        check_prompt_chars(sum(len(message["content"]) for message in messages), state.limits)
        tokenizer = TemplateOptions(state.tokenizer, add_generation_prompt=body.add_generation_prompt is not False)
        ids = await off_loop(chat_prompt_ids, tokenizer, messages)
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


class TemplateOptions:
    """A tokenizer whose apply_chat_template takes `options` over its caller's keyword arguments:
    chat_prompt_ids always asks for the generation prompt, /tokenize lets the client choose."""

    def __init__(self, tokenizer, **options):
        self._tokenizer, self._options = tokenizer, options

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages: list[dict], **kwargs):
        return self._tokenizer.apply_chat_template(messages, **{**kwargs, **self._options})
