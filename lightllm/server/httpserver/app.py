"""The HTTP API: /generate, /generate_stream, /health, /info, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import lightllm
from lightllm.server.config import ServerConfig
from lightllm.server.httpserver.manager import HttpServerManager
from lightllm.server.httpserver.metrics import Metrics
from lightllm.server.httpserver.params import Limits, RequestError, check_lengths, parse_generate, parse_json
from lightllm.server.io_struct import FinishReason, RouterReady, SamplingParams, TextOut

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    config: ServerConfig
    tokenizer: object
    manager: HttpServerManager
    metrics: Metrics
    limits: Limits
    model_info: dict
    health_prompt_ids: list[int]


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def create_app(config: ServerConfig, tokenizer, ready: RouterReady) -> FastAPI:
    metrics = Metrics(ready.max_total_token_num)
    state = ServerState(
        config=config,
        tokenizer=tokenizer,
        manager=HttpServerManager(config, metrics),
        metrics=metrics,
        limits=Limits(config.max_req_input_len, config.max_req_total_len, ready.max_total_token_num),
        model_info=ready.model_info,
        # Any model can read its own EOS token; a word might tokenize past a small model's vocabulary.
        health_prompt_ids=ready.model_info["eos_token_ids"][:1] or [0],
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.manager.start()
        logger.info("serving %s on http://%s:%d", config.model_dir, config.host, config.port)
        yield
        await state.manager.stop()

    app = FastAPI(title="lightllm", version=lightllm.__version__, lifespan=lifespan)
    app.state.server = state
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(RequestValidationError, fastapi_validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_api_route("/generate", generate, methods=["POST"])
    app.add_api_route("/generate_stream", generate_stream, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/info", info, methods=["GET"])
    app.add_api_route("/metrics", metrics_text, methods=["GET"])
    return app


def error_response(status_code: int, message: str, error_type: str) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status_code)


async def request_error(request: Request, exc: RequestError) -> JSONResponse:
    request.app.state.server.metrics.rejected += 1
    return error_response(exc.status_code, str(exc), "validation")


async def fastapi_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    request.app.state.server.metrics.rejected += 1
    return error_response(422, "; ".join(str(e.get("msg", e)) for e in exc.errors()), "validation")


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), "http")


# ---- /generate and /generate_stream ----


async def read_request(request: Request) -> tuple[list[int], SamplingParams]:
    state: ServerState = request.app.state.server
    prompt, sampling = parse_generate(parse_json(await request.body()))
    prompt_ids = state.tokenizer.encode(prompt)
    check_lengths(len(prompt_ids), sampling, state.limits)
    return prompt_ids, sampling


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, coro):
    """Await `coro`, cancelling it (and so aborting its request) if the client goes away first."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            raise ClientGone()
    return work.result()


class RequestTimer:
    """Time to first token and end-to-end latency, from arrival at the HTTP server."""

    def __init__(self, metrics: Metrics, prompt_len: int, start: float):
        self.metrics, self.prompt_len, self.start = metrics, prompt_len, start
        self.first_token_seen = False

    def observe(self, out: TextOut) -> None:
        now = time.monotonic()
        if not self.first_token_seen:
            self.first_token_seen = True
            self.metrics.time_to_first_token.observe(now - self.start)
        if out.finish_reason is not None:
            self.metrics.observe_finished(out.finish_reason, self.prompt_len, out.count_output_tokens, now - self.start)

    def observe_abort(self) -> None:
        self.metrics.finished[FinishReason.ABORT] += 1


async def collect(stream, timer: RequestTimer) -> tuple[str, TextOut]:
    pieces = []
    async with contextlib.aclosing(stream):
        async for out in stream:
            timer.observe(out)
            pieces.append(out.text)
    return "".join(pieces), out


async def start_generation(request: Request) -> tuple[list[int], RequestTimer, object]:
    """Validate the body, start the request's timer and submit it; returns its token stream."""
    start = time.monotonic()
    state: ServerState = request.app.state.server
    prompt_ids, sampling = await read_request(request)
    timer = RequestTimer(state.metrics, len(prompt_ids), start)
    return prompt_ids, timer, state.manager.generate(prompt_ids, sampling)


async def generate(request: Request) -> Response:
    prompt_ids, timer, stream = await start_generation(request)
    try:
        text, last = await unless_disconnected(request, collect(stream, timer))
    except ClientGone:
        timer.observe_abort()
        return Response(status_code=499)  # nobody reads it; the request was aborted
    if last.finish_reason is FinishReason.ERROR:
        return error_response(500, f"generation failed: {last.error}", "internal")
    return JSONResponse(
        {
            "generated_text": [text],
            "count_output_tokens": last.count_output_tokens,
            "finish_reason": last.finish_reason.value,
            "prompt_tokens": len(prompt_ids),
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


async def sse_events(stream, first: TextOut, timer: RequestTimer):
    """One event per token; the last carries the full text. Cancelled if the client leaves."""
    pieces, out = [], first
    try:
        async with contextlib.aclosing(stream):
            while out.finish_reason is None:
                pieces.append(out.text)
                yield sse_event(out, None)
                out = await anext(stream)
                timer.observe(out)
    finally:  # cancelled while waiting for a token, or closed at a `yield`: the client left
        if out.finish_reason is None:
            timer.observe_abort()
    pieces.append(out.text)
    yield sse_event(out, "".join(pieces))


async def generate_stream(request: Request) -> Response:
    _, timer, stream = await start_generation(request)
    # Wait for the first token before answering, so that a failed prefill is still a clean 5xx.
    try:
        first = await unless_disconnected(request, anext(stream))
    except ClientGone:
        timer.observe_abort()
        return Response(status_code=499)
    timer.observe(first)
    if first.finish_reason is FinishReason.ERROR:
        await stream.aclose()
        return error_response(500, f"generation failed: {first.error}", "internal")
    return StreamingResponse(sse_events(stream, first, timer), media_type="text/event-stream")


# ---- /health, /info, /metrics ----


async def health(request: Request) -> JSONResponse:
    """200 when a one-token generation goes through every process in time, 503 otherwise."""
    state: ServerState = request.app.state.server
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    try:
        async with asyncio.timeout(state.config.health_timeout):
            async with contextlib.aclosing(state.manager.generate(state.health_prompt_ids, sampling)) as stream:
                async for out in stream:
                    pass
    except TimeoutError:
        return JSONResponse({"status": "unhealthy", "error": f"no token within {state.config.health_timeout}s"}, 503)
    if out.finish_reason is FinishReason.ERROR:
        return JSONResponse({"status": "unhealthy", "error": out.error}, 503)
    return JSONResponse({"status": "ok"})


async def info(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    config, model = state.config, state.model_info
    return JSONResponse(
        {
            "version": lightllm.__version__,
            "model_dir": config.model_dir,
            "architecture": model.get("architecture"),
            "dtype": model.get("dtype"),
            "vocab_size": model.get("vocab_size"),
            "max_position_embeddings": model.get("max_position_embeddings"),
            "max_total_token_num": state.limits.max_total_token_num,
            "tp": config.tp,
            "max_req_input_len": config.max_req_input_len,
            "max_req_total_len": config.max_req_total_len,
            "batch_max_tokens": config.prefill_token_budget,
            "running_max_req_size": config.running_max_req_size,
        }
    )


async def metrics_text(request: Request) -> PlainTextResponse:
    metrics: Metrics = request.app.state.server.metrics
    return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")
