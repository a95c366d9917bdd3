"""The hybrid models on CUDA: the chunked forms' CUDA paths (flash-linear-attention's delta rule
behind our wrapper, our conv) against their torch references at the qwen3.5-27b's head shapes, the
delta rule replayed from a CUDA graph with new chunk bounds, and a tiny Qwen3.5 (fp32) whose steps
replay CUDA graphs (decode buckets and mixed steps) giving the eager steps' and transformers'
greedy tokens.

    python -m pytest -m gpu tests/gpu/test_gpu_hybrid.py
"""

import pytest
import torch
from helpers.models import hf_greedy, make_runner, random_prompts
from test_hybrid_graphs import DECODE_STEPS, record_replays, run, schedule
from test_hybrid_models import TEXT, make_hybrid


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# 27B, one rank: 16 key heads and 48 value heads of 128; the conv over [q | k | v]'s 10240 channels
K_HEADS, V_HEADS, DIM, CHANNELS = 16, 48, 128, 10240
# |ours - reference| / |reference|, whole tensors. The delta rule is flash-linear-attention's: its dots
# take the inputs' dtype (fp32: TF32 on tensor cores) and its per-block states are kept in it (bf16:
# 4.45e-3 at the 27B's shapes in delta_rule_bench.py); the conv is ours (fp32 exact).
DELTA_ERROR = {torch.float32: 5e-3, torch.bfloat16: 4e-2}
CONV_ERROR = {torch.float32: 1e-4, torch.bfloat16: 4e-2}
PAD_TOKENS = 9  # a padded step's tokens after the chunks


def assert_near(results, bound):
    for ours, reference in zip(results[1], results[0]):
        error = (ours.float() - reference.float()).norm() / reference.float().norm()
        assert error < bound, error


def chunks(lengths, decodes, fresh_every=2):
    """Bounds after `decodes` decode tokens, rows in a pool of len + 3 (the empty chunks, a padded
    step's, on the last row), which chunks start their requests."""
    cu = torch.tensor([decodes] + lengths, device="cuda").cumsum(0).int()
    real = sum(1 for n in lengths if n)
    rows = torch.cat([torch.randperm(len(lengths) + 2, device="cuda")[:real],
                      torch.full((len(lengths) - real,), len(lengths) + 2, device="cuda")])
    fresh = torch.arange(len(lengths), device="cuda") % fresh_every == 0
    return cu, rows, fresh, int(cu[-1])


def delta_inputs(tokens, dtype):
    q, k = (torch.randn(tokens, K_HEADS, DIM, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(tokens, V_HEADS, DIM, device="cuda", dtype=dtype)
    g = -torch.rand(tokens, V_HEADS, device="cuda") * 2
    return q, k, v, g, torch.rand(tokens, V_HEADS, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_kernels_equal_references_at_the_27b_shapes(dtype):
    """fla's delta rule behind our wrapper (states from the pool, chunk starts from zeros, decode
    tokens before the chunks and padding after them, empty padding chunks) and our conv against
    the references."""
    from lightllm.kernels.causal_conv1d import causal_conv1d_chunks_ref, causal_conv1d_chunks_triton
    from lightllm.kernels.gated_delta_rule import gated_delta_rule_chunks_fla, gated_delta_rule_chunks_ref

    torch.manual_seed(0)
    cu, rows, fresh, tokens = chunks([1, 63, 64, 65, 300, 7, 0, 0], decodes=5)
    q, k, v, g, beta = delta_inputs(tokens + PAD_TOKENS, dtype)
    pool = torch.randn(len(rows) + 3, V_HEADS, DIM, DIM, device="cuda") * 0.1
    results = []
    for impl in (gated_delta_rule_chunks_ref, gated_delta_rule_chunks_fla):
        out, states = torch.full_like(v, 7.0), pool.clone()
        impl(q, k, v, g, beta, cu, states, rows, fresh, out)
        results.append((out, states))
        assert (out[:5] == 7).all() and (out[tokens:] == 7).all()  # the chunks' rows only
        assert torch.equal(states[-1], pool[-1])  # the padding chunks' row
    assert_near(results, DELTA_ERROR[dtype])
    x = torch.randn(tokens, CHANNELS, device="cuda", dtype=dtype)
    weight = torch.randn(CHANNELS, 4, device="cuda", dtype=dtype)
    conv_pool = torch.randn(len(rows) + 3, CHANNELS, 3, device="cuda", dtype=dtype)
    results = []
    for impl in (causal_conv1d_chunks_ref, causal_conv1d_chunks_triton):
        out, states = torch.zeros_like(x), conv_pool.clone()
        impl(x, weight, cu, states, rows, fresh, out)
        results.append((out, states))
    assert_near(results, CONV_ERROR[dtype])


def test_fla_delta_rule_replays_from_a_cuda_graph_with_new_bounds():
    """The wrapper reads no bounds on the host: captured once, a graph replays other chunk lengths
    (other block counts) in the same shapes and gives the reference's outputs and states."""
    from lightllm.kernels.gated_delta_rule import gated_delta_rule_chunks_fla, gated_delta_rule_chunks_ref

    torch.manual_seed(1)
    total, dtype = 600, torch.bfloat16
    q, k, v, g, beta = delta_inputs(total, dtype)
    pool = torch.randn(11, V_HEADS, DIM, DIM, device="cuda") * 0.1
    static = chunks([100, 200, 3, 0], decodes=4)[:3]  # the captured step's bounds, rows, starts
    states, out = pool.clone(), torch.zeros_like(v)

    def call():
        cu, rows, fresh = static
        gated_delta_rule_chunks_fla(q, k, v, g, beta, cu, states, rows, fresh, out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up: compiles and autotunes fla's kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lengths, decodes in (([1, 130, 64, 400], 2), ([500, 0, 0, 0], 7), ([65, 66, 67, 68], 0)):
        cu, rows, fresh, _ = chunks(lengths, decodes)
        for buffer, value in zip(static, (cu, rows, fresh)):
            buffer.copy_(value)
        states.copy_(pool)
        out.fill_(7.0)
        graph.replay()
        expected_out, expected_states = torch.full_like(v, 7.0), pool.clone()
        gated_delta_rule_chunks_ref(q, k, v, g, beta, cu, expected_states, rows, fresh, expected_out)
        assert_near([(expected_out, expected_states), (out, states)], DELTA_ERROR[dtype])


def test_hybrid_graphs_equal_eager_and_transformers(tmp_path, monkeypatch):
    hf_model = make_hybrid("qwen3_5", tmp_path).to("cuda")
    prompts = random_prompts(3, lengths=(70, 9, 33, 5), vocab=TEXT["vocab_size"])
    plans = schedule(prompts)
    replays = record_replays(monkeypatch)
    runs = {}
    for graphs in (False, True):
        runner = make_runner(tmp_path, tokens=256, device="cuda", max_req_total_len=96, running_max_req_size=6,
                             cuda_graph=graphs, cuda_graph_max_tokens=96)
        if graphs:
            assert runner.graphs.graphs and runner.graphs.mixed_graphs  # captured, not eager
        runs[graphs] = run(runner, plans)
        assert runner.stats()["tokens_used"] == 0
        del runner
    assert [m for m, *_ in replays] == ["run_mixed"] * 3 + ["run"] * DECODE_STEPS
    (eager_tokens, eager_states), (graph_tokens, graph_states) = runs[False], runs[True]
    assert graph_tokens == eager_tokens
    for eager, graphed in zip(eager_states, graph_states):
        for a, b in zip(eager, graphed):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    expected = hf_greedy(hf_model, prompts, max(len(t) for t in graph_tokens.values()))
    assert graph_tokens == {i: expected[i][: len(t)] for i, t in graph_tokens.items()}
