"""ServerConfig: the HTTP and process settings, over the frontend's and the engine's
(FrontendConfig, EngineConfig). argparse reads every flag's name, default and help from them.

Fields whose metadata has `internal=True` are not command-line flags: the main process fills
them in at start (free loopback addresses) and passes the whole config to its children.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field

from lightllm.engine.config import NODE_TOKEN_ENV, flag
from lightllm.frontend.config import FrontendConfig
from lightllm.utils.net import ipc_addresses

API_KEY_ENV = "LIGHTLLM_API_KEY"


@dataclass(frozen=True)
class ServerConfig(FrontendConfig):
    host: str = field(default="127.0.0.1", metadata=flag("address the HTTP server listens on"))
    port: int = field(default=8000, metadata=flag("port the HTTP server listens on"))
    served_model_name: str | None = field(
        default=None,
        metadata=flag("the model's name in the OpenAI-style API (/v1/models and requests' 'model' field); absent: the model directory's name"),
    )
    dp_routing: str = field(
        default="prefix",
        metadata=flag("how a request picks its --dp replica: prefix = the one whose cache most likely holds the longest prefix of its prompt (an index of the prompts sent to each), unless that one's open requests take more than 1.25x the least loaded one's share of its KV budget plus 5 percent of it; least_loaded = the smallest such share; round_robin = in turn (docs/architecture.md)", choices=("prefix", "least_loaded", "round_robin")),
    )
    max_queued_requests: int = field(
        default=4096,
        metadata=flag("most open requests that have not yet had their first token (waiting for admission or in prefill); one more gets 429 with Retry-After at once, before it reaches the router. Twice the largest burst of the repo's benchmarks (2,000 requests at once): a bound on memory and on waiting, not on throughput"),
    )
    api_key: str | None = field(
        default=None,
        repr=False,  # never in a log line
        metadata=flag(f"require 'Authorization: Bearer KEY' on every route but /health, /info, /metrics and /version (and on /health?generate=1); absent: ${API_KEY_ENV} if set, else no key. The environment variable keeps the key out of the process list"),
    )
    max_request_body_bytes: int = field(
        default=8 << 20,
        metadata=flag("largest request body accepted, in bytes; a larger one gets 413 before it is read (8 MiB: a 2048-token prompt is a few tens of kB)"),
    )
    ssl_keyfile: str | None = field(default=None, metadata=flag("serve HTTPS with this PEM private key (with --ssl_certfile)"))
    ssl_certfile: str | None = field(default=None, metadata=flag("serve HTTPS with this PEM certificate chain (with --ssl_keyfile)"))
    allowed_origins: str | None = field(
        default=None,
        metadata=flag("comma-separated origins (scheme://host[:port]) whose browser pages may call the API (CORS), or '*' for any; absent: no CORS headers, so browsers refuse cross-origin calls"),
    )
    request_receive_timeout: float = field(
        default=30.0,
        metadata=flag("seconds a client has to send a whole request (headers and body), from its first byte (or from the connection); past it the server answers 408 and closes the connection. 30 s: an 8 MiB body needs 280 kB/s"),
    )
    keep_alive_timeout: float = field(
        default=5.0,
        metadata=flag("seconds an idle keep-alive connection stays open between two requests (uvicorn's and vLLM's default)"),
    )
    max_connections: int = field(
        default=8192,
        metadata=flag("most open HTTP connections; one more is answered 503 with Retry-After and closed at once, while those already open go on being served. Twice --max_queued_requests, so that a full queue and its streams fit"),
    )
    trust_request_chat_template: bool = field(
        default=False,
        metadata=flag("render a chat request's own 'chat_template' (vLLM's field and flag); by default such a request gets 400 and every chat is rendered with the model's template or --chat_template's. A request's template runs in jinja2's sandbox, but only its author bounds how long it takes: set this where the clients are trusted"),
    )
    disable_log_stats: bool = field(default=False, metadata=flag("do not log throughput and KV usage"))
    log_stats_interval: float = field(default=10.0, metadata=flag("seconds between throughput logs (only when there was activity)"))
    health_timeout: float = field(default=10.0, metadata=flag("seconds GET /health?generate=1 waits for its one-token generation"))
    step_timeout: float = field(
        default=120.0,
        metadata=flag("seconds one engine step may run before /health reports the engine stuck (503); well above the longest step (a 4096-token prefill of the default model on a 2-core CPU: about 50 s)"),
    )
    shutdown_timeout: float = field(
        default=20.0,
        metadata=flag("seconds that running requests have to finish after SIGTERM or Ctrl-C (new ones get 503); the rest then end with a 503 (in a stream, an \"unavailable\" error event). Below Kubernetes' default 30 s grace period, so that they get it before a SIGKILL"),
    )

    # Filled in by the main process at start (with_addresses).
    router_addresses: tuple[str, ...] = field(default=(), metadata={"internal": True})  # each replica's router's PULL socket
    detokenization_address: str = field(default="", metadata={"internal": True})  # detokenizer's PULL socket
    http_address: str = field(default="", metadata={"internal": True})  # HTTP process's PULL socket
    socket_dir: str = field(default="", metadata={"internal": True})  # holds them all, removed at exit

    def with_addresses(self) -> ServerConfig:
        """This config with free loopback addresses for every process's socket, in a new directory."""
        socket_dir, addresses = ipc_addresses([f"router{d}" for d in range(self.dp)] + ["detokenization", "http"])
        *routers, detokenization, http = addresses
        return dataclasses.replace(self, socket_dir=socket_dir, router_addresses=tuple(routers),
                                   detokenization_address=detokenization, http_address=http)

    def check(self) -> None:
        """Raise ValueError, naming the flag, for settings that cannot work together."""
        super().check()
        for name in ("max_request_body_bytes", "max_queued_requests", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        for name in ("log_stats_interval", "health_timeout", "step_timeout", "request_receive_timeout",
                     "keep_alive_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive")
        if self.shutdown_timeout < 0:
            raise ValueError("--shutdown_timeout must not be negative")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api_key must not be empty")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl_keyfile and --ssl_certfile go together")
        for name in ("ssl_keyfile", "ssl_certfile"):
            if getattr(self, name) is not None and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"--{name} {getattr(self, name)} is not a file")
        if self.allowed_origins is not None and not self.origins:
            raise ValueError("--allowed_origins must name at least one origin")

    @property
    def origins(self) -> list[str]:
        """--allowed_origins as a list ([] when absent)."""
        return [origin.strip() for origin in (self.allowed_origins or "").split(",") if origin.strip()]

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"


def _cli_type(annotation) -> type:
    """int | None -> int; plain types unchanged."""
    if isinstance(annotation, types.UnionType):
        (inner,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return inner
    return annotation


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightllm.server.api_server",
        description="LightLLM-style token-attention inference server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        if f.metadata.get("internal"):
            continue
        kind = _cli_type(hints[f.name])
        if f.metadata.get("nargs"):  # a tuple of strings
            parser.add_argument(f"--{f.name}", nargs=f.metadata["nargs"], default=f.default, help=f.metadata["help"])
        elif kind is bool:
            parser.add_argument(f"--{f.name}", action="store_true", help=f.metadata["help"])
        else:
            parser.add_argument(
                f"--{f.name}", type=kind, default=f.default, help=f.metadata["help"], choices=f.metadata.get("choices")
            )
    return parser


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """The flags, and the environment variables (read only here) for settings not given as flags."""
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    # Read after parsing, so that --help never shows them.
    given["api_key"] = given["api_key"] if given["api_key"] is not None else os.environ.get(API_KEY_ENV) or None
    given["node_token"] = given["node_token"] if given["node_token"] is not None else (
        os.environ.get(NODE_TOKEN_ENV) or None)
    given = {name: tuple(value) if isinstance(value, list) else value for name, value in given.items()}
    config = ServerConfig(**given)
    try:
        config.check()
    except ValueError as exc:
        parser.error(str(exc))
    return config
