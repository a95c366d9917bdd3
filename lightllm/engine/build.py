"""Building an engine: its model workers, the model they load, and the core that drives them.

The router process calls the three steps one by one (it watches the workers between them);
the offline `LLM` calls `start_engine`. Each takes the EngineConfig whole (the server's and the
frontend's configs extend it): the engine never imports the server.
"""

from __future__ import annotations

import dataclasses
import logging

from lightllm.engine.config import EngineConfig
from lightllm.engine.core import EngineCore, HostTrace, WorkerDied, describe_error
from lightllm.engine.scheduler import Scheduler
from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.engine.spec.controller import Speculator
from lightllm.engine.workers import ModelWorkers

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine cannot start (wrong model directory, flags or memory; nodes that do not join):
    the message says why."""


class InProcessWorker:
    """tp=1 without worker processes: a ModelRunner in this process (the offline API's)."""

    runner = None

    def load(self, config: EngineConfig) -> tuple[int, dict]:
        from lightllm.engine.model_runner import ModelRunner  # torch: only once a model is loaded

        self.runner = ModelRunner(config)
        return self.runner.max_total_token_num, self.runner.info

    def shutdown(self) -> None:
        self.runner = None


def start_workers(config: EngineConfig, replica: int = 0) -> ModelWorkers:
    """One worker per rank here; with --nnodes, also those of the other nodes once they join."""
    if config.nnodes == 1:
        return ModelWorkers(config.tp, config.log_level, replica=replica, replicas=config.dp)
    from lightllm.utils.dist import JoinError, NodeLayout  # torch: only a multi-node router needs it

    try:
        return ModelWorkers(config.tp, config.log_level, NodeLayout.of(config))
    except JoinError as exc:
        raise EngineStartError(str(exc)) from exc


def load_model(workers, config: EngineConfig, replica: int = 0) -> tuple[int, dict]:
    """(max_total_token_num, model info) once every rank has loaded; EngineStartError says why not."""
    try:
        return workers.load(config.engine_only().for_replica(replica))
    except WorkerDied:
        raise
    except Exception as exc:  # the model directory or the flags are wrong: say so, once
        logger.debug("model loading failed", exc_info=True)
        raise EngineStartError(f"cannot load the model from {config.model_dir}: {describe_error(exc)}") from exc


def build_engine(config: EngineConfig, workers, max_total_token_num: int, model_info: dict) -> EngineCore:
    hybrid = bool(model_info.get("recurrent_state"))
    speculative = SpeculativeConfig.parse(config.speculative_config)
    if hybrid and speculative is not None and speculative.method == "draft_model":
        logger.warning("speculative decoding off: a draft model is not run beside a model with recurrent state")
        config, speculative = dataclasses.replace(config, speculative_config=None), None
    snapshots = model_info.get("state_snapshot_slots", 0)
    if hybrid and not config.disable_prefix_cache and not snapshots:
        logger.warning("prefix cache off: no slot for a snapshot of the model's recurrent state "
                       "(--state_snapshot_slots)")
        config = dataclasses.replace(config, disable_prefix_cache=True)
    running = model_info.get("running_max_req_size", config.running_max_req_size)  # fewer: the states that fit
    speculator = None if speculative is None else Speculator(speculative, model_info["vocab_size"], running,
                                                             drafter=getattr(workers, "draft", None),
                                                             catch_up_tokens=model_info["burst_chunked_prefill_size"])
    scheduler = Scheduler(max_total_token_num, config.chunked_prefill_size, running,
                          config.schedule_policy, prefix_cache=not config.disable_prefix_cache,
                          admission_wait_steps=config.admission_wait_steps,
                          burst_chunk_budget=model_info["burst_chunked_prefill_size"], speculator=speculator,
                          host_cache_tokens=model_info.get("host_kv_cache_tokens", 0),
                          disk_cache_tokens=model_info.get("disk_kv_cache_tokens", 0),
                          max_loras=config.lora_slots, lora_ids=tuple(range(1, len(config.lora_modules) + 1)),
                          snapshot_interval=config.state_snapshot_interval if hybrid else 0, snapshot_slots=snapshots)
    return EngineCore(scheduler, workers, model_info["eos_token_ids"], overlap=not config.disable_overlap,
                      vocab_size=model_info["vocab_size"],
                      host_trace=HostTrace(f"{config.step_trace}.host") if config.step_trace else None)


def start_engine(config: EngineConfig) -> tuple[InProcessWorker | ModelWorkers, EngineCore, dict]:
    """(workers, EngineCore, model info): tp=1 in this process, otherwise tp worker processes."""
    workers = InProcessWorker() if config.tp == 1 else start_workers(config)
    try:
        max_total_token_num, info = load_model(workers, config)
    except BaseException:
        workers.shutdown()
        raise
    core = build_engine(config, workers.runner if config.tp == 1 else workers, max_total_token_num, info)
    return workers, core, info
