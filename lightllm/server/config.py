"""ServerConfig: every server setting, once. argparse reads names, defaults and help from it.

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

from lightllm.utils.net import ipc_addresses

API_KEY_ENV = "LIGHTLLM_API_KEY"
NODE_TOKEN_ENV = "LIGHTLLM_NODE_TOKEN"
MIN_NODE_TOKEN_CHARS = 16


def _flag(help_text: str, **extra) -> dict:
    return {"help": help_text, **extra}


@dataclass
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=_flag("address the HTTP server listens on"))
    port: int = field(default=8000, metadata=_flag("port the HTTP server listens on"))
    model_dir: str | None = field(
        default=None,
        metadata=_flag("Hugging Face model directory; absent: the default model (SmolLM2-135M-Instruct), prepared on first use"),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=_flag("the model's name in the OpenAI-style API (/v1/models and requests' 'model' field); absent: the model directory's name"),
    )
    tokenizer_mode: str = field(
        default="auto",
        metadata=_flag("auto: fast tokenizer when there is one; slow: the Python tokenizer", choices=("auto", "slow")),
    )
    max_total_token_num: int | None = field(
        default=None,
        metadata=_flag("KV-cache budget in tokens over all requests; absent: what fits in --mem_fraction of the memory beside the largest step, which every rank runs once at start (on the CPU at most 16384). A figure that does not fit is refused at start with the largest that would"),
    )
    mem_fraction: float = field(
        default=0.9,
        metadata=_flag("share of the device's memory (GPU) or of the host's RAM (CPU, less what other processes use) the server may take: weights, the KV cache, CUDA graphs and the largest step's activations, logits and sampling buffers, measured at start"),
    )
    chunked_prefill_size: int = field(
        default=2048,
        metadata=_flag("most prompt tokens prefilled in one step, over all requests; longer prompts are prefilled in chunks over several steps, beside the running decodes. 2048 bounds a step beside a full batch to ~60 ms on an H100 with an 8B model, which keeps the tail of time to first token and per token low at moderate load (docs/benchmarks.md)"),
    )
    burst_chunked_prefill_size: int | None = field(
        default=None,
        metadata=_flag("most prompt tokens prefilled in one step while a burst waits (more than 2 steps' worth of --chunked_prefill_size not yet prefilled, admitted or waiting): fewer, larger steps each pay the running batch's decode once, so a burst's last requests get their first token sooner, at a longer step for the running ones meanwhile; at a steady moderate rate the backlog stays below and steps keep --chunked_prefill_size. Absent: 8192 on a GPU (H100, 8B model, ShareGPT 1000 at once: P99 time to first token 9.5 -> 7.0 s, throughput 1.035x, P99 time per token 79 -> 234 ms; docs/benchmarks.md), off on a CPU; 0: off. The start-up's memory profile runs a step of this many prompt tokens"),
    )
    schedule_policy: str = field(
        default="lpt",
        metadata=_flag("order in which waiting requests are admitted: lpt = longest max_new_tokens first (requests waiting 256 steps go first, in arrival order), fcfs = arrival order; lpt was chosen in simulation (test/benchmark/sim_serving.py, see docs/architecture.md)", choices=("lpt", "fcfs")),
    )
    disable_overlap: bool = field(
        default=False,
        metadata=_flag("plan each step only after the previous one's tokens are back (a synchronous loop, for debugging); by default the next step is planned while the device runs the current one"),
    )
    disable_prefix_cache: bool = field(
        default=False,
        metadata=_flag("recompute every prompt; by default the KV of prompt prefixes already computed (shared system prompts, earlier chat turns) is kept in a radix tree and reused, evicted least recently used first when room is needed"),
    )
    admission_wait_steps: int = field(
        default=8,
        metadata=_flag("while the running batch is nearly full (fewer free slots than running_max_req_size / 16, and than requests waiting), admit waiting requests at most once in this many steps: slots freed one by one are then filled by one prefill step instead of one each, and every such step runs eagerly (no CUDA graph) and slows the whole batch; 0 admits at every step (see docs/benchmarks.md)"),
    )
    running_max_req_size: int = field(default=1024, metadata=_flag("most requests in the running batch (and the largest CUDA-graph decode bucket); 1024 starts a burst's requests sooner (lower time to first token) at a few percent of throughput against 512 (docs/benchmarks.md)"))
    tp: int = field(default=1, metadata=_flag("tensor-parallel degree: one model worker process per rank"))
    dp: int = field(default=1, metadata=_flag("data-parallel replicas on this machine behind the one HTTP endpoint: each is an engine (router process and --tp workers; replica d uses GPUs d*tp to d*tp+tp-1) and each request goes to the least loaded one"))
    max_req_input_len: int = field(default=2048, metadata=_flag("longest prompt accepted, in tokens"))
    max_req_total_len: int = field(default=2048 + 1024, metadata=_flag("longest prompt + max_new_tokens accepted"))
    nccl_port: int = field(default=28765, metadata=_flag("port of the torch.distributed rendezvous between model workers on one machine (over several: --dist_init_addr)"))
    nnodes: int = field(default=1, metadata=_flag("machines the --tp ranks span, tp / nnodes on each (see docs/architecture.md, 'Scaling past one machine')"))
    node_rank: int = field(default=0, metadata=_flag("this machine's index: 0 serves HTTP and drives every rank; the others run only their ranks' model workers"))
    dist_init_addr: str | None = field(default=None, metadata=_flag("HOST:PORT where node 0's router hosts the rendezvous of the nodes (a torch.distributed TCPStore); required with --nnodes > 1"))
    dist_timeout: float = field(default=300.0, metadata=_flag("seconds node 0 waits for the other nodes to join, and they for node 0 to answer; then start-up ends with an error"))
    worker_host: str | None = field(default=None, metadata=_flag("nodes > 0: address their model workers listen on for node 0's router; absent: this machine's address on the route to --dist_init_addr"))
    worker_port: int = field(default=0, metadata=_flag("nodes > 0: port of the first local rank's model worker (the next rank PORT+1, ...); 0: any free port, published through the rendezvous"))
    node_token: str | None = field(
        default=None,
        repr=False,  # never in a log line
        metadata=_flag(f"with --nnodes > 1, required and the same on every node (at least {MIN_NODE_TOKEN_CHARS} characters, e.g. `openssl rand -hex 16`): node 0's router must present it to the other nodes' model workers; it never crosses the rendezvous. Absent: ${NODE_TOKEN_ENV}, which keeps it out of the process list"),
    )
    max_queued_requests: int = field(
        default=4096,
        metadata=_flag("most open requests that have not yet had their first token (waiting for admission or in prefill); one more gets 429 with Retry-After at once, before it reaches the router. Twice the largest burst of the repo's benchmarks (2,000 requests at once): a bound on memory and on waiting, not on throughput"),
    )
    api_key: str | None = field(
        default=None,
        repr=False,  # never in a log line
        metadata=_flag(f"require 'Authorization: Bearer KEY' on every route but /health, /info and /metrics (and on /health?generate=1); absent: ${API_KEY_ENV} if set, else no key. The environment variable keeps the key out of the process list"),
    )
    max_request_body_bytes: int = field(
        default=8 << 20,
        metadata=_flag("largest request body accepted, in bytes; a larger one gets 413 before it is read (8 MiB: a 2048-token prompt is a few tens of kB)"),
    )
    ssl_keyfile: str | None = field(default=None, metadata=_flag("serve HTTPS with this PEM private key (with --ssl_certfile)"))
    ssl_certfile: str | None = field(default=None, metadata=_flag("serve HTTPS with this PEM certificate chain (with --ssl_keyfile)"))
    allowed_origins: str | None = field(
        default=None,
        metadata=_flag("comma-separated origins (scheme://host[:port]) whose browser pages may call the API (CORS), or '*' for any; absent: no CORS headers, so browsers refuse cross-origin calls"),
    )
    grammar_compile_timeout: float = field(
        default=10.0,
        metadata=_flag("seconds a request's grammar (JSON schema, regex) may take to compile; longer gets 400. It compiles in the HTTP process, off the engine step, once per grammar (cached)"),
    )
    sampling_defaults: str = field(
        default="model",
        metadata=_flag("model: the OpenAI-style routes (/v1/*) take the sampling fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty) from the model's generation_config.json, as vLLM does by default (--generation-config auto; Qwen2.5: temperature 0.7, top_p 0.8, top_k 20); openai: OpenAI's defaults (temperature 1, the whole vocabulary). /generate keeps TGI's (greedy unless do_sample)", choices=("model", "openai")),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_flag("the Jinja chat template of every chat route (/v1/chat/completions, /v1/responses, /v1/messages, /tokenize's messages) and of LLM.chat, in place of the model's own: a file's path, or the template's text; for a model without one, or to change it (vLLM's --chat-template). Absent: the model directory's"),
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=_flag("how the model writes tool calls, parsed into 'tool_calls' by the chat APIs: hermes = <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> (Qwen2.5, Qwen3), llama3_json = {\"name\": ..., \"parameters\": ...} (Llama 3.1); absent: the one the chat template writes, else llama3_json for Llama models and hermes for the others", choices=("hermes", "llama3_json")),
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=_flag("qwen3: the model's <think>...</think> is returned apart from the answer ('reasoning_content'; a reasoning item in /v1/responses, a thinking block in /v1/messages); absent: it stays in the text", choices=("qwen3",)),
    )
    trust_remote_code: bool = field(default=False, metadata=_flag("allow the tokenizer to run code from the model directory"))
    data_type: str = field(default="auto", metadata=_flag("weight and activation dtype: auto, float16, bfloat16 or float32"))
    quantization: str | None = field(
        default=None,
        metadata=_flag("fp8: store the four projections of every layer in fp8 (e4m3, one scale per output row, quantised at load) and quantise their inputs per token: half the weight bytes a decode step reads and fp8 tensor cores for prefill (Hopper/Ada GPUs: compute capability 8.9 or above; the CPU runs the torch reference). The embedding, the LM head, norms and the KV cache stay in --data_type. See docs/benchmarks.md for throughput and accuracy", choices=("fp8",)),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_flag("auto: the KV cache in --data_type; fp8_e4m3: one byte a value (K and V rounded to e4m3, no scale: values past +-448 saturate), so twice the tokens in the same memory and half the bytes decode attention reads (Hopper/Ada GPUs: compute capability 8.9 or above; the CPU runs the torch reference)", choices=("auto", "fp8_e4m3")),
    )
    load_format: str = field(default="auto", metadata=_flag("auto: the checkpoint's weight files (safetensors or pytorch_model*.bin); dummy: random weights from config.json alone"))
    disable_cuda_graph: bool = field(default=False, metadata=_flag("run every step eagerly instead of replaying captured CUDA graphs (GPU only)"))
    cuda_graph_max_tokens: int | None = field(default=None, metadata=_flag("largest step, in tokens (decodes plus prompt chunks), replayed from a CUDA graph; larger steps run eagerly, their device time then covers their launch (see docs/architecture.md). Absent: 2048 x --tp (a step's device time shrinks with the ranks, its launch on the host does not), at most the largest step there can be (--chunked_prefill_size + --running_max_req_size)"))
    step_trace: str | None = field(default=None, metadata=_flag("write the device's per-step timeline (start, end, launch time and shape of every step) to this JSON-lines file, to find where the device idles; summarise it with test/benchmark/step_trace.py"))
    disable_log_stats: bool = field(default=False, metadata=_flag("do not log throughput and KV usage"))
    log_stats_interval: float = field(default=10.0, metadata=_flag("seconds between throughput logs (only when there was activity)"))
    health_timeout: float = field(default=10.0, metadata=_flag("seconds GET /health?generate=1 waits for its one-token generation"))
    step_timeout: float = field(
        default=120.0,
        metadata=_flag("seconds one engine step may run before /health reports the engine stuck (503); well above the longest step (a 4096-token prefill of the default model on a 2-core CPU: about 50 s)"),
    )
    shutdown_timeout: float = field(
        default=20.0,
        metadata=_flag("seconds that running requests have to finish after SIGTERM or Ctrl-C (new ones get 503); the rest then end with a 503 (in a stream, an \"unavailable\" error event). Below Kubernetes' default 30 s grace period, so that they get it before a SIGKILL"),
    )
    log_level: str = field(
        default="info",
        metadata=_flag("log level of every process", choices=("debug", "info", "warning", "error")),
    )

    # Filled in by the main process at start.
    router_addresses: list[str] = field(default_factory=list, metadata={"internal": True})  # each replica's router's PULL socket
    detokenization_address: str = field(default="", metadata={"internal": True})  # detokenizer's PULL socket
    http_address: str = field(default="", metadata={"internal": True})  # HTTP process's PULL socket
    socket_dir: str = field(default="", metadata={"internal": True})  # holds them all, removed at exit

    def allocate_addresses(self) -> None:
        self.socket_dir, addresses = ipc_addresses([f"router{d}" for d in range(self.dp)] + ["detokenization", "http"])
        *self.router_addresses, self.detokenization_address, self.http_address = addresses

    def check(self) -> None:
        """Raise ValueError, naming the flag, for settings that cannot work together."""
        if self.max_req_input_len < 1 or self.max_req_total_len <= self.max_req_input_len:
            raise ValueError("--max_req_total_len must be larger than --max_req_input_len (both positive)")
        if self.max_total_token_num is not None and self.max_total_token_num < 2:
            raise ValueError("--max_total_token_num must be at least 2")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError("--mem_fraction must be above 0 and at most 1")
        for name in ("tp", "dp", "running_max_req_size", "chunked_prefill_size", "max_request_body_bytes",
                     "max_queued_requests", "cuda_graph_max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        if self.burst_chunked_prefill_size and self.burst_chunked_prefill_size < self.chunked_prefill_size:
            raise ValueError("--burst_chunked_prefill_size must be 0 (off) or at least --chunked_prefill_size")
        if self.admission_wait_steps < 0:
            raise ValueError("--admission_wait_steps must be 0 or more")
        for name in ("log_stats_interval", "health_timeout", "step_timeout", "grammar_compile_timeout"):
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
        if self.chat_template is not None:
            from lightllm.server.chat.template import chat_template_text  # jinja2: only when asked

            chat_template_text(self.chat_template)  # a missing file or a syntax error at start, not per request
        self._check_nodes()

    @property
    def origins(self) -> list[str]:
        """--allowed_origins as a list ([] when absent)."""
        return [origin.strip() for origin in (self.allowed_origins or "").split(",") if origin.strip()]

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"

    def _check_nodes(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("--node_rank must be at least 0 and below --nnodes (at least 1)")
        if self.tp % self.nnodes:
            raise ValueError(f"--tp {self.tp} must be divisible by --nnodes {self.nnodes}")
        if self.dp > 1 and self.nnodes > 1:
            raise ValueError("--dp > 1 runs replicas on one machine; over several, run one server per replica "
                             "(see docs/architecture.md)")
        if self.dist_timeout <= 0:
            raise ValueError("--dist_timeout must be positive")
        if not 0 <= self.worker_port < 65536:
            raise ValueError("--worker_port must be a port number (0: any)")
        if self.nnodes > 1:
            host, sep, port = (self.dist_init_addr or "").rpartition(":")
            if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError("--dist_init_addr HOST:PORT is required with --nnodes > 1")
            if self.node_token is None or len(self.node_token.strip()) < MIN_NODE_TOKEN_CHARS:
                raise ValueError(f"--node_token (or ${NODE_TOKEN_ENV}) of at least {MIN_NODE_TOKEN_CHARS} characters, the "
                                 "same on every node, is required with --nnodes > 1")


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
        if kind is bool:
            parser.add_argument(f"--{f.name}", action="store_true", help=f.metadata["help"])
        else:
            parser.add_argument(
                f"--{f.name}", type=kind, default=f.default, help=f.metadata["help"], choices=f.metadata.get("choices")
            )
    return parser


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """The flags, and the environment variables (read only here) for settings not given as flags."""
    parser = build_parser()
    config = ServerConfig(**vars(parser.parse_args(argv)))
    if config.api_key is None:  # read after parsing, so that --help never shows it
        config.api_key = os.environ.get(API_KEY_ENV) or None
    if config.node_token is None:
        config.node_token = os.environ.get(NODE_TOKEN_ENV) or None
    try:
        config.check()
    except ValueError as exc:
        parser.error(str(exc))
    return config
