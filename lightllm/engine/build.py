"""Building an engine: its model workers, the model they load, and the core that drives them.

The router process calls the three steps one by one (it watches the workers between them);
the offline `LLM` calls `start_engine`. Settings come from any object with the attributes of
`EngineSettings` (the server's `ServerConfig` is one): the engine never imports the server.
"""

from __future__ import annotations

import logging
from typing import Protocol

from lightllm.engine.core import EngineCore, WorkerDied, describe_error
from lightllm.engine.scheduler import Scheduler
from lightllm.engine.workers import ModelWorkers

logger = logging.getLogger(__name__)


# Steps of up to this many tokens a rank come from graphs: above it, an 8B model's step at tp 1
# takes longer on an H100 (about 40 ms at 2048 tokens) than its eager launch on the host (about
# 25 ms). Each rank computes 1/tp of a step, so its device time falls with tp while the launch
# stays: at tp 2, a burst's 3072-token steps (1024 decodes and a 2048-token chunk) left the GPUs
# 65-80% busy when eager, 92-100% from graphs (docs/multi_gpu.md).
GRAPH_TOKENS_A_RANK = 2048


def graph_max_tokens(tp: int, chunked_prefill_size: int, running_max_req_size: int) -> int:
    """The default --cuda_graph_max_tokens: GRAPH_TOKENS_A_RANK x tp, at most the largest step
    the scheduler can make (a full chunk beside a full batch of decodes)."""
    return min(GRAPH_TOKENS_A_RANK * tp, chunked_prefill_size + running_max_req_size)


class EngineStartError(RuntimeError):
    """The engine cannot start (wrong model directory, flags or memory; nodes that do not join):
    the message says why."""


class EngineSettings(Protocol):
    model_dir: str | None
    tp: int
    dp: int
    nnodes: int
    log_level: str
    max_total_token_num: int | None
    mem_fraction: float
    max_req_total_len: int
    running_max_req_size: int
    chunked_prefill_size: int
    burst_chunked_prefill_size: int | None  # the runner resolves it on its device (scheduler.burst_budget)
    schedule_policy: str
    admission_wait_steps: int
    disable_prefix_cache: bool
    disable_overlap: bool
    data_type: str
    load_format: str
    quantization: str | None
    kv_cache_dtype: str
    disable_cuda_graph: bool
    cuda_graph_max_tokens: int | None  # None: graph_max_tokens's rule
    step_trace: str | None
    tokenizer_mode: str
    trust_remote_code: bool
    nccl_port: int
    dist_init_addr: str | None


class InProcessWorker:
    """tp=1 without worker processes: a ModelRunner in this process (the offline API's)."""

    runner = None

    def load(self, **runner_kwargs) -> tuple[int, dict]:
        from lightllm.engine.model_runner import ModelRunner  # torch: only once a model is loaded

        self.runner = ModelRunner(**runner_kwargs)
        return self.runner.max_total_token_num, self.runner.info

    def shutdown(self) -> None:
        self.runner = None


def start_workers(config: EngineSettings, replica: int = 0) -> ModelWorkers:
    """One worker per rank here; with --nnodes, also those of the other nodes once they join."""
    if config.nnodes == 1:
        return ModelWorkers(config.tp, config.log_level, replica=replica, replicas=config.dp)
    from lightllm.utils.dist import JoinError, NodeLayout  # torch: only a multi-node router needs it

    try:
        return ModelWorkers(config.tp, config.log_level, NodeLayout.of(config))
    except JoinError as exc:
        raise EngineStartError(str(exc)) from exc


def load_model(workers, config: EngineSettings, replica: int = 0) -> tuple[int, dict]:
    """(max_total_token_num, model info) once every rank has loaded; EngineStartError says why not."""
    try:
        return workers.load(
            model_dir=config.model_dir,
            max_total_token_num=config.max_total_token_num,
            max_req_total_len=config.max_req_total_len,
            running_max_req_size=config.running_max_req_size,
            chunked_prefill_size=config.chunked_prefill_size,
            burst_chunked_prefill_size=config.burst_chunked_prefill_size,
            mem_fraction=config.mem_fraction,
            data_type=config.data_type,
            load_format=config.load_format,
            quantization=config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            cuda_graph=not config.disable_cuda_graph,
            cuda_graph_max_tokens=config.cuda_graph_max_tokens or graph_max_tokens(
                config.tp, config.chunked_prefill_size, config.running_max_req_size),
            step_trace=config.step_trace and (f"{config.step_trace}.replica{replica}" if replica else config.step_trace),
            world_size=config.tp,
            nccl_port=config.nccl_port + replica,  # each replica's ranks are a group of their own
            dist_init_addr=config.dist_init_addr if config.nnodes > 1 else None,
            tokenizer_mode=config.tokenizer_mode,
            trust_remote_code=config.trust_remote_code,
        )
    except WorkerDied:
        raise
    except Exception as exc:  # the model directory or the flags are wrong: say so, once
        logger.debug("model loading failed", exc_info=True)
        raise EngineStartError(f"cannot load the model from {config.model_dir}: {describe_error(exc)}") from exc


def build_engine(config: EngineSettings, workers, max_total_token_num: int, model_info: dict) -> EngineCore:
    scheduler = Scheduler(max_total_token_num, config.chunked_prefill_size, config.running_max_req_size,
                          config.schedule_policy, prefix_cache=not config.disable_prefix_cache,
                          admission_wait_steps=config.admission_wait_steps,
                          burst_chunk_budget=model_info.get("burst_chunked_prefill_size"))
    return EngineCore(scheduler, workers, model_info["eos_token_ids"], overlap=not config.disable_overlap,
                      vocab_size=model_info["vocab_size"])


def start_engine(config: EngineSettings) -> tuple[InProcessWorker | ModelWorkers, EngineCore, dict]:
    """(workers, EngineCore, model info): tp=1 in this process, otherwise tp worker processes."""
    workers = InProcessWorker() if config.tp == 1 else start_workers(config)
    try:
        max_total_token_num, info = load_model(workers, config)
    except BaseException:
        workers.shutdown()
        raise
    core = build_engine(config, workers.runner if config.tp == 1 else workers, max_total_token_num, info)
    return workers, core, info
