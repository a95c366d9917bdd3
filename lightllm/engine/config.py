"""EngineConfig: every engine setting, once, handed whole to the builder, the workers and the runner.

The configs are layered: the frontend's (lightllm/frontend/config.py) adds request preparation
and the server's (lightllm/server/config.py) the HTTP and process settings. The server's argparse
reads each field's name, default and help (`flag`) from the dataclasses, so a new engine knob is
written once, here, and read where it is used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

NODE_TOKEN_ENV = "LIGHTLLM_NODE_TOKEN"
MIN_NODE_TOKEN_CHARS = 16

# Steps of up to this many tokens a rank come from graphs: above it, an 8B model's step at tp 1
# takes longer on an H100 (about 40 ms at 2048 tokens) than its eager launch on the host (about
# 25 ms). Each rank computes 1/tp of a step, so its device time falls with tp while the launch
# stays: at tp 2, a burst's 3072-token steps (1024 decodes and a 2048-token chunk) left the GPUs
# 65-80% busy when eager, 92-100% from graphs (two H100s, 2026-11-27, 69e7f75; docs/multi_gpu.md).
# A model of many small kernels is launch-bound past that even at tp 1: gpt-oss-20b's eager 2304-token
# step launched in 33.8 ms for 32.8 of device time, and graphs up to 3072 tokens (a full chunk beside
# a full batch) took its 1000-request burst from 49.53 to 55.18 req/s, bench-8b's from 43.98 to 44.15
# (one H200, 2026-12-04, 00cc996; docs/benchmarks.md).
GRAPH_TOKENS_A_RANK = 3072
DEFAULT_MAX_LORAS = 4
# --running_max_req_size when absent (see its help)
GPU_RUNNING = 1024
CPU_RUNNING = 128


def flag(help_text: str, **extra) -> dict:
    """A field's metadata as a command-line flag: its help text and argparse extras (choices)."""
    return {"help": help_text, **extra}


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str | None = field(
        default=None,
        metadata=flag("Hugging Face model directory; absent: the default model (SmolLM2-135M-Instruct), prepared on first use"),
    )
    tokenizer_mode: str = field(
        default="auto",
        metadata=flag("auto: fast tokenizer when there is one; slow: the Python tokenizer", choices=("auto", "slow")),
    )
    trust_remote_code: bool = field(default=False, metadata=flag("allow the tokenizer to run code from the model directory"))
    max_total_token_num: int | None = field(
        default=None,
        metadata=flag("KV-cache budget in tokens over all requests; absent: what fits in --mem_fraction of the memory beside the largest step, which every rank runs once at start (on the CPU at most 16384). A figure that does not fit is refused at start with the largest that would"),
    )
    mem_fraction: float = field(
        default=0.9,
        metadata=flag("share of the device's memory (GPU) or of the host's RAM (CPU, less what other processes use) the server may take: weights, the KV cache, CUDA graphs and the largest step's activations, logits and sampling buffers, measured at start"),
    )
    chunked_prefill_size: int = field(
        default=2048,
        metadata=flag("most prompt tokens prefilled in one step, over all requests; longer prompts are prefilled in chunks over several steps, beside the running decodes. 2048 bounds a step beside a full batch to ~60 ms on an H100 with an 8B model, which keeps the tail of time to first token and per token low at moderate load (docs/benchmarks.md)"),
    )
    burst_chunked_prefill_size: int | None = field(
        default=None,
        metadata=flag("most prompt tokens prefilled in one step while a burst waits (more than 2 steps' worth of --chunked_prefill_size not yet prefilled, admitted or waiting): fewer, larger steps each pay the running batch's decode once, so a burst's last requests get their first token sooner, at a longer step for the running ones meanwhile; at a steady moderate rate the backlog stays below and steps keep --chunked_prefill_size. Absent: 8192 on a GPU (H100, 8B model, ShareGPT 1000 at once: P99 time to first token 9.5 -> 7.0 s, throughput 1.035x, P99 time per token 79 -> 234 ms; docs/benchmarks.md), off on a CPU; 0: off. The start-up's memory profile runs a step of this many prompt tokens"),
    )
    schedule_policy: str = field(
        default="lpt",
        metadata=flag("order in which waiting requests are admitted: lpt = longest max_new_tokens first (requests waiting 256 steps go first, in arrival order), fcfs = arrival order, priority = each request's `priority` (vLLM's field; lower first, then arrival order), and a waiting request that cannot be admitted preempts running ones of a higher value (their outputs so far become the end of their prompt when they start again, from the prefix cache where it still holds them); lpt was chosen in simulation (test/benchmark/simulator/sim_serving.py, see docs/architecture.md)", choices=("lpt", "fcfs", "priority")),
    )
    disable_overlap: bool = field(
        default=False,
        metadata=flag("plan each step only after the previous one's tokens are back (a synchronous loop, for debugging); by default the next step is planned while the device runs the current one"),
    )
    disable_prefix_cache: bool = field(
        default=False,
        metadata=flag("recompute every prompt; by default the KV of prompt prefixes already computed (shared system prompts, earlier chat turns) is kept in a radix tree and reused, evicted least recently used first when room is needed"),
    )
    state_snapshot_interval: int = field(
        default=2048,
        metadata=flag("models with recurrent state (Qwen3-Next, Qwen3.5): the prefix cache keeps a snapshot of every linear-attention layer's state every this many prompt tokens, and a prompt resumes from the deepest snapshot inside its cached prefix; such a model's prompt chunks end at these boundaries (a request's chunk never crosses one). The default, --chunked_prefill_size's, takes a snapshot at every full chunk of a lone request without cutting any; a shared prefix that ends between two (a 2000-token system prompt) also gets one at its end, where requests sharing it are seen to part (docs/architecture.md)"),
    )
    state_snapshot_slots: int = field(
        default=64,
        metadata=flag("models with recurrent state: snapshots the prefix cache can hold, allocated at start beside the states of the running requests and counted as used before the KV budget is measured (at most half of the memory left then); one is a request's whole state (146.8 MiB for qwen3.5-27b in bf16 at tp 1); the least recently used one no running request needs makes room. 0: the prefix cache is off for such a model"),
    )
    mamba_ssm_cache_dtype: str = field(
        default="auto",
        metadata=flag("models with recurrent state: the dtype of the linear-attention layers' recurrent states in their pool. auto: the checkpoint's mamba_ssm_dtype where its config names one, else float32 (as the delta rule accumulates them); bfloat16 halves a request's state (qwen3.5-27b: 146.8 to 74.8 MiB), so about twice the requests run at once and a decode step moves half the state bytes, at the cost of rounding each state once a step (vLLM's default where the checkpoint names no dtype)", choices=("auto", "float32", "bfloat16", "float16")),
    )
    mamba_full_memory_ratio: float = field(
        default=1.0,
        metadata=flag("models with recurrent state: the memory left after loading is split between the running requests' states (one slot each, a hard cap on how many run at once) and the rest (state snapshots, then the KV cache), this many to one (SGLang's flag of the name). The default, 1, gives them half; where requests are short the KV cache is left partly unused while the state slots cap the batch (qwen3.5-27b, ShareGPT at once, bf16 states: 525 rows, at most 201,580 of 486,099 KV tokens in use, docs/benchmarks.md), and a larger ratio runs more at once: about a slot's bytes over a request's KV bytes (qwen3.5-27b: 74.8 MiB over 64 KiB a token, about 1,200 tokens) divided by its tokens (prompt and output)"),
    )
    host_kv_cache_gb: float = field(
        default=0.0,
        metadata=flag("GiB of host memory, per rank (each keeps its own shard of K and V), for a second tier of the prefix cache: KV evicted from the device is copied there (pinned, on a copy stream) instead of dropped, and loaded back when a later prompt matches it, least recently used dropped first. Off (0) by default: pinned memory is taken at start for the life of the process on every rank of every replica, and only the operator knows what else the host must hold; about 128 KiB a token for an 8B model in bf16, so 64 GiB holds 0.5M tokens (with an EAGLE-3 head or MTP layer, each token's feature too: hidden size x dtype bytes more)"),
    )
    disk_kv_cache_dir: str | None = field(
        default=None,
        metadata=flag("directory for a third tier of the prefix cache, below --host_kv_cache_gb (required): KV leaving the host tier is written to a file there (one a rank, removed at start so that it goes with the process) instead of dropped, and loaded back from it; --disk_kv_cache_gb bounds it"),
    )
    disk_kv_cache_gb: float = field(default=16.0, metadata=flag("GiB of --disk_kv_cache_dir each rank takes"))
    admission_wait_steps: int = field(
        default=8,
        metadata=flag("while the running batch is nearly full (fewer free slots than running_max_req_size / 16, and than requests waiting), admit waiting requests at most once in this many steps: slots freed one by one are then filled by one prefill step instead of one each, and every such step runs eagerly (no CUDA graph) and slows the whole batch; 0 admits at every step (see docs/benchmarks.md)"),
    )
    running_max_req_size: int | None = field(default=None, metadata=flag(f"most requests in the running batch (and the largest CUDA-graph decode bucket). Absent: {GPU_RUNNING} on a GPU, where it starts a burst's requests sooner (lower time to first token) at a few percent of throughput against 512 (docs/benchmarks.md); {CPU_RUNNING} on a CPU, where a larger batch gains nothing and the start-up's profile of the largest step grows with it"))
    max_req_total_len: int = field(default=2048 + 1024, metadata=flag("longest prompt + max_new_tokens accepted"))
    tp: int = field(default=1, metadata=flag("tensor-parallel degree: one model worker process per rank"))
    dp: int = field(default=1, metadata=flag("data-parallel replicas on this machine behind the one HTTP endpoint: each is an engine (router process and --tp workers; replica d uses GPUs d*tp to d*tp+tp-1); --dp_routing picks the replica of each request"))
    nccl_port: int = field(default=28765, metadata=flag("port of the torch.distributed rendezvous between model workers on one machine (over several: --dist_init_addr)"))
    nnodes: int = field(default=1, metadata=flag("machines the --tp ranks span, tp / nnodes on each (see docs/architecture.md, 'Scaling past one machine')"))
    node_rank: int = field(default=0, metadata=flag("this machine's index: 0 serves HTTP and drives every rank; the others run only their ranks' model workers"))
    dist_init_addr: str | None = field(default=None, metadata=flag("HOST:PORT where node 0's router hosts the rendezvous of the nodes (a torch.distributed TCPStore); required with --nnodes > 1"))
    dist_timeout: float = field(default=300.0, metadata=flag("seconds node 0 waits for the other nodes to join, and they for node 0 to answer; then start-up ends with an error"))
    worker_host: str | None = field(default=None, metadata=flag("nodes > 0: address their model workers listen on for node 0's router; absent: this machine's address on the route to --dist_init_addr"))
    worker_port: int = field(default=0, metadata=flag("nodes > 0: port of the first local rank's model worker (the next rank PORT+1, ...); 0: any free port, published through the rendezvous"))
    node_token: str | None = field(
        default=None,
        repr=False,  # never in a log line
        metadata=flag(f"with --nnodes > 1, required and the same on every node (at least {MIN_NODE_TOKEN_CHARS} characters, e.g. `openssl rand -hex 16`): node 0's router must present it to the other nodes' model workers; it never crosses the rendezvous. Absent: ${NODE_TOKEN_ENV}, which keeps it out of the process list"),
    )
    data_type: str = field(default="auto", metadata=flag("weight and activation dtype: auto, float16, bfloat16 or float32"))
    quantization: str | None = field(
        default=None,
        metadata=flag("fp8: store the four projections of every layer in fp8 (e4m3, one scale per output row, quantised at load) and quantise their inputs per token: half the weight bytes a decode step reads and fp8 tensor cores for prefill (Hopper/Ada GPUs: compute capability 8.9 or above; the CPU runs the torch reference). The embedding, the LM head, norms and the KV cache stay in --data_type. See docs/benchmarks.md for throughput and accuracy", choices=("fp8",)),
    )
    mxfp4_experts: str = field(
        default="auto",
        metadata=flag("MXFP4 checkpoints (gpt-oss): auto widens the experts at load (dequantized below) on a GPU where they then take at most half of the memory --mem_fraction gives the server (gpt-oss-20b on an H200, or in fp8 on an H100), else keeps them packed (gpt-oss-120b on one GPU; the CPU); packed keeps the experts as the checkpoint holds them, half a byte a weight, widened inside the fused MoE kernel (gpt-oss-120b fits one H200 so); dequantized widens them at load to --data_type (four times the memory: gpt-oss-20b's experts take about 38 GB in bf16), or with --quantization fp8 to fp8 holding the same values (power-of-two row scales), and runs the dense fused MoE kernels: faster where it fits (gpt-oss-20b, 1000 requests at once, one H200, 2026-12-04, 2901a43: 41.7 req/s in bf16, 51.8 in fp8, against 26.9 packed; docs/benchmarks.md)", choices=("auto", "packed", "dequantized")),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag("auto: the KV cache in --data_type; fp8_e4m3: one byte a value (K and V rounded to e4m3, no scale: values past +-448 saturate), so twice the tokens in the same memory and half the bytes decode attention reads (Hopper/Ada GPUs: compute capability 8.9 or above; the CPU runs the torch reference)", choices=("auto", "fp8_e4m3")),
    )
    load_format: str = field(default="auto", metadata=flag("auto: the checkpoint's weight files (safetensors or pytorch_model*.bin); dummy: random weights from config.json alone; dummy_echo: the same, made to answer each token with itself whatever the kernels' rounding (for benchmarks that replay an earlier run's output as drafts)", choices=("auto", "dummy", "dummy_echo")))
    disable_cuda_graph: bool = field(default=False, metadata=flag("run every step eagerly instead of replaying captured CUDA graphs (GPU only)"))
    cuda_graph_max_tokens: int | None = field(default=None, metadata=flag(f"largest step, in tokens (decodes plus prompt chunks), replayed from a CUDA graph; larger steps run eagerly, their device time then covers their launch (see docs/architecture.md). Absent: {GRAPH_TOKENS_A_RANK} x --tp (a step's device time shrinks with the ranks, its launch on the host does not), at most the largest step there can be (--chunked_prefill_size + --running_max_req_size)"))
    speculative_config: str | None = field(
        default=None,
        metadata=flag('speculative decoding, as a JSON object in vLLM\'s shape: {"method": "ngram" (prompt lookup), "suffix" (frequent continuations of this and earlier requests) or "draft_model" (with "model": DIR, a smaller model of the same tokenizer, run by every worker), "eagle3" (with "model": DIR, an EAGLE-3 head of a Llama-family target), "mtp" (the MTP layer of a Qwen3-Next or Qwen3.5 checkpoint), "num_speculative_tokens": K (most drafts a request gets a step, 1-16)}; "prompt_lookup_min"/"prompt_lookup_max" tune ngram. Each step a controller gives each request 0..K drafts from its measured acceptance and the measured cost of the step, so speculation runs only where it pays (see docs/architecture.md); greedy output is unchanged, sampling keeps its distribution. Absent: off'),
    )
    lora_modules: tuple[str, ...] = field(
        default=(),
        metadata=flag("LoRA adapters served from the start, as NAME=DIR ... (PEFT's adapter_config.json and adapter_model.safetensors, on the q, k, v, o, gate, up and down projections; not yet on experts): a request picks one by NAME in the OpenAI and Anthropic routes' `model`, /generate's `adapter_id` or LLM.generate's lora_request; more are loaded at run time through /v1/load_lora_adapter", nargs="+"),
    )
    max_loras: int | None = field(default=None, metadata=flag(f"LoRA adapters resident on the device at once: a slot pool allocated at start, the adapters beyond it wait in host memory and replace the least recently used slot that no running request uses. Absent: {DEFAULT_MAX_LORAS} with --lora_modules, else 0 (no adapters, none loadable at run time)"))
    max_lora_rank: int = field(default=16, metadata=flag("largest LoRA rank served (each slot's size); an adapter of a larger rank is refused"))
    watermark_gamma: float = field(default=0.5, metadata=flag("share of the vocabulary that is green after each token for requests with TGI's `watermark` (lightllm/engine/watermark.py; TGI's WATERMARK_GAMMA)"))
    watermark_delta: float = field(default=2.0, metadata=flag("what a watermarked request's green tokens get added to their logits (TGI's WATERMARK_DELTA)"))
    step_trace: str | None = field(default=None, metadata=flag("write the device's per-step timeline (start, end, launch time and shape of every step) to this JSON-lines file, to find where the device idles; summarise it with test/benchmark/engine/step_trace.py"))
    log_level: str = field(
        default="info",
        metadata=flag("log level of every process", choices=("debug", "info", "warning", "error")),
    )

    def __post_init__(self):
        if self.running_max_req_size is None:  # resolved once, so every process and rank reads the same
            import torch

            object.__setattr__(self, "running_max_req_size", GPU_RUNNING if torch.cuda.is_available() else CPU_RUNNING)

    @property
    def graph_max_tokens(self) -> int:
        """--cuda_graph_max_tokens, or by default GRAPH_TOKENS_A_RANK x tp, at most the largest
        step the scheduler can make (a full chunk beside a full batch of decodes)."""
        if self.cuda_graph_max_tokens is not None:
            return self.cuda_graph_max_tokens
        return min(GRAPH_TOKENS_A_RANK * self.tp, self.chunked_prefill_size + self.running_max_req_size)

    @property
    def lora_slots(self) -> int:
        """--max_loras, or by default DEFAULT_MAX_LORAS where adapters are served from the start."""
        if self.max_loras is not None:
            return self.max_loras
        return DEFAULT_MAX_LORAS if self.lora_modules else 0

    @property
    def lora_adapters(self) -> list[tuple[str, str]]:
        """--lora_modules as (name, directory); adapter i of them has id i + 1."""
        return [tuple(item.split("=", 1)) for item in self.lora_modules]

    def for_replica(self, replica: int) -> EngineConfig:
        """The settings one --dp replica's ranks run with: a rendezvous port and a trace of its own."""
        if replica == 0:
            return self
        trace = self.step_trace and f"{self.step_trace}.replica{replica}"
        return dataclasses.replace(self, nccl_port=self.nccl_port + replica, step_trace=trace)

    def engine_only(self) -> EngineConfig:
        """This config's engine settings as an EngineConfig (what crosses to the model workers),
        without the node token: the workers never need it."""
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        values = {name: getattr(self, name) for name in names}
        return EngineConfig(**{**values, "node_token": None})

    def check(self) -> None:
        """Raise ValueError, naming the flag, for settings that cannot work together."""
        for f in dataclasses.fields(self):  # argparse checks a flag's choices; LLM(...) settings come here
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices is not None and value not in choices and not (value is None and f.default is None):
                raise ValueError(f"--{f.name} must be one of {', '.join(map(str, choices))}, not {value!r}")
        if self.max_req_total_len < 2:
            raise ValueError("--max_req_total_len must be at least 2")
        if self.max_total_token_num is not None and self.max_total_token_num < 2:
            raise ValueError("--max_total_token_num must be at least 2")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError("--mem_fraction must be above 0 and at most 1")
        for name in ("tp", "dp", "running_max_req_size", "chunked_prefill_size", "cuda_graph_max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        from lightllm.engine.spec.config import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)
        if self.burst_chunked_prefill_size and self.burst_chunked_prefill_size < self.chunked_prefill_size:
            raise ValueError("--burst_chunked_prefill_size must be 0 (off) or at least --chunked_prefill_size")
        if self.state_snapshot_interval < 1 or self.state_snapshot_slots < 0:
            raise ValueError("--state_snapshot_interval must be at least 1 and --state_snapshot_slots at least 0")
        if not self.mamba_full_memory_ratio > 0:
            raise ValueError("--mamba_full_memory_ratio must be above 0")
        if self.host_kv_cache_gb < 0:
            raise ValueError("--host_kv_cache_gb must be 0 (off) or more")
        if self.disk_kv_cache_dir and (self.host_kv_cache_gb <= 0 or self.disk_kv_cache_gb <= 0):
            raise ValueError("--disk_kv_cache_dir needs --host_kv_cache_gb above 0 (the disk tier lies below "
                             "the host tier) and --disk_kv_cache_gb above 0")
        if not 0 < self.watermark_gamma < 1 or not 0 <= self.watermark_delta <= 100:
            raise ValueError("--watermark_gamma must be above 0 and below 1, --watermark_delta in [0, 100]")
        if self.admission_wait_steps < 0:
            raise ValueError("--admission_wait_steps must be 0 or more")
        self._check_loras()
        self._check_nodes()

    def _check_loras(self) -> None:
        names = [item.partition("=")[0] for item in self.lora_modules]
        if any(not name or not path for name, _, path in (item.partition("=") for item in self.lora_modules)):
            raise ValueError("--lora_modules takes NAME=DIR items")
        if len(set(names)) != len(names):
            raise ValueError("--lora_modules names an adapter twice")
        if self.lora_slots < 0 or self.max_lora_rank < 1:
            raise ValueError("--max_loras must be 0 or more, --max_lora_rank at least 1")
        if self.lora_modules and not self.lora_slots:
            raise ValueError("--lora_modules needs --max_loras of at least 1")
        if self.lora_slots and self.quantization == "fp8":
            raise ValueError("LoRA adapters are not served with --quantization fp8 yet")

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
