"""The HTTP app: /health, /info, /metrics and the error handlers; /generate and /generate_stream
are in generate_api.py, the OpenAI-style /v1/* routes in openai_api.py (chat and completions) and
responses_api.py (/v1/responses), Anthropic's /v1/messages in messages_api.py, /tokenize and
/detokenize in tokenize_api.py, /docs in docs_page.py, the --api_key check in auth.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import lightllm
from lightllm.frontend.chat.output import ChatParsers, chat_parsers
from lightllm.server.config import ServerConfig
from lightllm.server.httpserver.auth import ApiKeyAuth
from lightllm.server.httpserver.body_limit import BodyLimit
from lightllm.server.httpserver.docs_page import add_docs_routes
from lightllm.server.httpserver.errors import error_body
from lightllm.server.httpserver.generate_api import add_generate_routes
from lightllm.server.httpserver.generation import ClientGone, GenerationFailed
from lightllm.server.httpserver.grammar_cache import GrammarCache
from lightllm.server.httpserver.manager import HttpServerManager, QueueFull, ServerUnavailable
from lightllm.server.httpserver.metrics import CONTENT_TYPE, Metrics
from lightllm.frontend.errors import RequestError
from lightllm.server.httpserver.json_body import PARSERS, describe_errors
from lightllm.server.httpserver.messages_api import add_messages_routes
from lightllm.server.httpserver.openai_api import add_openai_routes
from lightllm.frontend.sampling_ranges import model_sampling_defaults
from lightllm.frontend.limits import Limits, prompt_char_bound
from lightllm.server.httpserver.responses_api import add_responses_routes
from lightllm.server.httpserver.prompt_encoder import PromptEncoder
from lightllm.server.httpserver.tokenize_api import add_tokenize_routes
from lightllm.server.httpserver.lora_api import add_lora_routes
from lightllm.frontend.lora import LoraNames
from lightllm.engine.request import FinishReason, SamplingParams
from lightllm.server.io_struct import FlushCache, RouterHeartbeat, RouterReady


logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    config: ServerConfig
    tokenizer: object
    encoder: PromptEncoder  # prompt text -> token ids, off the event loop
    manager: HttpServerManager
    metrics: Metrics
    limits: Limits
    model_info: dict
    health_prompt_ids: list[int]
    health_probe: OneTokenProbe
    grammars: GrammarCache
    started: float  # wall-clock time of start-up
    chat: ChatParsers  # how answers' tool calls and reasoning are read
    sampling_defaults: dict  # for the fields an OpenAI-style request leaves out (--sampling_defaults)
    loras: LoraNames  # the LoRA adapters a request may name


def sampling_defaults(config: ServerConfig, model_info: dict) -> dict:
    """The OpenAI routes' defaults: the model's (generation_config.json) or none (OpenAI's own)."""
    if config.sampling_defaults != "model":
        return {}
    defaults = model_sampling_defaults(dict(model_info["sampling_defaults"]))  # (name, value) pairs
    if defaults:
        logger.info("sampling defaults of the /v1 routes from the model's generation_config.json: %s "
                    "(--sampling_defaults openai: OpenAI's)", defaults)
    return defaults


def create_app(config: ServerConfig, tokenizer, ready: list[RouterReady], heartbeats: list[RouterHeartbeat]) -> FastAPI:
    """`ready` and `heartbeats`: one per --dp replica."""
    capacities = [r.max_total_token_num for r in ready]
    model_info = ready[0].model_info
    loras = LoraNames(config, model_info)
    metrics = Metrics(capacities, loras, config.max_req_total_len)
    state = ServerState(
        config=config,
        tokenizer=tokenizer,
        encoder=PromptEncoder(tokenizer),
        manager=HttpServerManager(config, metrics, heartbeats,
                                  host_cache_tokens=[r.model_info.get("host_kv_cache_tokens", 0)
                                                     + r.model_info.get("disk_kv_cache_tokens", 0) for r in ready]),
        metrics=metrics,
        limits=Limits(config.max_req_input_len, config.max_req_total_len, min(capacities),
                      prompt_char_bound(tokenizer, config.max_req_input_len)),
        model_info=model_info,
        # Any model can read its own EOS token; a word might tokenize past a small model's vocabulary.
        health_prompt_ids=model_info["eos_token_ids"][:1] or [0],
        health_probe=OneTokenProbe(metrics),
        grammars=GrammarCache(tokenizer, model_info, config.grammar_compile_timeout, config.log_level),
        started=time.time(),
        chat=chat_parsers(config.tool_call_parser, config.reasoning_parser, model_info.get("architecture"),
                          getattr(tokenizer, "chat_template", None)),
        sampling_defaults=sampling_defaults(config, model_info),
        loras=loras,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.manager.start()  # api_server says "serving" once uvicorn accepts connections
        state.grammars.prepare()  # in the background
        yield
        await state.manager.stop()
        state.grammars.close()
        PARSERS.close()

    app = FastAPI(title="lightllm", version=lightllm.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_body_bytes)
    if config.api_key is not None:  # added after the body limit, so it runs first: a keyless body is never read
        app.add_middleware(ApiKeyAuth, api_key=config.api_key)
    if config.origins:  # outermost: a preflight carries no key, and a 401 or 413 still needs its CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=config.origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    app.state.server = state
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(RequestValidationError, fastapi_validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(GenerationFailed, generation_failed)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(ClientDisconnect, client_disconnected)
    app.add_exception_handler(ServerUnavailable, server_unavailable)
    app.add_exception_handler(QueueFull, queue_full)
    add_generate_routes(app)
    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/info", info, methods=["GET"])
    app.add_api_route("/metrics", metrics_text, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    for path in ("/reset_prefix_cache", "/flush_cache"):  # vLLM's name, SGLang's
        app.add_api_route(path, reset_prefix_cache, methods=["POST"])
    add_openai_routes(app)
    add_lora_routes(app)
    add_responses_routes(app)
    add_messages_routes(app)
    add_tokenize_routes(app)
    add_docs_routes(app)
    return app


def error_response(request: Request, status_code: int, message: str, error_type: str) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, message, error_type, status_code), status_code=status_code)


async def request_error(request: Request, exc: RequestError) -> JSONResponse:
    request.app.state.server.metrics.rejected.inc()
    return error_response(request, exc.status_code, str(exc), "validation")


async def fastapi_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    request.app.state.server.metrics.rejected.inc()
    return error_response(request, 400, describe_errors(exc.errors()), "validation")


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(request, exc.status_code, str(exc.detail), "http")


async def generation_failed(request: Request, exc: GenerationFailed) -> JSONResponse:
    return error_response(request, exc.status_code, str(exc), exc.error_type)


def retry_later(request: Request, exc: ServerUnavailable | QueueFull) -> JSONResponse:
    response = error_response(request, exc.status_code, str(exc), exc.error_type)
    response.headers["Retry-After"] = str(exc.retry_after)
    return response


async def server_unavailable(request: Request, exc: ServerUnavailable) -> JSONResponse:
    return retry_later(request, exc)


async def queue_full(request: Request, exc: QueueFull) -> JSONResponse:
    request.app.state.server.metrics.queue_full.inc()
    return retry_later(request, exc)


async def client_gone(request: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it; the request was aborted


async def client_disconnected(request: Request, exc: ClientDisconnect) -> Response:
    """The client hung up before its body was whole (or --request_receive_timeout closed it): a line,
    not the traceback of an unhandled exception."""
    client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
    logger.info("%s went away before sending the whole body of %s %s", client, request.method, request.url.path)
    return Response(status_code=499)  # nobody reads it


# ---- /health, /info, /metrics ----


async def health(request: Request, generate: bool = False) -> JSONResponse:
    """200 while the router's loop turns and every process is up, busy or not; 503 otherwise,
    at once. With ?generate=1, also a one-token generation through every process."""
    state: ServerState = request.app.state.server
    problem = state.manager.health_problem()
    if problem is None and generate:
        problem = await state.health_probe.problem(state)
    if problem is not None:
        return JSONResponse({"status": "unhealthy", "error": problem}, 503)
    return JSONResponse({"status": "ok"})


class OneTokenProbe:
    """/health?generate=1's generation, one at a time: probes that come while it runs wait for it and
    share its answer (what a load balancer expects of a health check: 200 or 503, never a refusal), so
    a burst of probes, as every balancer of a fleet sends, costs one generation."""

    def __init__(self, metrics: Metrics):
        self._running: asyncio.Future | None = None
        self._waiting = metrics.health_probes_waiting

    async def problem(self, state: ServerState) -> str | None:
        if self._running is None:
            self._running = asyncio.ensure_future(one_token_problem(state))
            self._running.add_done_callback(self._finished)
        with self._waiting.track_inprogress():
            # A probe that gives up must not cancel the generation that the others wait for.
            return await asyncio.shield(self._running)

    def _finished(self, running: asyncio.Future) -> None:
        self._running = None


async def one_token_problem(state: ServerState) -> str | None:
    """Why a one-token generation failed (None: it went through in time). It queues behind real work."""
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    try:
        async with asyncio.timeout(state.config.health_timeout):
            # Not bounded by --max_queued_requests: a full queue is a busy server, not a broken one.
            stream = state.manager.generate(state.health_prompt_ids, sampling, bounded=False)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    pass
    except TimeoutError:
        return f"no token within {state.config.health_timeout}s"
    except ServerUnavailable as exc:
        return str(exc)
    return out.error if out.finish_reason is FinishReason.ERROR else None


def speculative_info(text: str | None) -> dict | None:
    from lightllm.engine.spec.config import SpeculativeConfig

    config = SpeculativeConfig.parse(text)
    return None if config is None else config.describe()


async def version(request: Request) -> JSONResponse:
    """vLLM's GET /version."""
    return JSONResponse({"version": lightllm.__version__})


async def reset_prefix_cache(request: Request) -> JSONResponse:
    """Drop every prefix-cache entry no running request holds, on every replica and tier (vLLM's
    POST /reset_prefix_cache, SGLang's /flush_cache): a benchmark's next run starts cold without
    a restart. Requests sent after this answer find nothing cached before it (each router reads
    its socket in order)."""
    request.app.state.server.manager.send_all(FlushCache())
    return JSONResponse({"status": "ok"})


async def info(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    config, model = state.config, state.model_info
    return JSONResponse(
        {
            "version": lightllm.__version__,
            "model_dir": config.model_dir,
            "served_model_name": config.served_model_name,
            "architecture": model.get("architecture"),
            "dtype": model.get("dtype"),
            "quantization": config.quantization,
            "kv_cache_dtype": config.kv_cache_dtype,
            "mxfp4_experts": model.get("mxfp4_experts", config.mxfp4_experts),
            "vocab_size": model.get("vocab_size"),
            "max_position_embeddings": model.get("max_position_embeddings"),
            "max_total_token_num": state.limits.max_total_token_num,
            "tp": config.tp,
            "dp": config.dp,
            "max_req_input_len": config.max_req_input_len,
            "max_req_total_len": config.max_req_total_len,
            "chunked_prefill_size": config.chunked_prefill_size,
            "burst_chunked_prefill_size": model.get("burst_chunked_prefill_size"),
            "running_max_req_size": model.get("running_max_req_size", config.running_max_req_size),  # fewer: states
            "speculative_config": speculative_info(config.speculative_config),
            "tool_call_parser": state.chat.tool_call_parser,
            "reasoning_parser": config.reasoning_parser,
        }
    )


async def metrics_text(request: Request) -> Response:
    metrics: Metrics = request.app.state.server.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE)
