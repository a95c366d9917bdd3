"""TGI's text-generation routes: POST /generate (one JSON answer) and /generate_stream (server-sent
events, one per token)."""

from __future__ import annotations

import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lightllm.server.httpserver.generation import Generation, tokenize
from lightllm.server.httpserver.json_body import add_json_route
from lightllm.server.httpserver.params import GenerateRequest, check_prompt_chars
from lightllm.server.io_struct import TextOut


def add_generate_routes(app: FastAPI) -> None:
    add_json_route(app, "/generate", generate)
    add_json_route(app, "/generate_stream", generate_stream)


async def start_generation(request: Request, body: GenerateRequest) -> Generation:
    """Tokenize a /generate prompt (refused before if it is too long) and submit it."""
    start = time.monotonic()
    state = request.app.state.server
    check_prompt_chars(len(body.inputs), state.limits)
    return Generation(request, await tokenize(state.tokenizer.encode, body.inputs), body.parameters.sampling(), start)


async def generate(request: Request, body: GenerateRequest) -> Response:
    generation = await start_generation(request, body)
    text, last = await generation.result()
    return JSONResponse(
        {
            "generated_text": [text],
            "count_output_tokens": last.count_output_tokens,
            "finish_reason": last.finish_reason.value,
            "prompt_tokens": generation.prompt_len,
            "cached_tokens": generation.timer.cached_tokens,
        }
    )


def sse_event(out: TextOut, full_text: str | None) -> str:
    event = {
        "token": {"id": out.token_id, "text": out.text, "logprob": out.logprob, "special": out.special},
        "generated_text": full_text,
        "finished": out.finish_reason is not None,
        "finish_reason": out.finish_reason.value if out.finish_reason is not None else None,
    }
    if out.error is not None:
        event["error"], event["error_type"] = f"generation failed: {out.error}", "internal"
    return f"data:{json.dumps(event, ensure_ascii=False)}\n\n"


async def sse_events(outputs):
    """One event per token; the last carries the full text."""
    pieces = []
    async for out in outputs:
        pieces.append(out.text)
        yield sse_event(out, "".join(pieces) if out.finish_reason is not None else None)


async def generate_stream(request: Request, body: GenerateRequest) -> Response:
    generation = await start_generation(request, body)
    first = await generation.first()
    return StreamingResponse(sse_events(generation.outputs(first)), media_type="text/event-stream")
