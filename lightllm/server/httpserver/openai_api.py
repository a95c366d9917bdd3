"""OpenAI-compatible endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Both POST endpoints answer with one JSON object, or with server-sent events (`stream: true`)
ending in `data: [DONE]`, so that OpenAI's client libraries work unchanged. They run through
the same Generation as /generate: same validation, metrics, abort on disconnect.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lightllm.server.httpserver.generation import Generation, tokenize
from lightllm.server.httpserver.json_body import RequestError, add_json_route
from lightllm.server.httpserver.openai_params import ChatRequest, CompletionRequest, OpenAIBody
from lightllm.server.httpserver.params import check_prompt_chars
from lightllm.server.io_struct import FinishReason, SamplingParams, TextOut

# Our finish reasons in OpenAI's words: an EOS token and a stop sequence are both "stop".
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop"}


def add_openai_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    add_json_route(app, "/v1/completions", completions)
    add_json_route(app, "/v1/chat/completions", chat_completions)


async def list_models(request: Request) -> JSONResponse:
    state = request.app.state.server
    model = {
        "id": state.config.served_model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "lightllm",
        "max_model_len": state.limits.max_req_total_len,
    }
    return JSONResponse({"object": "list", "data": [model]})


async def completions(request: Request, body: CompletionRequest) -> Response:
    start = time.monotonic()
    state = request.app.state.server
    check_request(body, state)
    prompt = body.prompt_value(state.model_info["vocab_size"])
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), state.limits)
        prompt = await tokenize(state.tokenizer.encode, prompt)
    return await answer(request, body, body.sampling(), prompt, start, CompletionFormat)


async def chat_completions(request: Request, body: ChatRequest) -> Response:
    start = time.monotonic()
    state = request.app.state.server
    check_request(body, state)
    messages = body.template_messages()
    check_prompt_chars(sum(len(message["content"]) for message in messages), state.limits)
    prompt_ids = await tokenize(chat_prompt_ids, state.tokenizer, messages)
    sampling = body.sampling()
    if not body.max_tokens_given:  # OpenAI's default: as many as the context leaves
        room = min(state.limits.max_req_total_len, state.limits.max_total_token_num) - len(prompt_ids)
        sampling.max_new_tokens = max(1, room)
    return await answer(request, body, sampling, prompt_ids, start, ChatFormat)


def check_request(body: OpenAIBody, state) -> None:
    body.check_supported()
    served = state.config.served_model_name
    if body.model is not None and body.model != served:
        raise RequestError(f"model {body.model!r} does not exist; this server serves {served!r}", 404)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; use /v1/completions with a plain prompt")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template's own checks (role order, ...) raise jinja errors
        raise RequestError(f"the chat template rejected the messages: {exc}") from None
    # The template writes any special tokens (BOS, role markers) itself.
    return tokenizer.encode(text, add_special_tokens=False)


async def answer(request: Request, body: OpenAIBody, sampling: SamplingParams, prompt_ids: list[int], start: float,
                 fmt) -> Response:
    generation = Generation(request, prompt_ids, sampling, start)
    reply = fmt(f"{fmt.id_prefix}-{uuid.uuid4().hex}", request.app.state.server.config.served_model_name)
    if not body.stream:
        text, last = await generation.result()
        return JSONResponse(reply.whole(text, last, usage(generation, last)))
    first = await generation.first()
    events = stream_events(reply, generation, first, body.include_usage)
    return StreamingResponse(events, media_type="text/event-stream")


def usage(generation: Generation, last: TextOut) -> dict:
    prompt, completion = generation.prompt_len, last.count_output_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": generation.timer.cached_tokens}}


async def stream_events(reply, generation: Generation, first: TextOut, include_usage: bool) -> AsyncIterator[str]:
    for chunk in reply.opening():
        yield sse(chunk)
    async for out in generation.outputs(first):
        if out.finish_reason is FinishReason.ERROR:  # the last output: no usage follows
            yield sse(openai_error(f"generation failed: {out.error}", "internal", 500))
            continue
        if out.text or out.finish_reason is not None:
            yield sse(reply.chunk(out.text, FINISH_REASONS.get(out.finish_reason)))
        if out.finish_reason is not None and include_usage:
            yield sse(reply.usage_chunk(usage(generation, out)))
    yield "data: [DONE]\n\n"


def openai_error(message: str, error_type: str, status_code: int) -> dict:
    """An error body in OpenAI's shape; `error_type` is ours (validation, http, internal)."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": status_code}}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class CompletionFormat:
    """The bodies of /v1/completions: `text_completion` objects."""

    id_prefix = "cmpl"

    def __init__(self, reply_id: str, model: str):
        self.head = {"id": reply_id, "object": "text_completion", "created": int(time.time()), "model": model}

    def whole(self, text: str, last: TextOut, usage: dict) -> dict:
        return {**self.head, "choices": [self._choice(text, FINISH_REASONS[last.finish_reason])], "usage": usage}

    def opening(self) -> list[dict]:
        return []

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        return {**self.head, "choices": [self._choice(text, finish_reason)]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.head, "choices": [], "usage": usage}

    @staticmethod
    def _choice(text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


class ChatFormat(CompletionFormat):
    """The bodies of /v1/chat/completions: `chat.completion` and `chat.completion.chunk` objects."""

    id_prefix = "chatcmpl"

    def __init__(self, reply_id: str, model: str):
        super().__init__(reply_id, model)
        self.head["object"] = "chat.completion.chunk"

    def whole(self, text: str, last: TextOut, usage: dict) -> dict:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": FINISH_REASONS[last.finish_reason]}
        return {**self.head, "object": "chat.completion", "choices": [choice], "usage": usage}

    def opening(self) -> list[dict]:
        return [self._delta({"role": "assistant", "content": ""}, None)]

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        return self._delta({"content": text} if text else {}, finish_reason)

    def _delta(self, delta: dict, finish_reason: str | None) -> dict:
        return {**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
