"""The KV budget is sized beside the largest step's measured peak (lightllm/engine/memory.py).

The tests set the memory limit through `memory_info`: a host of `rss + HEADROOM` bytes with
this process alone on it. The model is small but wide (32 KiB of KV a token) so that the limit,
not the CPU's default cap, bounds the budget; its 49,152-token vocabulary makes the largest
step's logits, logprobs and sampling buffers hundreds of MiB, more than the 10% that
--mem_fraction keeps back, so a budget sized without the step's peak breaks the limit."""

import gc
import subprocess
import sys

import pytest

from lightllm.engine import memory
from lightllm.engine.config import EngineConfig
from lightllm.engine.memory import PROFILE_SAMPLING_CPU, largest_step
from lightllm.engine.memory import CPU_DEFAULT_TOKENS
from lightllm.engine.model_runner import ModelRunner
from lightllm.tools.bench_model import write_bench_model
from lightllm.tools.default_model import update_json

HEADROOM = 768 << 20
TOKEN_BYTES = 2 * 8 * 8 * 64 * 4  # K and V, 8 layers, 8 KV heads of 64 dims, fp32
SETTINGS = dict(max_req_total_len=512, running_max_req_size=32, chunked_prefill_size=512, load_format="dummy",
                disable_cuda_graph=True)


def wide_runner(model_dir, **settings) -> ModelRunner:
    return ModelRunner(EngineConfig(model_dir=str(model_dir), **{**SETTINGS, **settings}), device="cpu")


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    path = write_bench_model(tmp_path_factory.mktemp("wide"), "tiny")
    update_json(path / "config.json", hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=8, head_dim=64)
    return str(path)


def limit_host(set_attribute) -> int:
    """A host of (this process's RSS now + HEADROOM) bytes; returns that total."""
    total = memory.psutil.Process().memory_info().rss + HEADROOM

    def memory_info(device):
        return total, total - memory.psutil.Process().memory_info().rss

    set_attribute(memory, "memory_info", memory_info)
    return total


def in_fresh_process(fn, *args) -> None:
    """Run fn(*args) in a fresh process, its assertions included: the peak RSS that the runner and
    the test read is then this runner's, never what earlier tests did in the pytest process
    (resetting the peak needs a writable /proc/self/clear_refs, not a given)."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(fn, *args).result()


def test_sized_budget_and_the_largest_step_fit_the_limit(wide_dir):
    in_fresh_process(sized_budget_and_the_largest_step_fit_the_limit, wide_dir)


def sized_budget_and_the_largest_step_fit_the_limit(wide_dir: str) -> None:
    limited_host = limit_host(setattr)
    memory._reset_peak_rss()
    runner = wide_runner(wide_dir)
    budget = runner.max_total_token_num
    assert 1000 < budget < CPU_DEFAULT_TOKENS, "the limit, not the CPU cap, must set the budget"
    assert runner.token_table.nbytes() >= budget * TOKEN_BYTES
    # The largest step again, now beside the whole KV cache; the peak over the runner's life
    # (profile, KV cache, this step) stays within --mem_fraction of the host.
    plans = largest_step(32, 512, 512, runner.config.vocab_size, PROFILE_SAMPLING_CPU)
    for plan in plans:
        runner.step(plan)
    runner.free(list(runner.reqs))
    assert runner.token_table.used_count == 0
    assert memory._peak_rss() <= 0.9 * limited_host, (
        f"peak RSS {memory._peak_rss() / 2**20:.0f} MiB over {0.9 * limited_host / 2**20:.0f} MiB")


def test_a_budget_that_does_not_fit_is_refused_with_the_largest_that_would(wide_dir):
    in_fresh_process(a_budget_that_does_not_fit_is_refused_with_the_largest_that_would, wide_dir)


def a_budget_that_does_not_fit_is_refused_with_the_largest_that_would(wide_dir: str) -> None:
    limit_host(setattr)
    too_many = HEADROOM // TOKEN_BYTES + 1  # more than the whole headroom could hold
    with pytest.raises(ValueError, match=f"--max_total_token_num {too_many} does not fit: at most") as error:
        wide_runner(wide_dir, max_total_token_num=too_many)
    fits = int(str(error.value).split("at most ")[1].split()[0])
    assert 1000 < fits < too_many
    assert "--mem_fraction 0.9" in str(error.value)
    del error  # its traceback holds the refused runner's weights
    gc.collect()
    runner = wide_runner(wide_dir, max_total_token_num=fits // 2)  # well inside: accepted as given
    assert runner.max_total_token_num == fits // 2


def test_largest_step_fills_the_rows_and_the_chunk_budget():
    setup, step = largest_step(max_running=64, chunk_budget=1024, max_prompt_len=300, vocab_size=100)
    assert len(setup.chunks) == 60 and all(len(c.token_ids) == 1 for c in setup.chunks)
    assert step.decodes == list(range(60))
    assert [len(c.token_ids) for c in step.chunks] == [256] * 4
    assert step.num_tokens == 60 + 1024
    (only,) = largest_step(max_running=2, chunk_budget=1024, max_prompt_len=300, vocab_size=100)
    assert [len(c.token_ids) for c in only.chunks] == [300, 300] and not only.decodes


def test_server_refuses_a_budget_that_does_not_fit(tmp_path):
    tiny = write_bench_model(tmp_path / "tiny", "tiny")
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(tiny), "--port", "0",
           "--max_total_token_num", str(10**12)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert f"--max_total_token_num {10**12} does not fit: at most " in result.stderr
    assert "tokens fit in" in result.stderr and "before it was ready" in result.stderr


@pytest.mark.parametrize("setting, budget", [(None, 256), (0, 256), (384, 384)])
def test_the_profile_step_prefills_the_burst_budget_the_device_takes(wide_dir, monkeypatch, setting, budget):
    """--burst_chunked_prefill_size reaches the runner as given; the runner resolves it on its
    device (absent: off on the CPU) and sizes its profile step by it."""
    sized = []

    def recording(max_running, chunk_budget, *args, **kwargs):
        sized.append(chunk_budget)
        return largest_step(max_running, chunk_budget, *args, **kwargs)

    monkeypatch.setattr(memory, "largest_step", recording)
    runner = wide_runner(wide_dir, chunked_prefill_size=256, burst_chunked_prefill_size=setting)
    assert runner.info["burst_chunked_prefill_size"] == budget
    assert sized == [budget]
