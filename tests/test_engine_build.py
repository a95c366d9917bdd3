"""Building an engine (lightllm/engine/build.py): the engine config reaches the model runner whole, the
tokenizer flags reach the structured-output tokenizer, and what the offline API cannot run is
refused."""

from __future__ import annotations

import pytest

from lightllm.engine import build, grammar
from lightllm.engine.build import EngineStartError, load_model
from lightllm.engine.config import GRAPH_TOKENS_A_RANK, EngineConfig
from lightllm.engine.scheduler import GPU_BURST_CHUNK_BUDGET, burst_budget
from lightllm.server.config import ServerConfig


class RecordingWorkers:
    def __init__(self, error: Exception | None = None):
        self.config, self._error = None, error

    def load(self, config):
        self.config = config
        if self._error is not None:
            raise self._error
        return 100, {"eos_token_ids": [0], "vocab_size": 10, "burst_chunked_prefill_size": None}


def test_the_workers_get_the_engine_config_whole_without_the_node_token():
    workers = RecordingWorkers()
    config = ServerConfig(model_dir="m", tokenizer_mode="slow", trust_remote_code=True, port=1234,
                          node_token="x" * 16, chunked_prefill_size=512)
    load_model(workers, config)
    assert type(workers.config) is EngineConfig
    assert workers.config == EngineConfig(model_dir="m", tokenizer_mode="slow", trust_remote_code=True,
                                          chunked_prefill_size=512)
    assert workers.config.node_token is None


def test_each_replica_has_its_own_rendezvous_port_and_trace():
    workers = RecordingWorkers()
    config = ServerConfig(model_dir="m", dp=2, nccl_port=3000, step_trace="t.jsonl")
    load_model(workers, config, replica=1)
    assert (workers.config.nccl_port, workers.config.step_trace) == (3001, "t.jsonl.replica1")
    load_model(workers, config, replica=0)
    assert (workers.config.nccl_port, workers.config.step_trace) == (3000, "t.jsonl")


@pytest.mark.parametrize("tp, chunk, running, given", [(1, 2048, 1024, None), (2, 2048, 1024, None),
                                                       (4, 2048, 1024, None), (2, 512, 64, None), (2, 2048, 1024, 777)])
def test_graphs_cover_per_rank_tokens_up_to_the_largest_step(tp, chunk, running, given):
    """Absent --cuda_graph_max_tokens, graphs reach GRAPH_TOKENS_A_RANK tokens a rank (a rank's share
    of a step is what its device time follows) but never past the largest step the scheduler makes;
    a given value is kept."""
    config = EngineConfig(model_dir="m", tp=tp, chunked_prefill_size=chunk, running_max_req_size=running,
                          cuda_graph_max_tokens=given)
    limit = config.graph_max_tokens
    if given is not None:
        assert limit == given
    else:
        assert limit <= chunk + running and limit / tp <= GRAPH_TOKENS_A_RANK
        assert limit == chunk + running or limit / tp == GRAPH_TOKENS_A_RANK


def test_structured_output_loads_the_tokenizer_with_the_flags(monkeypatch):
    seen = []

    def fake_load_tokenizer(model_dir, tokenizer_mode, trust_remote_code):
        seen.append((model_dir, tokenizer_mode, trust_remote_code))
        raise LookupError("stop here")

    monkeypatch.setattr("lightllm.engine.tokenizer.load_tokenizer", fake_load_tokenizer)
    grammars = grammar.Grammars("m", 10, tokenizer_mode="slow", trust_remote_code=True)
    with pytest.raises(LookupError):
        grammars.compiler
    assert seen == [("m", "slow", True)]


def test_a_model_that_cannot_load_is_an_engine_start_error_naming_the_directory():
    workers = RecordingWorkers(OSError("no config.json"))
    with pytest.raises(EngineStartError, match="cannot load the model from nowhere: OSError: no config.json"):
        load_model(workers, ServerConfig(model_dir="nowhere"))


def test_build_engine_takes_the_scheduler_settings():
    config = ServerConfig(model_dir="m", chunked_prefill_size=64, running_max_req_size=7, schedule_policy="fcfs")
    info = {"eos_token_ids": [2], "vocab_size": 10, "burst_chunked_prefill_size": None}
    core = build.build_engine(config, RecordingWorkers(), 1000, info)
    scheduler = core.scheduler
    assert (scheduler.max_total_token_num, scheduler.chunk_budget, scheduler.max_running) == (1000, 64, 7)
    assert scheduler.policy == "fcfs"
    assert scheduler.burst_chunk_budget == 64  # the runner's info names none: off
    info = {"eos_token_ids": [2], "vocab_size": 10, "burst_chunked_prefill_size": 256}
    assert build.build_engine(config, RecordingWorkers(), 1000, info).scheduler.burst_chunk_budget == 256


@pytest.mark.parametrize("setting", [None, 0, 1536])
def test_the_burst_setting_reaches_the_runner_as_given(setting):
    """The runner resolves it on its device (scheduler.burst_budget), the router takes its answer."""
    workers = RecordingWorkers()
    load_model(workers, ServerConfig(model_dir="m", chunked_prefill_size=512, burst_chunked_prefill_size=setting))
    assert (workers.config.chunked_prefill_size, workers.config.burst_chunked_prefill_size) == (512, setting)


@pytest.mark.parametrize("setting, device, budget", [
    (None, "cuda", GPU_BURST_CHUNK_BUDGET), (None, "cpu", 512), (0, "cuda", 512), (0, "cpu", 512),
    (1536, "cpu", 1536), (1536, "cuda", 1536)])
def test_burst_budget_by_device(setting, device, budget):
    assert burst_budget(setting, 512, device) == budget
    assert burst_budget(setting, 16384, device) == 16384  # never below the chunk budget


@pytest.mark.parametrize("setting", [{"dp": 2}, {"nnodes": 2}])
def test_llm_refuses_more_than_one_engine(setting, tmp_path):
    from lightllm.llm import engine_config

    with pytest.raises(ValueError, match=f"{next(iter(setting))} must be 1"):
        engine_config(tmp_path, **setting)
