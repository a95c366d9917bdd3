"""OpenAI-compatible endpoints: GET /v1/models and /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions.

Both POST endpoints answer with one JSON object, or with server-sent events (`stream: true`)
ending in `data: [DONE]`, so that OpenAI's client libraries work unchanged. They run through
the same Generation as /generate: same validation, metrics, abort on disconnect.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lightllm.frontend.chat.output import Answer, AnswerParser, merge_events
from lightllm.frontend.chat.tool_calls import CallStart, Text
from lightllm.server.httpserver.chat_prompt import chat_inputs
from lightllm.server.httpserver.errors import openai_error
from lightllm.server.httpserver.generation import Choice, Generation, batch_member, failure, sampling_of
from lightllm.server.httpserver.json_body import add_json_route
from lightllm.server.httpserver.lora_api import adapter_objects, lora_id_of
from lightllm.server.httpserver.openai_params import ChatRequest, CompletionRequest, OpenAIBody
from lightllm.frontend.errors import RequestError
from lightllm.frontend.limits import check_lengths, check_prompt_chars, truncated
from lightllm.engine.request import FinishReason, SamplingParams
from lightllm.server.io_struct import TextOut

# Our finish reasons in OpenAI's words: an EOS token and a stop sequence are both "stop".
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop"}


def add_openai_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])  # ids may hold '/'
    add_json_route(app, "/v1/completions", completions)
    add_json_route(app, "/v1/chat/completions", chat_completions)


def model_object(state) -> dict:
    """The served model as OpenAI's model object (with vLLM's max_model_len)."""
    return {
        "id": state.config.served_model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "lightllm",
        "max_model_len": state.limits.max_req_total_len,
    }


async def list_models(request: Request) -> JSONResponse:
    state = request.app.state.server
    return JSONResponse({"object": "list", "data": [model_object(state), *adapter_objects(state, int(state.started))]})


async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
    """OpenAI's models.retrieve: the model object of the served name, a 404 for any other."""
    state = request.app.state.server
    if lora_id_of(model_id, state):
        return JSONResponse(next(m for m in adapter_objects(state, int(state.started)) if m["id"] == model_id))
    return JSONResponse(model_object(state))


async def completions(request: Request, body: CompletionRequest) -> Response:
    start = time.monotonic()
    state = request.app.state.server
    lora_id = check_request(body, state)
    prompts = body.prompt_values(state.model_info["vocab_size"])
    if isinstance(prompts[0], str):  # texts, all of them (the body's type)
        for i, text in enumerate(prompts):
            with batch_member(i, len(prompts)):
                check_prompt_chars(len(text), state.limits)
        # Together, so that the encoder takes a batch's texts in one call (prompt_encoder.py).
        prompts = list(await asyncio.gather(*(state.encoder.encode(text) for text in prompts)))
    prompts = [truncated(ids, body.truncate_prompt_tokens, state.limits) for ids in prompts]
    fmt = CompletionFormat(state.tokenizer, body, prompts)
    sampling = await sampling_of(state, body, state.sampling_defaults)
    for i, prompt_ids in enumerate(prompts):  # before the grammar compiles
        with batch_member(i, len(prompts)):
            check_lengths(len(prompt_ids), sampling, state.limits, body.max_tokens_field)
    await state.grammars.attach(sampling)
    return await answer(request, body, sampling, prompts, start, fmt, lora_id)


async def chat_completions(request: Request, body: ChatRequest) -> Response:
    start = time.monotonic()
    state = request.app.state.server
    lora_id = check_request(body, state)
    body.check_tools()
    sampling = await sampling_of(state, body, state.sampling_defaults)
    text, prompt_ids = await chat_inputs(state, body.template_messages(), body.functions_given, body.choice,
                                         body.parallel_tool_calls is not False, body.template_kwargs, sampling,
                                         body.max_tokens_given, body.max_tokens_field, **body.prompt_ending,
                                         truncate=body.truncate_prompt_tokens, template=body.chat_template)
    fmt = ChatFormat(state.tokenizer, body, [state.chat.answer_parser(text, body.choice != "none", body.functions_given)
                                             for _ in range(body.choices)], prompt_ids)
    return await answer(request, body, sampling, [prompt_ids], start, fmt, lora_id)


def check_request(body: OpenAIBody, state) -> int:
    """The body's fields checked; the engine id of the LoRA adapter its `model` names (0: none)."""
    body.check_supported(state.model_info["vocab_size"])
    if body.priority and state.config.schedule_policy != "priority":
        raise RequestError(f"'priority' = {body.priority} is not served: requests are admitted by --schedule_policy "
                           f"{state.config.schedule_policy}; a server started with --schedule_policy priority "
                           f"(vLLM's --scheduling-policy priority) takes it")
    return lora_id_of(body.model, state)


async def answer(request: Request, body: OpenAIBody, sampling: SamplingParams, prompts: list[list[int]],
                 start: float, fmt: CompletionFormat, lora_id: int = 0) -> Response:
    generation = Generation(request, prompts, sampling, start, body.max_tokens_field, body.choices, lora_id,
                            body.cache_salt or "", body.priority or 0)
    model = body.model if lora_id else request.app.state.server.config.served_model_name
    fmt.head.update(id=f"{fmt.id_prefix}-{body.request_id or uuid.uuid4().hex}", model=model)
    if not body.stream:
        choices = await generation.result()
        return JSONResponse(fmt.whole(choices, usage(generation, [c.last for c in choices])))
    firsts = await generation.first()
    events = stream_events(fmt, generation, firsts, body.include_usage, body.continuous_usage)
    return generation.event_stream(events)


def usage(generation: Generation, lasts: list[TextOut]) -> dict:
    prompt, completion = generation.prompt_len, sum(last.count_output_tokens for last in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": generation.cached_tokens}}


async def stream_events(fmt: CompletionFormat, generation: Generation, firsts: list[TextOut],
                        include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """The stream's events; with continuous_usage (vLLM's continuous_usage_stats) every chunk
    carries its choice's usage so far."""
    def event(chunk: dict, i: int, completion_tokens: int) -> str:
        if continuous_usage:
            prompt = len(generation.prompts[i // generation.n])
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                              "total_tokens": prompt + completion_tokens}
        return sse(chunk)

    for i in range(len(firsts)):
        for chunk in fmt.opening(i):
            yield event(chunk, i, 0)
    lasts = {}
    async for i, out in generation.outputs(firsts):
        if out.finish_reason is FinishReason.ERROR:  # the last output: no usage follows
            error = failure(out)
            yield sse(openai_error(str(error), error.error_type, error.status_code))
            continue
        for chunk in fmt.chunks(i, out):
            yield event(chunk, i, out.count_output_tokens)
        if out.finish_reason is not None:
            lasts[i] = out
    if include_usage and len(lasts) == len(firsts):
        yield sse(fmt.usage_chunk(usage(generation, list(lasts.values()))))
    yield "data: [DONE]\n\n"


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text, as logprobs show them."""
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def token_names(tokenizer, ids: list[int], as_ids: bool) -> list[str]:
    """How logprobs name these tokens: by their texts, or (vLLM's return_tokens_as_token_ids) as
    'token_id:<id>', which says which token a text such as a lone byte's U+FFFD stands for."""
    return [f"token_id:{i}" for i in ids] if as_ids else token_texts(tokenizer, ids)


def top_names(top, as_ids: bool) -> list[tuple[str, float]]:
    """(name, logprob) of the (token, text, logprob) entries of a top list, named as token_names does."""
    return [(f"token_id:{t}" if as_ids else text, lp) for t, text, lp in top or ()]


class CompletionFormat:
    """The bodies of /v1/completions: `text_completion` objects, with OpenAI's legacy logprobs
    (tokens, token_logprobs, top_logprobs, text_offset); with echo the prompt comes first. Choice
    i answers prompt i // n of a batch (Generation's numbering)."""

    id_prefix = "cmpl"

    def __init__(self, tokenizer, body: CompletionRequest, prompts: list[list[int]]):
        self.tokenizer = tokenizer
        self.head = {"id": "", "object": "text_completion", "created": int(time.time()), "model": ""}
        self.logprobs = body.wants_logprobs
        self.top_k = body.logprobs or 0  # echo's prompt logprobs may have come with prompt_logprobs' larger k
        self.prompt_top_k = body.prompt_logprobs
        self.echo = bool(body.echo)
        self.as_ids = bool(body.return_tokens_as_token_ids)
        self.prompts, self.n = prompts, body.choices
        self.prompt_texts = [tokenizer.decode(ids, skip_special_tokens=False) if self.echo else "" for ids in prompts]
        self._echoed: set[int] = set()  # choices whose stream has sent the prompt
        self._offsets: dict[int, int] = {}  # each choice's text_offset after what it has sent

    def whole(self, choices: list[Choice], usage: dict) -> dict:
        body = [self._choice(c.index, self.prompt_texts[c.index // self.n] + c.text,
                             FINISH_REASONS[c.last.finish_reason], self._logprobs(c.index, c.outputs, echo=self.echo))
                for c in choices]
        if self.prompt_top_k is not None:  # vLLM's: per choice, of the prompt it continues
            for choice, c in zip(body, choices):
                choice["prompt_logprobs"] = prompt_logprobs(self.tokenizer, self.prompts[c.index // self.n],
                                                            c.outputs[0].prompt_logprobs, self.prompt_top_k)
        return {**self.head, "choices": body, "usage": usage}

    def opening(self, index: int) -> list[dict]:
        return []

    def chunks(self, index: int, out: TextOut) -> list[dict]:
        if out.text or out.finish_reason is not None or self.logprobs:
            return [self.chunk(index, out)]
        return []

    def chunk(self, index: int, out: TextOut) -> dict:
        echo = self.echo and index not in self._echoed
        self._echoed.add(index)
        text = (self.prompt_texts[index // self.n] if echo else "") + out.text
        return {**self.head, "choices": [self._choice(index, text, FINISH_REASONS.get(out.finish_reason),
                                                      self._logprobs(index, [out], echo=echo))]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.head, "choices": [], "usage": usage}

    @staticmethod
    def _choice(index: int, text: str, finish_reason: str | None, logprobs) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, index: int, outputs: list[TextOut], echo: bool) -> dict | None:
        if not self.logprobs:
            return None
        chosen, tops = [], []
        # with echo the prompt's tokens come first; its first has no logprob (nothing comes before it)
        ids = (self.prompts[index // self.n] if echo else []) + [out.token_id for out in outputs]
        texts = token_texts(self.tokenizer, ids)
        tokens = token_names(self.tokenizer, ids, True) if self.as_ids else texts
        if echo:
            prompt = outputs[0].prompt_logprobs or []
            chosen += [None] + [logprob for logprob, _, _ in prompt]
            tops += [None] + [dict(top_names(top[:self.top_k], self.as_ids)) | {t: lp}
                              for (lp, _, top), t in zip(prompt, tokens[1:])]
        chosen += [out.logprob for out in outputs]
        tops += [dict(top_names(out.top_logprobs, self.as_ids)) | {t: out.logprob}
                 for out, t in zip(outputs, tokens[len(tokens) - len(outputs):])]
        offsets, offset = [], self._offsets.get(index, 0)  # a stream's chunks run on from the last
        for text in texts:  # offsets into the text, whatever names the tokens
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


class ChatFormat(CompletionFormat):
    """The bodies of /v1/chat/completions: `chat.completion` and `chat.completion.chunk` objects,
    with each choice's reasoning and tool calls parsed out of its text (`parsers`, one per choice)."""

    id_prefix = "chatcmpl"

    def __init__(self, tokenizer, body: ChatRequest, parsers: list[AnswerParser], prompt_ids: list[int]):
        self.tokenizer, self.prompt_ids = tokenizer, prompt_ids
        self.head = {"id": "", "object": "chat.completion.chunk", "created": int(time.time()), "model": ""}
        self.logprobs = body.wants_logprobs
        self.as_ids = bool(body.return_tokens_as_token_ids)
        self.prompt_top_k = body.prompt_logprobs
        self.parsers = parsers
        self._called: set[int] = set()  # streamed choices that made a call

    def whole(self, choices: list[Choice], usage: dict) -> dict:
        body = []
        for c in choices:
            answer = self.parsers[c.index].parse(c.text)
            body.append({"index": c.index, "message": self._message(answer), "logprobs": self._chat_logprobs(c.outputs),
                         "finish_reason": finish_reason(c.last, bool(answer.calls))})
        whole = {**self.head, "object": "chat.completion", "choices": body, "usage": usage}
        if self.prompt_top_k is not None:  # vLLM's: once, beside the choices (they share the prompt)
            whole["prompt_logprobs"] = prompt_logprobs(self.tokenizer, self.prompt_ids,
                                                       choices[0].outputs[0].prompt_logprobs, self.prompt_top_k)
        return whole

    def _message(self, answer: Answer) -> dict:
        message = {"role": "assistant", "content": answer.content or (None if answer.calls else "")}
        if self.parsers[0].reasoning is not None:
            message["reasoning_content"] = answer.reasoning or None
        if answer.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in answer.calls]
        return message

    def opening(self, index: int) -> list[dict]:
        return [self._delta(index, {"role": "assistant", "content": ""}, None, None)]

    def chunks(self, index: int, out: TextOut) -> list[dict]:
        parser = self.parsers[index]
        events = parser.feed(out.text) + (parser.finish() if out.finish_reason is not None else [])
        delta = chat_delta(merge_events(events))
        if "tool_calls" in delta:
            self._called.add(index)
        if not delta and out.finish_reason is None and not self.logprobs:
            return []
        reason = finish_reason(out, index in self._called) if out.finish_reason is not None else None
        return [self._delta(index, delta, reason, self._chat_logprobs([out]))]

    def _delta(self, index: int, delta: dict, finish_reason: str | None, logprobs) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self.head, "choices": [choice]}

    def _chat_logprobs(self, outputs: list[TextOut]) -> dict | None:
        if not self.logprobs:
            return None
        names = token_names(self.tokenizer, [out.token_id for out in outputs], self.as_ids)
        content = [{**_entry(name, out.logprob),
                    "top_logprobs": [_entry(t, lp) for t, lp in top_names(out.top_logprobs, self.as_ids)]}
                   for out, name in zip(outputs, names)]
        return {"content": content, "refusal": None}


def prompt_logprobs(tokenizer, prompt_ids: list[int], computed: list, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first token (nothing comes before it), then per prompt
    token {token id: {logprob, rank, decoded_token}} of that token and of the k most likely there.
    `computed` holds (logprob, rank, top) per position from the second, top most likely first (its k
    may be larger: echo's). A rank is 1 for the most likely; the prompt token's is the engine's,
    counted over the whole vocabulary, so it has one outside the top k too."""
    entries: list[dict | None] = [None]
    for token, text, (logprob, rank, top) in zip(prompt_ids[1:], token_texts(tokenizer, prompt_ids[1:]), computed):
        mine = {"logprob": logprob, "rank": rank, "decoded_token": text}
        entries.append({token: mine} | {t: {"logprob": lp, "rank": rank, "decoded_token": t_text}
                                        for rank, (t, t_text, lp) in enumerate(top[:k], 1) if t != token})
    return entries


def finish_reason(last: TextOut, called: bool) -> str:
    """OpenAI's finish reason; an answer that ends after its calls ends for them."""
    reason = FINISH_REASONS[last.finish_reason]
    return "tool_calls" if called and reason == "stop" else reason


def chat_delta(events: list) -> dict:
    """A chunk's delta: content, reasoning_content and tool_calls as OpenAI streams them (a call's
    first entry has its id, type and name; later ones add to its arguments)."""
    delta: dict = {}
    for event in events:
        if isinstance(event, Text):
            key = "reasoning_content" if event.reasoning else "content"
            delta[key] = delta.get(key, "") + event.text
        elif isinstance(event, CallStart):
            delta.setdefault("tool_calls", []).append(
                {"index": event.index, "id": event.id, "type": "function",
                 "function": {"name": event.name, "arguments": ""}})
        else:
            calls = delta.setdefault("tool_calls", [])
            if calls and calls[-1]["index"] == event.index:
                calls[-1]["function"]["arguments"] += event.text
            else:
                calls.append({"index": event.index, "function": {"arguments": event.text}})
    return delta


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
