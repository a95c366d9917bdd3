"""CUDA-graph decode on the GPU: a schedule whose decode batch changes size as requests join and
finish (12 requests, decode batches of 1 to 9 in buckets of up to 16, most padded) gives each
request the same greedy tokens with graphs as without, and as transformers' greedy `generate` on
the same GPU and weights (a tiny random Llama, GQA and llama3 rope, fp32).

    python -m pytest -m gpu tests/gpu/test_gpu_graphs.py

Decode speed with and without graphs: test/benchmark/engine/profile_step.py (--no-cuda-graph).
"""

import json

import pytest
import torch
from helpers.models import GPU_SIZES, LLAMA3_ROPE, hf_greedy, make_gpu_model, make_runner, random_prompts

from benchmark.lib.direct_step import run_step
from lightllm.engine.request import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (prompt length, new tokens, decode step at which the request joins)
SCHEDULE = [(5, 30, 0), (130, 12, 0), (37, 25, 0), (300, 8, 0), (17, 40, 0), (64, 20, 3), (9, 3, 3),
            (250, 33, 5), (1, 18, 6), (77, 27, 6), (190, 15, 10), (44, 22, 12)]


def run_schedule(runner, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens per request, and the decode batch size of every step."""
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    tokens: dict[int, list[int]] = {}
    sizes, step = [], 0
    while len(tokens) < len(SCHEDULE) or any(len(tokens[i]) < SCHEDULE[i][1] for i in tokens):
        joining = [i for i, (_, _, start) in enumerate(SCHEDULE) if start == step and i not in tokens]
        if joining:
            for i, (token, _) in zip(joining, run_step(runner, prompts=[(i, prompts[i], params) for i in joining])):
                tokens[i] = [token]
        finished = [i for i in tokens if len(tokens[i]) == SCHEDULE[i][1] and i in runner.reqs]
        if finished:
            runner.free(finished)
        running = [i for i in tokens if len(tokens[i]) < SCHEDULE[i][1]]
        if running:
            sizes.append(len(running))
            for i, (token, _) in zip(running, run_step(runner, running)):
                tokens[i].append(token)
        step += 1
    runner.free([i for i in tokens if i in runner.reqs])
    assert runner.stats()["tokens_used"] == 0, "tokens left in use after freeing every request"
    return [tokens[i] for i in range(len(SCHEDULE))], sizes


def test_graph_decode_equals_eager_and_transformers_as_the_batch_changes_size(tmp_path):
    hf_model = make_gpu_model("llama_gqa_llama3_rope", tmp_path,
                              rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 64})
    prompts = random_prompts(1, [n for n, _, _ in SCHEDULE], vocab=GPU_SIZES["vocab_size"])
    results = {}
    for cuda_graph in (True, False):
        runner = make_runner(tmp_path, tokens=8192, device="cuda", cuda_graph=cuda_graph, max_req_total_len=512,
                             running_max_req_size=16)
        results[cuda_graph] = run_schedule(runner, prompts)
        del runner
    (graph_tokens, sizes), (eager_tokens, _) = results[True], results[False]
    assert sorted(set(sizes)) == [1, 2, 3, 4, 5, 7, 8, 9]  # the buckets' padding: 3 of 4, 5 of 8, 7 of 8, 9 of 16
    longest = max(new for _, new, _ in SCHEDULE)
    reference = [tokens[:new] for tokens, (_, new, _) in
                 zip(hf_greedy(hf_model.to("cuda"), prompts, longest).values(), SCHEDULE)]
    assert graph_tokens == eager_tokens
    assert graph_tokens == reference


def test_a_launch_never_waits_for_the_device(tmp_path):
    """A step's launch must not wait for the device (it would stall behind the step in flight): under
    the step trace's watch (torch's sync debug mode), prefill, mixed and decode steps, from graphs and
    eager, record no host wait."""
    make_gpu_model("llama_gqa_llama3_rope", tmp_path, rope_parameters={**LLAMA3_ROPE,
                                                                         "original_max_position_embeddings": 64})
    trace = tmp_path / "trace.jsonl"
    runner = make_runner(tmp_path, tokens=8192, device="cuda", max_req_total_len=512, running_max_req_size=16,
                         step_trace=str(trace))
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    prompts = random_prompts(2, [40, 300, 9, 130], vocab=GPU_SIZES["vocab_size"])
    run_step(runner, prompts=[(0, prompts[0], params)])
    for i in range(1, len(prompts)):
        run_step(runner, list(range(i)), prompts=[(i, prompts[i], params)])
        run_step(runner, list(range(i + 1)))
    runner._trace.flush(wait=True)
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(steps) == 2 * len(prompts) - 1
    assert any(s["graph"] and s["chunks"] for s in steps) and any(s["graph"] and not s["chunks"] for s in steps)
    assert {s["step"]: s["syncs"] for s in steps if "syncs" in s} == {}


def test_a_buckets_first_serving_replay_is_no_slower_than_its_next(tmp_path):
    """Start-up replays every captured graph once: a graph's first launch uploads it to the device
    (tens of ms for a large model's step on an H200), which the first serving step of each bucket
    would otherwise pay. After start, a bucket's first replay takes about its second's host time."""
    import time

    make_gpu_model("llama_gqa_llama3_rope", tmp_path, rope_parameters={**LLAMA3_ROPE,
                                                                         "original_max_position_embeddings": 64})
    graphs = make_runner(tmp_path, tokens=8192, device="cuda", max_req_total_len=512, running_max_req_size=16).graphs
    for graph, pad_only in [(graphs.graphs[graphs.buckets[-1]], lambda: None),
                            (graphs.mixed_graphs[graphs.mixed[-1]], lambda: graphs._pad_only(graphs.mixed[-1]))]:
        launches = []
        for _ in range(3):
            pad_only()
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            launches.append(time.perf_counter() - start)
            torch.cuda.synchronize()
        assert launches[0] < 2 * max(launches[1:]) + 0.5e-3, launches
