"""The hybrid models on CUDA: the chunked forms' Triton kernels against their torch references at
the qwen3.5-27b's head shapes, and a tiny Qwen3.5 (fp32) whose steps replay CUDA graphs (decode
buckets and mixed steps) giving the eager steps' and transformers' greedy tokens.

    python -m pytest -m gpu tests/gpu/test_gpu_hybrid.py
"""

import pytest
import torch
from helpers.models import hf_greedy, make_runner, random_prompts
from test_hybrid_graphs import DECODE_STEPS, run, schedule
from test_hybrid_models import TEXT, make_hybrid

from lightllm.engine.cuda_graph import StepGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# 27B, one rank: 16 key heads and 48 value heads of 128; the conv over [q | k | v]'s 10240 channels
K_HEADS, V_HEADS, DIM, CHANNELS = 16, 48, 128, 10240
RELATIVE_ERROR = {torch.float32: 1e-4, torch.bfloat16: 4e-2}  # |ours - reference| / |reference|, whole tensors
# (bf16: the state's dots take bf16 operands, as flash-linear-attention's do; 1.2% in the CPU's interpreter)


def assert_near(results, dtype):
    for ours, reference in zip(results[1], results[0]):
        error = (ours.float() - reference.float()).norm() / reference.float().norm()
        assert error < RELATIVE_ERROR[dtype], error


def chunks(lengths, decodes, fresh_every=2):
    cu = torch.tensor([decodes] + lengths, device="cuda").cumsum(0).int()
    rows = torch.randperm(len(lengths) + 3, device="cuda")[: len(lengths)]
    fresh = torch.arange(len(lengths), device="cuda") % fresh_every == 0
    return cu, rows, fresh, int(cu[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_kernels_equal_references_at_the_27b_shapes(dtype):
    from lightllm.kernels.causal_conv1d import causal_conv1d_chunks_ref, causal_conv1d_chunks_triton
    from lightllm.kernels.gated_delta_rule import gated_delta_rule_chunks_ref, gated_delta_rule_chunks_triton

    torch.manual_seed(0)
    cu, rows, fresh, tokens = chunks([1, 63, 64, 65, 300, 7], decodes=5)
    q, k = (torch.randn(tokens, K_HEADS, DIM, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(tokens, V_HEADS, DIM, device="cuda", dtype=dtype)
    g = -torch.rand(tokens, V_HEADS, device="cuda") * 2
    beta = torch.rand(tokens, V_HEADS, device="cuda")
    pool = torch.randn(len(rows) + 3, V_HEADS, DIM, DIM, device="cuda") * 0.1
    results = []
    for impl in (gated_delta_rule_chunks_ref, gated_delta_rule_chunks_triton):
        out, states = torch.zeros_like(v), pool.clone()
        impl(q, k, v, g, beta, cu, states, rows, fresh, out)
        results.append((out, states))
    assert_near(results, dtype)
    x = torch.randn(tokens, CHANNELS, device="cuda", dtype=dtype)
    weight = torch.randn(CHANNELS, 4, device="cuda", dtype=dtype)
    conv_pool = torch.randn(len(rows) + 3, CHANNELS, 3, device="cuda", dtype=dtype)
    results = []
    for impl in (causal_conv1d_chunks_ref, causal_conv1d_chunks_triton):
        out, states = torch.zeros_like(x), conv_pool.clone()
        impl(x, weight, cu, states, rows, fresh, out)
        results.append((out, states))
    assert_near(results, dtype)


def test_hybrid_graphs_equal_eager_and_transformers(tmp_path, monkeypatch):
    hf_model = make_hybrid("qwen3_5", tmp_path).to("cuda")
    prompts = random_prompts(3, lengths=(70, 9, 33, 5), vocab=TEXT["vocab_size"])
    plans = schedule(prompts)
    replays = []
    for method in ("run", "run_mixed"):
        original = getattr(StepGraphs, method)
        monkeypatch.setattr(StepGraphs, method, lambda self, meta, *a, m=method, f=original:
                            replays.append(m) or f(self, meta, *a))
    runs = {}
    for graphs in (False, True):
        runner = make_runner(tmp_path, tokens=256, device="cuda", max_req_total_len=96, running_max_req_size=6,
                             cuda_graph=graphs, cuda_graph_max_tokens=96)
        if graphs:
            assert runner.graphs.graphs and runner.graphs.mixed_graphs  # captured, not eager
        runs[graphs] = run(runner, plans)
        assert runner.stats()["tokens_used"] == 0
        del runner
    assert replays == ["run_mixed"] * 3 + ["run"] * DECODE_STEPS
    (eager_tokens, eager_states), (graph_tokens, graph_states) = runs[False], runs[True]
    assert graph_tokens == eager_tokens
    for eager, graphed in zip(eager_states, graph_states):
        for a, b in zip(eager, graphed):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    expected = hf_greedy(hf_model, prompts, max(len(t) for t in graph_tokens.values()))
    assert graph_tokens == {i: expected[i][: len(t)] for i, t in graph_tokens.items()}
