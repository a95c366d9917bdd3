"""The step trace (`--step_trace`): one line per launched step with its shape and device times,
and the summary script's accounting of busy and idle time."""

import gc
import inspect
import json
import time

import pytest

from lightllm.engine.config import EngineConfig
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.plan import StepPlan
from benchmark.lib.direct_step import run_step
from lightllm.engine.request import SamplingParams

from benchmark.engine import step_trace


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from lightllm.tools.bench_model import write_bench_model

    return write_bench_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


def test_runner_writes_one_line_per_step(tiny_model, tmp_path):
    path = tmp_path / "trace.jsonl"
    before = time.time()
    config = EngineConfig(model_dir=str(tiny_model), max_total_token_num=2048, max_req_total_len=256,
                          running_max_req_size=4, data_type="float32", step_trace=str(path), cuda_graph_max_tokens=16)
    runner = ModelRunner(config, device="cpu", check_budget=False)
    params = SamplingParams(max_new_tokens=64)
    sent = [(0, 7, 1)]  # (decodes, chunk tokens, chunks) of each step, in order
    run_step(runner, prompts=[(1, list(range(1, 8)), params)])
    for _ in range(3):
        run_step(runner, [1])
        sent.append((1, 0, 0))
    forward = runner.model.forward

    def collecting(*args, **kwargs):  # a full collection inside this step's launch
        gc.collect()
        return forward(*args, **kwargs)

    runner.model.forward = collecting
    run_step(runner, [1], prompts=[(2, list(range(1, 21)), params), (3, [5, 6, 7], params)])
    sent.append((1, 23, 2))
    assert path.read_text() == ""  # fewer steps than a batch of lines
    runner.step(StepPlan(-100, sync=True))  # the engine idles: every step so far is written
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    runner._trace.close()
    assert [(s["decodes"], s["chunk_tokens"], s["chunks"]) for s in lines] == sent
    # the wall-clock moment of the trace's 0 ms, once, at the top: the first step starts after it
    assert [i for i, s in enumerate(lines) if "origin_unix_s" in s] == [0]
    assert before <= lines[0]["origin_unix_s"] <= lines[0]["origin_unix_s"] + lines[0]["start_ms"] / 1000 <= time.time()
    # the KV tokens each step's attention reads: request 1 has 7 + k tokens at its k-th decode;
    # the last step's chunks hold 20 and 3 tokens, and its decode the 5th token of request 1
    assert [(s["decode_context"], s["chunk_context"]) for s in lines] == [(0, 7), (8, 0), (9, 0), (10, 0), (11, 23)]
    # every step fits a graph bucket (padded, run eagerly on the CPU) but the last, of 24 tokens > 16
    assert [s["graph"] for s in lines] == [decodes + tokens <= 16 for decodes, tokens, _ in sent]
    for s in lines:
        assert 0 <= s["start_ms"] <= s["end_ms"] and s["launch_ms"] >= 0
        assert 0 <= s["gc_ms"] <= s["launch_ms"] and s["launch_cpu_ms"] >= 0
        assert s["new_kernels"] == 0 and s["new_kernel_ms"] == 0  # CPU tensors never take the fast path
        # on the CPU the device thread's clock brackets the launch, on the host's clock
        assert s["start_ms"] <= s["launched_ms"] <= s["end_ms"]
    for before, after in zip(lines, lines[1:]):
        assert before["end_ms"] <= after["start_ms"]  # the CPU device thread runs steps one at a time
    assert lines[-1]["gc_ms"] > 0  # the collection forced inside the last launch
    assert gc.callbacks.count(runner._trace._on_gc) == 0  # closing the trace unhooks it


def test_a_step_says_whether_it_was_sync_and_what_was_collected_before_it(tiny_model, tmp_path):
    """`sync`: the engine waited for the step's result before the next plan; `collected`: the
    empty sync plans (collections of the step in flight) run since the step before."""
    from lightllm.engine.plan import StepPlan

    path = tmp_path / "trace.jsonl"
    config = EngineConfig(model_dir=str(tiny_model), max_total_token_num=2048, max_req_total_len=256,
                          running_max_req_size=4, data_type="float32", step_trace=str(path))
    runner = ModelRunner(config, device="cpu", check_budget=False)
    run_step(runner, prompts=[(1, list(range(1, 8)), SamplingParams(max_new_tokens=64))])  # sync
    runner.step(StepPlan(900, [1], sync=False))  # overlapped: stays in flight
    assert runner.step(StepPlan(-1, sync=True))  # the engine collects it: one result
    runner.step(StepPlan(901, [1], sync=False))
    runner.step(StepPlan(-1, sync=True))
    runner._trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(s.get("sync", False), s.get("collected", 0)) for s in lines] == [(True, 0), (False, 0), (False, 1)]
    # the host's turnaround: the runner was handed each plan before it launched it, and handed each
    # result back once the device had the step done (the sync one in the same call, the others when
    # the engine collected them), before it was handed the next plan
    for s, after in zip(lines, lines[1:] + [None]):
        assert s["received_ms"] <= s["launched_ms"] - s["launch_ms"] + 1e-3 and s["end_ms"] <= s["returned_ms"]
        assert s["launched_ms"] - s["launch_ms"] <= s["forwarded_ms"] <= s["launched_ms"]
        assert after is None or s["returned_ms"] <= after["received_ms"]


def test_a_step_names_the_triton_kernels_it_met_first(tmp_path, monkeypatch):
    """A step in which kernels/_triton.py's fast launch met new specialisations records their
    count, time and kernels; the next step, which met none, records no names."""
    import torch

    from lightllm.engine.step_trace import StepTrace
    from lightllm.kernels._triton import NEW_SPECIALISATIONS

    monkeypatch.setitem(NEW_SPECIALISATIONS, "kernels", ["_older_kernel"])
    trace = StepTrace(str(tmp_path / "trace.jsonl"), torch.device("cpu"))
    record = trace.begin()
    monkeypatch.setitem(NEW_SPECIALISATIONS, "launches", NEW_SPECIALISATIONS["launches"] + 2)
    monkeypatch.setitem(NEW_SPECIALISATIONS, "ms", NEW_SPECIALISATIONS["ms"] + 300.0)
    NEW_SPECIALISATIONS["kernels"] += ["_extend_kernel", "_rms_norm_kernel"]  # as _FastKernel appends them
    trace.end(record, 7, decodes=1, chunk_tokens=6720, chunks=44, graph=False, decode_context=85, chunk_context=8542)
    trace.end(trace.begin(), 8, decodes=45, chunk_tokens=0, chunks=0, graph=True, decode_context=8672,
              chunk_context=0)
    trace.close()
    first, second = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert (first["new_kernels"], first["new_kernel_ms"]) == (2, 300.0)
    assert first["new_kernel_names"] == ["_extend_kernel", "_rms_norm_kernel"]
    assert second["new_kernels"] == 0 and "new_kernel_names" not in second
    text = step_trace.table(step_trace.summarise(step_trace.load(tmp_path / "trace.jsonl"), long_gap_ms=1000))
    assert "Steps that compiled (or loaded) a Triton kernel: step 7 300.0 ms: _extend_kernel, _rms_norm_kernel" in text


def test_a_step_names_every_kernel_triton_compiled_during_its_launch(tmp_path, monkeypatch):
    """Triton's post-compile hook (installed by the trace where Triton has one) counts compilations
    of any library's kernels, autotuning's candidates included: the step during whose launch they
    happened records their count and names, the summary names the step."""
    import types

    import torch

    from lightllm.engine.step_trace import StepTrace
    from lightllm.kernels import _triton

    if getattr(getattr(_triton.triton, "knobs", None), "runtime", None) is not None:
        monkeypatch.setattr(_triton.triton.knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setitem(_triton.COMPILES, "count", 0)
    trace = StepTrace(str(tmp_path / "trace.jsonl"), torch.device("cpu"))
    if getattr(getattr(_triton.triton, "knobs", None), "runtime", None) is not None:
        assert _triton.triton.knobs.runtime.jit_post_compile_hook is _triton.count_compile
    record = trace.begin()
    for name in ("chunk_fwd_kernel_o", "chunk_fwd_kernel_o", "l2norm_fwd_kernel"):  # as Triton calls its hook
        _triton.count_compile(key=(), repr=name, fn=types.SimpleNamespace(name=name), compile={},
                              is_manual_warmup=False, already_compiled=False)
    trace.end(record, 40, decodes=1, chunk_tokens=5339, chunks=53, graph=False, decode_context=5, chunk_context=109722)
    trace.end(trace.begin(), 41, decodes=18, chunk_tokens=5082, chunks=45, graph=False, decode_context=90,
              chunk_context=94601)
    trace.close()
    first, second = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert first["compiles"] == 3 and first["compiled"] == ["chunk_fwd_kernel_o", "l2norm_fwd_kernel"]
    assert "compiles" not in second
    text = step_trace.table(step_trace.summarise(step_trace.load(tmp_path / "trace.jsonl"), long_gap_ms=1000))
    assert "compiled kernels (any library's): step 40 (" in text and "3: chunk_fwd_kernel_o, l2norm_fwd_kernel" in text


def test_summary_splits_idle_by_the_step_that_waited():
    steps = [
        {"step": 1, "decodes": 0, "chunk_tokens": 3000, "chunks": 4, "graph": False, "launch_ms": 20, "start_ms": 0, "end_ms": 50},
        {"step": 2, "decodes": 8, "chunk_tokens": 0, "chunks": 0, "graph": True, "launch_ms": 1, "start_ms": 50, "end_ms": 60,
         "launched_ms": 53},  # reached the device 3 ms before its launch was done
        {"step": 3, "decodes": 8, "chunk_tokens": 100, "chunks": 1, "graph": False, "launch_ms": 20, "start_ms": 72, "end_ms": 80},
        {"step": 4, "decodes": 8, "chunk_tokens": 0, "chunks": 0, "graph": True, "launch_ms": 1, "start_ms": 81, "end_ms": 90,
         "launched_ms": 75},  # launched before the device reached it
        {"step": 5, "decodes": 1, "chunk_tokens": 0, "chunks": 0, "graph": True, "launch_ms": 1, "start_ms": 5090, "end_ms": 5100},
    ]
    s = step_trace.summarise(steps, long_gap_ms=1000)
    assert s["wall_ms"] == 5100 and s["busy_ms"] == 50 + 10 + 8 + 9 + 10
    assert s["idle_ms"] == 12 + 1 and s["long_idle_ms"] == 5000
    assert s["groups"]["with chunks, <= 256 chunk tokens (eager)"]["idle_before_ms"] == 12
    assert s["groups"]["decode only, <= 8 decodes (graph)"]["idle_before_ms"] == 1
    assert s["groups"]["with chunks, <= 4096 chunk tokens (eager)"]["steps"] == 1
    assert s["groups"]["decode only, <= 8 decodes (graph)"]["waited_ms"] == [3, 0]  # step 5 has no launched_ms: not counted
    text = step_trace.table(s)
    assert "with chunks, <= 256 chunk tokens (eager) | 1 |" in text
    assert "| decode only, <= 8 decodes (graph) | 3 | 6 | 9.67 | 1.00 / 1.0 | - | - | - | 1.50 |" in text
    # traced since these were recorded
    steps[1].update(launch_cpu_ms=0.5, gc_ms=0.25, new_kernels=0, new_kernel_ms=0.0)
    steps[3].update(launch_cpu_ms=0.7, gc_ms=0.0, new_kernels=2, new_kernel_ms=180.0)
    steps[4].update(launch_cpu_ms=0.9, gc_ms=0.5, new_kernels=1, new_kernel_ms=20.0)
    text = step_trace.table(step_trace.summarise(steps, long_gap_ms=1000))
    assert "| decode only, <= 8 decodes (graph) | 3 | 6 | 9.67 | 1.00 / 1.0 | 0.70 | 0.25 / 0.5 | 3 (180.0) | 1.50 |" in text


def test_plot_writes_a_png(tmp_path):
    steps = [{"step": i, "decodes": 4, "chunk_tokens": 64 * (i % 2), "chunks": i % 2, "graph": i % 2 == 0,
              "launch_ms": 1.0, "start_ms": 10.0 * i, "end_ms": 10.0 * i + 8} for i in range(6)]
    path = tmp_path / "timeline.png"
    step_trace.plot(steps, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_floor_table_prices_each_step_by_its_weights_kv_and_flops(tiny_model):
    """The floor of a step from its shape, by hand for the tiny model: weights and KV at the
    bandwidth, against (or, GEMMs then attention, beside) its tokens' FLOPs at the peak."""
    model = step_trace.floor_model(tiny_model, bandwidth_gbs=1.0, peak_tflops=1e-3)  # 1 GB/s, 1 GFLOP/s
    decode = {"decodes": 4, "chunk_tokens": 0, "chunks": 0, "decode_context": 100, "chunk_context": 0,
              "start_ms": 0.0, "end_ms": 1.0}
    prefill = dict(decode, decodes=0, chunk_tokens=3000, chunks=1, decode_context=0, chunk_context=3000)
    for step in (decode, prefill):
        memory = (model["weight_bytes"] + (step["decode_context"] + step["chunk_context"]) * model["kv_bytes"]) / 1e6
        flops = ((step["decodes"] + step["chunk_tokens"]) * model["flops_per_token"]
                 + step["decodes"] * model["head_flops"]) / 1e6
        roofline, serial = step_trace.step_floor(step, model)
        assert roofline == pytest.approx(max(memory, flops))
        assert serial == pytest.approx(max(model["weight_bytes"] / 1e6, flops)
                                       + (step["decode_context"] + step["chunk_context"]) * model["kv_bytes"] / 1e6)
        assert roofline <= serial
    assert step_trace.step_floor(prefill, model)[0] > step_trace.step_floor(decode, model)[0]
    text = step_trace.floor_table([decode, prefill], model)
    assert "| decode only, <= 8 decodes | 1 |" in text and "| with chunks | 1 |" in text and "| all | 2 |" in text


def test_a_step_names_the_lines_at_which_its_launch_waited_for_the_device(tmp_path, monkeypatch):
    """Torch's sync debug mode (on CUDA, during each launch) warns at every host wait on the device:
    the step records the lines, once each time, the summary counts them by line; a warning between
    launches, or of another kind, is left to Python's own handling."""
    import warnings

    import torch

    from lightllm.engine.step_trace import SYNC_MESSAGE, StepTrace

    others = []  # what Python's own handling got
    monkeypatch.setattr(warnings, "showwarning", lambda message, *_: others.append(str(message)))
    trace = StepTrace(str(tmp_path / "trace.jsonl"), torch.device("cpu"))
    line = inspect.currentframe().f_lineno
    waited = lambda: warnings.warn(SYNC_MESSAGE)  # noqa: E731 (the line every wait below is at)
    record = trace.begin()
    waited(), waited()
    trace.end(record, 3, decodes=0, chunk_tokens=6, chunks=1, graph=True, decode_context=0, chunk_context=6)
    waited()  # no launch under way
    record = trace.begin()
    warnings.warn("something else")
    trace.end(record, 4, decodes=8, chunk_tokens=0, chunks=0, graph=True, decode_context=80, chunk_context=0)
    trace.close()
    assert others == [SYNC_MESSAGE, "something else"]
    first, second = [json.loads(text) for text in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert first["syncs"] == [f"tests/test_step_trace.py:{line + 1}"] * 2 and "syncs" not in second
    text = step_trace.table(step_trace.summarise(step_trace.load(tmp_path / "trace.jsonl"), long_gap_ms=1000))
    assert f"launches waited for the device: tests/test_step_trace.py:{line + 1} 2 times in 1 steps" in text


def test_a_step_counts_the_pinned_host_memory_its_launch_took_from_the_driver(tmp_path, monkeypatch):
    """torch's pinned allocator grows its pool with cudaHostAlloc (which may wait for the device):
    a CUDA trace records the blocks a launch took and the time in those calls, from the allocator's
    counters, on the step whose launch took them; the summary names it."""
    import torch

    from lightllm.engine.step_trace import StepTrace

    counters = {"num_host_alloc": 5, "host_alloc_time.total": 800.0}  # microseconds, as torch counts
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: dict(counters), raising=False)
    trace = StepTrace(str(tmp_path / "trace.jsonl"), torch.device("cpu"))
    trace._pinned = True  # as on CUDA
    record = trace.begin()
    counters.update({"num_host_alloc": 7, "host_alloc_time.total": 3300.0})  # two blocks in this launch
    trace.end(record, 5, decodes=3, chunk_tokens=900, chunks=2, graph=False, decode_context=30, chunk_context=900)
    trace.end(trace.begin(), 6, decodes=5, chunk_tokens=0, chunks=0, graph=True, decode_context=50, chunk_context=0)
    trace.close()
    first, second = [json.loads(text) for text in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert (first["pinned_allocs"], first["pinned_alloc_ms"]) == (2, 2.5) and "pinned_allocs" not in second
    text = step_trace.table(step_trace.summarise(step_trace.load(tmp_path / "trace.jsonl"), long_gap_ms=1000))
    assert "took pinned host memory from the driver: 1, 2 blocks, 2.5 ms" in text


def test_the_engines_lines_put_each_step_between_its_plan_and_its_answer(tiny_model, tmp_path):
    """PATH.host, the engine's side: each step's parts end in order, and the runner was handed the
    plan (the device trace's `received_ms`, on the engine's clock through `origin_perf_s`) after the
    engine planned it and before the workers answered."""
    from lightllm.engine.build import start_engine
    from lightllm.engine.request import GenerateReq

    path = tmp_path / "trace.jsonl"
    config = EngineConfig(model_dir=str(tiny_model), max_total_token_num=2048, max_req_total_len=256,
                          running_max_req_size=4, data_type="float32", step_trace=str(path))
    workers, core, _ = start_engine(config)
    try:
        for req_id in range(3):
            core.add(GenerateReq(req_id, list(range(1, 6 + req_id)), SamplingParams(max_new_tokens=5)))
        core.drain()
        core.host_trace.close()
        workers.runner._trace.close()
    finally:
        workers.shutdown()
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    host = [json.loads(line) for line in (tmp_path / "trace.jsonl.host").read_text().splitlines()]
    origin = steps[0]["origin_perf_s"]
    by_step = {h["step"]: h for h in host}
    assert len(host) >= len(steps) >= 5 and {s["step"] for s in steps} <= set(by_step)
    for h in host:
        assert h["start"] <= h["collected"] <= h["planned"] <= h["called"] <= h["processed"]
    for s in steps:
        h = by_step[s["step"]]
        assert h["planned"] <= origin + s["received_ms"] / 1000 <= h["called"] + 1e-6


def test_a_held_launch_says_its_thread_gave_up_the_cpu(tmp_path):
    """A launch whose thread waits (here it sleeps, as on a lock or a blocking driver call) records
    the times it gave up the CPU; the summary counts it among the held launches, as blocked."""
    import torch

    from lightllm.engine.step_trace import StepTrace

    trace = StepTrace(str(tmp_path / "trace.jsonl"), torch.device("cpu"))
    record = trace.begin()
    time.sleep(0.05)
    trace.end(record, 3, decodes=600, chunk_tokens=8192, chunks=32, graph=False, decode_context=153600,
              chunk_context=8192)
    trace.close()
    (line,) = [json.loads(text) for text in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert line["launch_ms"] - line["launch_cpu_ms"] >= 45
    assert line["blocked"] >= 1
    text = step_trace.table(step_trace.summarise(step_trace.load(tmp_path / "trace.jsonl"), long_gap_ms=1000))
    assert "Launches held 20+ ms beyond their CPU time: 1," in text
    assert "1 gave up the CPU" in text and "step 3 (with chunks" in text
