"""The tensor-parallel all-reduce (lightllm/utils/allreduce.py, TPGroup.all_reduce).

On any machine: which path a message takes (by size, dtype, group size, device, machines), that
every failure to set symmetric memory up ends in NCCL with one log line, that everything imports
without CUDA and without torch's symmetric memory, and that two gloo ranks give exact sums.
With two or more GPUs: every path's sums against NCCL's, eagerly and replayed from a CUDA graph.
"""

import logging
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightllm.utils import allreduce
from lightllm.utils.allreduce import (ANOTHER_RANK, ONE_SHOT_MAX_BYTES, SYMMETRIC_MAX_BYTES, AllReducePath,
                                      choose_path, setup_symmetric, symmetric_unsupported)
from lightllm.utils.dist import TPGroup, init_tp
from lightllm.utils.net import free_port

KiB, MiB = 1 << 10, 1 << 20
ONE, TWO, COLLECTIVE = AllReducePath.ONE_SHOT, AllReducePath.TWO_SHOT, AllReducePath.COLLECTIVE
GPUS = torch.cuda.device_count()


def decode_bytes(batch: int, hidden: int, itemsize: int = 2) -> int:
    return batch * hidden * itemsize


# ---- the choice, as pure functions ----

@pytest.mark.parametrize("world_size", sorted(ONE_SHOT_MAX_BYTES))
def test_decode_messages_take_symmetric_memory_and_prefill_takes_nccl(world_size):
    def path(nbytes, dtype=torch.bfloat16):
        return choose_path(nbytes, dtype, world_size, SYMMETRIC_MAX_BYTES)

    assert path(decode_bytes(1, 4096)) is ONE  # bench-8b, batch 1: 8 KiB
    assert path(decode_bytes(1, 8192)) is ONE  # bench-70b, batch 1
    assert path(decode_bytes(512, 8192)) is TWO  # the largest default bucket of a 70B model: 8 MiB
    assert path(decode_bytes(8192, 4096)) is COLLECTIVE  # a prefill chunk of 8192 tokens: 64 MiB
    limit = ONE_SHOT_MAX_BYTES[world_size]
    assert (path(limit), path(limit + 16)) == (ONE, TWO)
    assert (path(SYMMETRIC_MAX_BYTES), path(SYMMETRIC_MAX_BYTES + 16)) == (TWO, COLLECTIVE)
    assert path(decode_bytes(1, 4096, 4), torch.float32) is ONE


def test_messages_the_kernels_do_not_take_go_to_nccl():
    assert choose_path(8 * KiB, torch.float16, 2, SYMMETRIC_MAX_BYTES) is COLLECTIVE  # no fp16 kernel
    assert choose_path(8 * KiB + 2, torch.bfloat16, 2, SYMMETRIC_MAX_BYTES) is COLLECTIVE  # not 16-byte aligned
    assert choose_path(8 * KiB, torch.bfloat16, 2, 0) is COLLECTIVE  # no buffer


def test_one_shot_limits_shrink_as_the_group_grows():
    limits = [ONE_SHOT_MAX_BYTES[n] for n in sorted(ONE_SHOT_MAX_BYTES)]
    assert limits == sorted(limits, reverse=True) and limits[-1] < SYMMETRIC_MAX_BYTES


@pytest.mark.parametrize("world_size", sorted(ONE_SHOT_MAX_BYTES))
def test_every_message_the_fused_kernel_takes_fits_its_slots(world_size):
    """The fused all-reduce + norm's regions, as the group sizes them: every row count of every
    width up to FUSED_MAX_HIDDEN in either dtype, up to the group's largest fused message, fits
    the programs' slots (kernels/allreduce_norm.slots), one row a program up to FUSED_PROGRAMS
    rows; and the regions stay within 80 MiB each."""
    from lightllm.kernels.allreduce_norm import slots

    programs, most = allreduce.FUSED_PROGRAMS[world_size], allreduce.FUSED_MAX_BYTES[world_size]
    region = allreduce.fused_region_bytes(most, programs)
    assert region % 16 == 0 and region <= 80 * MiB
    for itemsize in (2, 4):
        for hidden in (576, 2048, 4096, 8192, allreduce.FUSED_MAX_HIDDEN):
            for rows in range(1, most // (hidden * itemsize) + 1):
                per_program, launched, slot = slots(rows, hidden, programs, region // itemsize)
                assert per_program * hidden <= slot and launched <= programs
                assert (launched - 1) * per_program < rows <= launched * per_program
                assert per_program == 1 or rows > programs
            assert slots(1, hidden, programs, region // itemsize)[:2] == (1, 1)


def test_which_groups_may_try_symmetric_memory():
    assert symmetric_unsupported("cuda", 2, single_node=True, enabled=True) is None
    assert symmetric_unsupported("cuda", 8, single_node=True, enabled=True) is None
    assert "gloo" in symmetric_unsupported("cpu", 2, single_node=True, enabled=True)
    assert "--nnodes" in symmetric_unsupported("cuda", 4, single_node=False, enabled=True)
    assert "3 ranks" in symmetric_unsupported("cuda", 3, single_node=True, enabled=True)
    assert allreduce.SYMMETRIC_ENV in symmetric_unsupported("cuda", 2, single_node=True, enabled=False)


def test_the_environment_switch(monkeypatch):
    monkeypatch.delenv(allreduce.SYMMETRIC_ENV, raising=False)
    assert allreduce.symmetric_enabled()
    monkeypatch.setenv(allreduce.SYMMETRIC_ENV, "0")
    assert not allreduce.symmetric_enabled()


# ---- set-up failures: NCCL, one log line ----

@pytest.fixture
def one_rank(monkeypatch):
    """setup_symmetric's group calls answered as rank 0 of a group whose other ranks agree."""
    monkeypatch.setattr(allreduce.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(allreduce, "_peer_access_problem", lambda device: None)
    monkeypatch.setattr(allreduce, "_agree", lambda reason, device: reason)
    monkeypatch.delenv(allreduce.SYMMETRIC_ENV, raising=False)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_cpu_groups_set_up_nothing_and_say_nothing(caplog):
    assert setup_symmetric(torch.device("cpu"), 2, single_node=True) is None
    assert warnings_of(caplog) == []


def test_a_failed_set_up_means_nccl_and_one_line(one_rank, monkeypatch, caplog):
    def fail(*args, **kwargs):
        raise RuntimeError("CUDA driver error: peer mapping refused\nmore detail")

    monkeypatch.setattr(allreduce.SymmetricAllReduce, "create", fail)
    assert setup_symmetric(torch.device("cuda", 0), 2, single_node=True) is None
    assert warnings_of(caplog) == ["all-reduce: NCCL for every message (symmetric memory off: set-up failed: "
                                   "RuntimeError: CUDA driver error: peer mapping refused)"]


def test_without_symmetric_memory_in_torch(one_rank, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", None)  # import fails
    assert setup_symmetric(torch.device("cuda", 0), 2, single_node=True) is None
    (line,) = warnings_of(caplog)
    assert "_symmetric_memory" in line


def test_a_failure_on_another_rank_turns_it_off_here(one_rank, monkeypatch, caplog):
    monkeypatch.setattr(allreduce.SymmetricAllReduce, "create", lambda *args: "ready here")
    monkeypatch.setattr(allreduce, "_agree", lambda reason, device: reason or ANOTHER_RANK)
    assert setup_symmetric(torch.device("cuda", 0), 2, single_node=True) is None
    assert warnings_of(caplog) == [f"all-reduce: NCCL for every message (symmetric memory off: {ANOTHER_RANK})"]


def test_several_machines_never_try(one_rank, monkeypatch, caplog):
    monkeypatch.setattr(allreduce.SymmetricAllReduce, "create", lambda *args: pytest.fail("tried"))
    assert setup_symmetric(torch.device("cuda", 0), 4, single_node=False) is None
    (line,) = warnings_of(caplog)
    assert "--nnodes > 1" in line


class Recorder:
    """A stand-in SymmetricAllReduce that sends every message down `path`."""

    def __init__(self, path):
        self.chosen, self.calls = path, []

    def path(self, x):
        return self.chosen

    def one_shot(self, x):
        self.calls.append("one-shot")
        return x + 1

    def two_shot(self, x):
        self.calls.append("two-shot")
        return x.add_(2)


@pytest.mark.parametrize("path,expected", [(ONE, 1.0), (TWO, 2.0)])
def test_tp_group_sends_each_message_down_its_path(path, expected):
    recorder = Recorder(path)
    x = torch.zeros(4)
    assert torch.equal(TPGroup(0, 2, recorder).all_reduce(x), torch.full((4,), expected))
    assert recorder.calls == [path.value]
    assert TPGroup(0, 1, recorder).all_reduce(x) is x and len(recorder.calls) == 1  # one rank: nothing


# ---- imports with neither CUDA nor symmetric memory ----

def test_everything_imports_without_symmetric_memory():
    code = ("import sys; sys.modules['torch.distributed._symmetric_memory'] = None\n"
            "import lightllm.utils.allreduce, lightllm.utils.dist, lightllm.models, lightllm.engine.model_runner\n"
            "from lightllm.utils.dist import TPGroup\n"
            "import torch; x = torch.ones(3); assert TPGroup().all_reduce(x) is x\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))


# ---- gloo: two processes ----

SIZES = (1, 7, 64, 4096, 65536 + 3)
DTYPES = (torch.float32, torch.bfloat16)


def rank_input(seed: int, rank: int, numel: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=gen).to(dtype).to(device)


def gloo_worker(rank, world_size, port, seed, results):
    group = init_tp(rank, world_size, port, "cpu")
    assert group.symmetric is None
    for numel in SIZES:
        for dtype in DTYPES:
            got = group.all_reduce(rank_input(seed, rank, numel, dtype))
            expected = rank_input(seed, 0, numel, dtype) + rank_input(seed, 1, numel, dtype)
            results[(rank, numel, str(dtype))] = torch.equal(got, expected)
    dist.destroy_process_group()


def test_gloo_sums_of_two_ranks():
    results = spawned_results(gloo_worker, 2)
    assert len(results) == 2 * len(SIZES) * len(DTYPES)
    assert all(results.values()), [key for key, ok in results.items() if not ok]


def interpreted_fused_rank(rank, data, flags, counters, parts, residuals, weight, outputs, rows_per_call):
    """One rank of the fused all-reduce + add + RMSNorm under Triton's interpreter, its peers'
    buffers and flags shared CPU memory (each process maps them at its own addresses)."""
    from lightllm.kernels.allreduce_norm import one_shot_add_rms_norm_triton

    pointers = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    for call, rows in enumerate(rows_per_call):
        y, _ = one_shot_add_rms_norm_triton(parts[call, rank, :rows], residuals[call, rank, :rows], weight, 1e-6,
                                            data_ptrs=pointers(data), flags_ptrs=pointers(flags),
                                            counters=counters[rank], rank=rank,
                                            region_bytes=data[rank].nbytes // (2 * len(data)))
        outputs[call, rank, :rows] = y


FUSED_TEST_PROGRAMS = 4
FUSED_TEST_ROWS = (3, 7, 2, 8)  # one row a program, then two (the slots hold two rows), then one again


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors: under Triton's interpreter")
def test_the_fused_kernels_barriers_between_two_interpreted_ranks():
    """The whole protocol on the CPU: two processes run the kernel as ranks 0 and 1, calls in a
    row over the same buffers with one and with several rows a program: no deadlock, every
    call's sums, residuals and norms equal the reference's on both ranks; at the end every
    program's counter and every flag it was signalled through holds its number of calls, and
    the programs never launched nothing."""
    from lightllm.kernels.allreduce_norm import flag_count, one_shot_add_rms_norm_ref, slots

    hidden, world, programs = 32, 2, FUSED_TEST_PROGRAMS
    calls, most = len(FUSED_TEST_ROWS), max(FUSED_TEST_ROWS)
    region = 2 * programs * hidden  # elements: two rows a slot
    data = [torch.zeros(2 * world * region).share_memory_() for _ in range(world)]
    flags = [torch.zeros(flag_count(programs, world), dtype=torch.int64).share_memory_() for _ in range(world)]
    counters = [torch.zeros(programs, dtype=torch.int64).share_memory_() for _ in range(world)]
    parts = torch.randn(calls, world, most, hidden).share_memory_()
    residuals = torch.randn(calls, 1, most, hidden).expand(calls, world, most, hidden).clone().share_memory_()
    weight = torch.randn(hidden).share_memory_()
    outputs = torch.zeros(calls, world, most, hidden).share_memory_()
    expected = [one_shot_add_rms_norm_ref(list(parts[c, :, :rows]), residuals[c, 0, :rows].clone(), weight, 1e-6)
                for c, rows in enumerate(FUSED_TEST_ROWS)]
    mp.spawn(interpreted_fused_rank, args=(data, flags, counters, parts, residuals, weight, outputs, FUSED_TEST_ROWS),
             nprocs=world, join=True)
    for c, ((y, residual), rows) in enumerate(zip(expected, FUSED_TEST_ROWS)):
        for rank in range(world):
            torch.testing.assert_close(residuals[c, rank, :rows], residual, atol=0, rtol=0)
            torch.testing.assert_close(outputs[c, rank, :rows], y, atol=1e-5, rtol=1e-5)
    launched = [slots(rows, hidden, programs, region)[1] for rows in FUSED_TEST_ROWS]
    assert launched == [3, 4, 2, 4]  # 7 and 8 rows: 2 a program
    calls_of = torch.tensor([sum(p < n for n in launched) for p in range(programs)])
    for rank in range(world):
        assert torch.equal(counters[rank], calls_of)
        signalled = flags[rank].view(programs, world)  # [program, sender]: a rank never signals itself
        sent_by_peer = torch.arange(world)[None, :] != rank
        assert torch.equal(signalled, torch.where(sent_by_peer, calls_of[:, None], 0))


# ---- CUDA: symmetric memory against NCCL (skipped without two GPUs) ----

def gpu_world_size() -> int:
    return max((n for n in ONE_SHOT_MAX_BYTES if n <= GPUS), default=0)


# bytes of bf16 / fp32 messages: one-shot, two-shot (for every group size), past the buffer
GPU_SIZES = (16, 8 * KiB, 256 * KiB, 2 * MiB + 16 * 3, SYMMETRIC_MAX_BYTES, SYMMETRIC_MAX_BYTES + 16 * KiB)


def cuda_worker(rank, world_size, port, seed, results):
    device = torch.device("cuda", rank)
    group = init_tp(rank, world_size, port, device)
    results[(rank, "set up")] = group.symmetric is not None
    if group.symmetric is None:
        return
    for nbytes in GPU_SIZES:
        for dtype in DTYPES:
            inputs = [rank_input(seed, r, nbytes // dtype.itemsize, dtype, device) for r in range(world_size)]
            reference = inputs[rank].clone()
            dist.all_reduce(reference)
            path = group.symmetric.path(inputs[rank])
            got = group.all_reduce(inputs[rank].clone())
            results[(rank, nbytes, str(dtype), path.value, "eager")] = same_sum(got, reference, inputs)
            replayed = [rank_input(seed + 1, r, nbytes // dtype.itemsize, dtype, device) for r in range(world_size)]
            reference = replayed[rank].clone()
            dist.all_reduce(reference)
            results[(rank, nbytes, str(dtype), path.value, "graph")] = same_sum(
                graph_all_reduce(group, inputs[rank], replayed[rank]), reference, replayed)
    dist.destroy_process_group()


def graph_all_reduce(group: TPGroup, x: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
    """group.all_reduce captured in a CUDA graph on x, replayed on `then`."""
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        group.all_reduce(static.clone())  # warm-up: NCCL's communicator for this size
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = group.all_reduce(static)
    static.copy_(then)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def same_sum(got: torch.Tensor, reference: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """NCCL's sum bitwise for two ranks (a + b in either order). Beyond, the summation orders
    differ; each sum must then lie within the rounding bound of any order: n u sum |x_r|,
    u the dtype's unit roundoff."""
    if len(inputs) == 2:
        return torch.equal(got, reference)
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
    u = 2.0 ** -8 if got.dtype == torch.bfloat16 else 2.0 ** -24
    return bool(((got.double() - exact).abs() <= len(inputs) * u * magnitude + 1e-30).all())


def spawned_results(worker, world_size: int) -> dict:
    """What `world_size` spawned ranks of worker(rank, world_size, port, seed, results) put in
    `results`, with one random seed for all."""
    seed = random.randrange(1 << 20)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(world_size, free_port(), seed, results), nprocs=world_size, join=True)
        return dict(results)


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_symmetric_sums_equal_nccl_eager_and_in_graphs():
    world_size = gpu_world_size()
    results = spawned_results(cuda_worker, world_size)
    assert all(results[(r, "set up")] for r in range(world_size)), "symmetric memory was not set up"
    paths = {key[3] for key in results if len(key) == 5}
    assert paths == {p.value for p in AllReducePath}, paths
    assert all(results.values()), [key for key, ok in results.items() if not ok]


# ---- CUDA: the all-reduce fused with the residual add and RMSNorm (kernels/allreduce_norm.py) ----

# bench-8b's decode batches (one row a program up to 256), then several rows a program (a large
# decode batch, mixed steps, 8192 x 4096 x 2 bytes: the largest message at 2 ranks)
FUSED_ROWS = (1, 3, 64, 256, 257, 1000, 4096, 8192)
IN_A_ROW = 40
GRAPH_CALLS, GRAPH_REPLAYS = 8, 25


def fused_worker(rank, world_size, port, seed, results):
    """Per row count and dtype: the fused kernel against NCCL's sum then add_rms_norm (the
    residual bitwise for two ranks, the norm's output within a rounding), every rank's outputs
    the same bits, eagerly, IN_A_ROW times in a row on new inputs with the ranks out of step,
    and replayed from a CUDA graph on new inputs."""
    from lightllm.kernels.rms_norm import add_rms_norm_triton

    device, hidden, eps = torch.device("cuda", rank), 4096, 1e-5
    group = init_tp(rank, world_size, port, device)
    results[(rank, "fused set up")] = group.symmetric is not None and group.symmetric.fused is not None
    if not results[(rank, "fused set up")]:
        return

    def inputs(salt: int, rows: int, dtype: torch.dtype):
        parts = [rank_input(seed + salt, r, rows * hidden, dtype, device).view(rows, hidden) for r in range(world_size)]
        generator = torch.Generator(device="cpu").manual_seed(seed + salt)  # the same on every rank
        residual = torch.randn(rows, hidden, generator=generator).to(dtype).to(device)
        return parts, residual

    def unfused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        x = x.clone()
        dist.all_reduce(x)
        residual = residual.clone()
        return add_rms_norm_triton(x, residual, weight, eps), residual

    def agree(key, got, expected) -> None:
        (y, residual), (y_ref, residual_ref) = got, expected
        exact = world_size > 2 or torch.equal(residual, residual_ref)
        results[key] = exact and torch.allclose(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
        gathered = [torch.empty_like(residual) for _ in range(world_size)]
        dist.all_gather(gathered, residual)
        results[key + ("same on every rank",)] = all(torch.equal(g, gathered[0]) for g in gathered)

    for dtype in (torch.bfloat16, torch.float32):
        weight = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)
        for rows in FUSED_ROWS:
            if rows * hidden * dtype.itemsize > group.symmetric.fused.max_bytes:
                continue
            parts, residual = inputs(rows, rows, dtype)
            got = group.reduce_add_rms_norm(parts[rank].clone(), residual.clone(), weight, eps)
            results[(rank, rows, str(dtype), "taken")] = got is not None
            if got is None:
                continue
            agree((rank, rows, str(dtype), "eager"), got, unfused(parts[rank], residual, weight))
            # Back to back on new inputs, with no host sync between the calls, one rank held back
            # on the device now and then (the other runs ahead into the next call): every call's
            # output is its own inputs' (a row region read too early or too late would give
            # another call's sum).
            calls = [inputs(10_000 * rows + i, rows, dtype) for i in range(IN_A_ROW)]
            staged = [(p[rank].clone(), r.clone()) for p, r in calls]
            torch.cuda.synchronize()
            outs = []
            for i, (x, res) in enumerate(staged):
                if i % 3 == 0 and rank == (i // 3) % world_size:
                    torch.cuda._sleep(50_000)  # ~25 us at H100 clocks
                y, res = group.reduce_add_rms_norm(x, res, weight, eps)
                outs.append((y, res))
            for i, ((p, r), got_i) in enumerate(zip(calls, outs)):
                agree((rank, rows, str(dtype), f"in a row {i}"), got_i, unfused(p[rank], r, weight))
            static_x, static_residual = parts[rank].clone(), residual.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                y, _ = group.reduce_add_rms_norm(static_x, static_residual, weight, eps)
            for salt in range(3):
                new_parts, new_residual = inputs(1000 * rows + salt, rows, dtype)
                static_x.copy_(new_parts[rank])
                static_residual.copy_(new_residual)
                graph.replay()
                torch.cuda.synchronize()
                agree((rank, rows, str(dtype), f"graph {salt}"), (y.clone(), static_residual.clone()),
                      unfused(new_parts[rank], new_residual, weight))
            # A graph of GRAPH_CALLS calls replayed GRAPH_REPLAYS times back to back, no host sync
            # between (as a decode step's layers, step after step): the residual takes every sum.
            residual_ref = static_residual.clone()
            with torch.cuda.graph(graph := torch.cuda.CUDAGraph(), stream=stream):
                for _ in range(GRAPH_CALLS):
                    y, _ = group.reduce_add_rms_norm(static_x, static_residual, weight, eps)
            for _ in range(GRAPH_REPLAYS):
                graph.replay()
            for _ in range(GRAPH_CALLS * GRAPH_REPLAYS):
                y_ref, residual_ref = unfused(static_x, residual_ref, weight)
            torch.cuda.synchronize()
            agree((rank, rows, str(dtype), "graph back to back"), (y, static_residual), (y_ref, residual_ref))
    dist.destroy_process_group()


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_the_fused_all_reduce_add_rms_norm_equals_nccl_then_the_norm():
    world_size = gpu_world_size()
    results = spawned_results(fused_worker, world_size)
    assert all(results[(r, "fused set up")] for r in range(world_size)), "the fused regions were not set up"
    assert all(results.values()), [key for key, ok in results.items() if not ok]
    assert len(results) > 10 * world_size  # every case ran
