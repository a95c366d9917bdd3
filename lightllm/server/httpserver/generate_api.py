"""TGI's text-generation routes: POST /generate (one JSON answer) and /generate_stream (server-sent
events, one per token), and TGI's own POST / (where its clients, huggingface_hub's InferenceClient
among them, send): /generate_stream's events with `"stream": true`, else TGI's answer as it gives
it, a list of one {"generated_text": text, "details"} with TGI's finish reasons.

/generate answers {"generated_text": [one text per sequence], "count_output_tokens",
"finish_reason", "prompt_tokens", "cached_tokens"} (the counts and reason of the first sequence)
and, with `details`, TGI's details: per token its id, text, logprob and special flag, the top
tokens with `top_n_tokens`, the prompt's tokens (`prefill`) with `decoder_input_details`, and the
other sequences of `n` as `best_of_sequences`."""

from __future__ import annotations

import json
import math
import time
from json.encoder import encode_basestring

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lightllm.engine.request import FinishReason, SamplingParams
from lightllm.frontend.errors import RequestError
from lightllm.frontend.limits import check_lengths, check_prompt_chars, truncated
from lightllm.server.httpserver.errors import error_body
from lightllm.server.httpserver.generation import Choice, Generation, failure, sampling_of
from lightllm.server.httpserver.json_body import add_json_route
from lightllm.server.httpserver.lora_api import lora_id_of
from lightllm.server.httpserver.params import CompatGenerateRequest, GenerateRequest, check_token_ids
from lightllm.server.io_struct import TextOut


# The finish reasons as TGI names them, on its own route
TGI_REASONS = {"eos": "eos_token", "stop": "stop_sequence", "length": "length"}


def add_generate_routes(app: FastAPI) -> None:
    add_json_route(app, "/generate", generate)
    add_json_route(app, "/generate_stream", generate_stream)
    add_json_route(app, "/", compat_generate)


async def start_generation(request: Request, body: GenerateRequest) -> tuple[Generation, SamplingParams]:
    """Tokenize a /generate prompt (refused before if it is too long) and submit it."""
    start = time.monotonic()
    state = request.app.state.server
    params = body.parameters
    params.check_tgi()
    check_prompt_chars(len(body.inputs), state.limits)
    check_token_ids(state.model_info["vocab_size"], params.logit_bias, params.stop_token_ids, params.allowed_token_ids)
    sampling = await sampling_of(state, params)
    if (params.best_of or 1) > 1 and sampling.greedy:
        raise RequestError("'best_of' > 1 needs sampling (do_sample, a temperature, ...): greedy sequences would "
                           "all be the same")
    prompt_ids = truncated(await state.encoder.encode(body.inputs), params.truncate, state.limits)
    check_lengths(len(prompt_ids), sampling, state.limits, "max_new_tokens")  # before the grammar compiles
    lora_id = lora_id_of(params.adapter_id, state)
    await state.grammars.attach(sampling)
    return Generation(request, [prompt_ids], sampling, start, "max_new_tokens", params.sequences, lora_id), sampling


async def generate(request: Request, body: GenerateRequest) -> Response:
    return JSONResponse(await whole_answer(request, body))


async def whole_answer(request: Request, body: GenerateRequest, reasons: dict | None = None) -> dict:
    """/generate's answer. With TGI's best_of, only the most likely sequence (the largest sum of
    its tokens' logprobs) is in generated_text, the others in details.best_of_sequences;
    return_full_text puts the prompt before each text. `reasons`: finish reasons renamed (TGI's)."""
    generation, sampling = await start_generation(request, body)
    params = body.parameters
    choices = await generation.result()
    if (params.best_of or 1) > 1:
        choices = sorted(choices, key=lambda c: -sum(o.logprob for o in c.outputs))
    head = body.inputs if params.return_full_text else ""
    first = choices[0]
    answer = {
        "generated_text": [head + choice.text for choice in (choices[:1] if params.best_of else choices)],
        "count_output_tokens": first.last.count_output_tokens,
        "finish_reason": reason_name(first.last.finish_reason, reasons),
        "prompt_tokens": generation.prompt_len,
        "cached_tokens": generation.cached_tokens,
    }
    if params.details:
        tokenizer = request.app.state.server.tokenizer
        answer["details"] = details(tokenizer, first, sampling.seed + first.index, generation.prompts[0], reasons)
        if len(choices) > 1:
            answer["details"]["best_of_sequences"] = [
                {"generated_text": head + c.text,
                 **details(tokenizer, c, sampling.seed + c.index, generation.prompts[0], reasons)}
                for c in choices[1:]]
    return answer


async def compat_generate(request: Request, body: CompatGenerateRequest) -> Response:
    """TGI's POST /: /generate_stream's events, or a list of one TGI answer."""
    if body.stream:
        return await stream_answer(request, body, TGI_REASONS)
    answer = await whole_answer(request, body, TGI_REASONS)
    tgi = {"generated_text": answer["generated_text"][0]}
    if "details" in answer:
        tgi["details"] = answer["details"]
    return JSONResponse([tgi])


def details(tokenizer, choice: Choice, seed: int, prompt_ids: list[int], reasons: dict | None = None) -> dict:
    """TGI's details of one sequence."""
    out = {"finish_reason": reason_name(choice.last.finish_reason, reasons), "generated_tokens": choice.last.count_output_tokens,
           "seed": seed, "tokens": [token_entry(o.token_id, token_text(tokenizer, o.token_id), o.logprob, o.special)
                                    for o in choice.outputs]}
    prompt = choice.outputs[0].prompt_logprobs
    if prompt is not None:
        texts = tokenizer.batch_decode([[i] for i in prompt_ids], skip_special_tokens=False)
        logprobs = [None] + [logprob for logprob, _, _ in prompt]
        out["prefill"] = [{"id": i, "text": t, "logprob": lp} for i, t, lp in zip(prompt_ids, texts, logprobs)]
    if any(o.top_logprobs for o in choice.outputs):
        out["top_tokens"] = [top_entries(o) for o in choice.outputs]
    return out


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_entry(token_id: int, text: str, logprob: float, special: bool) -> dict:
    return {"id": token_id, "text": text, "logprob": logprob, "special": special}


def top_entries(out: TextOut) -> list[dict]:
    return [token_entry(i, text, lp, False) for i, text, lp in out.top_logprobs or ()]


def sse_event(out: TextOut, full_text: str | None, detailed: bool, seed: int, reasons: dict | None = None) -> str:
    """One /generate_stream event: json.dumps of `event_body`, written directly for a plain token
    (no top tokens, details or error: most of them; the same bytes, in half the time)."""
    if (out.top_logprobs is None and out.error is None and not (detailed and out.finish_reason is not None)
            and type(out.logprob) is float and math.isfinite(out.logprob)):
        finish = out.finish_reason
        return (f'data:{{"index": {out.count_output_tokens:d}, "token": {{"id": {out.token_id:d}, '
                f'"text": {encode_basestring(out.text)}, '
                f'"logprob": {float.__repr__(out.logprob)}, "special": {"true" if out.special else "false"}}}, '
                f'"generated_text": {"null" if full_text is None else encode_basestring(full_text)}, '
                f'"finished": {"false" if finish is None else "true"}, '
                f'"finish_reason": {"null" if finish is None else encode_basestring(reason_name(finish, reasons))}}}\n\n')
    return f"data:{json.dumps(event_body(out, full_text, detailed, seed, reasons), ensure_ascii=False)}\n\n"


def reason_name(reason: FinishReason, reasons: dict | None) -> str:
    return reason.value if reasons is None else reasons[reason.value]


def event_body(out: TextOut, full_text: str | None, detailed: bool, seed: int, reasons: dict | None = None) -> dict:
    event = {
        "index": out.count_output_tokens,  # TGI's: the token's place in the sequence, from 1
        "token": {"id": out.token_id, "text": out.text, "logprob": out.logprob, "special": out.special},
        "generated_text": full_text,
        "finished": out.finish_reason is not None,
        "finish_reason": None if out.finish_reason is None else reason_name(out.finish_reason, reasons),
    }
    if out.top_logprobs is not None:
        event["top_tokens"] = top_entries(out)
    if detailed and out.finish_reason is not None:
        event["details"] = {"finish_reason": reason_name(out.finish_reason, reasons),
                            "generated_tokens": out.count_output_tokens, "seed": seed}
    if out.error is not None:
        error = failure(out)
        event.update(error_body("/generate_stream", str(error), error.error_type, error.status_code))
    return event


async def sse_events(outputs, detailed: bool, seed: int, head: str = "", reasons: dict | None = None):
    """One event per token; the last carries the full text (after `head`: TGI's return_full_text)."""
    pieces = [head]
    async for _, out in outputs:
        pieces.append(out.text)
        yield sse_event(out, "".join(pieces) if out.finish_reason is not None else None, detailed, seed, reasons)


async def generate_stream(request: Request, body: GenerateRequest) -> Response:
    return await stream_answer(request, body)


async def stream_answer(request: Request, body: GenerateRequest, reasons: dict | None = None) -> Response:
    """/generate_stream's events; `reasons`: finish reasons renamed (TGI's)."""
    if body.parameters.sequences > 1:
        raise RequestError("'n' or 'best_of' > 1 is not supported by a stream: use /generate, or /v1/completions "
                           "with stream")
    generation, sampling = await start_generation(request, body)
    firsts = await generation.first()
    head = body.inputs if body.parameters.return_full_text else ""
    events = sse_events(generation.outputs(firsts), bool(body.parameters.details), sampling.seed, head, reasons)
    return generation.event_stream(events)
