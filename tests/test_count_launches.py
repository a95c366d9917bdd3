"""What a layer launches in an eager mixed step (decodes and a prompt chunk), counted by
test/benchmark/engine/count_launches.py on the GPU path (Triton kernels under the interpreter): the
difference between a 2-layer and a 1-layer model is one layer's launches, nothing else. An eager
step's host time is its launches, so each one here is a choice (H100, 2026-11-23, 9d728fa; docs/benchmarks-history.md)."""

import collections
import json
from pathlib import Path

import pytest

from benchmark.engine import count_launches

from lightllm.models import layers


def per_layer(model: Path, quantization=None, decodes=4, chunk=62) -> collections.Counter:
    counts = {}
    config = json.loads((model / "config.json").read_text())
    for num_layers in (1, 2):
        (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
        runner = count_launches.make_runner(model, "dummy", quantization)
        counts[num_layers] = count_launches.count_step(runner, decodes, chunk)
    assert not counts[1] - counts[2], "a deeper model launched fewer of something"
    return counts[2] - counts[1]


@pytest.fixture
def tiny(tmp_path):
    from lightllm.tools.bench_model import write_bench_model

    return write_bench_model(tmp_path / "tiny", "tiny", seed=0)


def test_a_layer_of_a_mixed_step_launches_ten_kernels(tiny):
    """Two norms, four projections, rotary with the KV write, decode and extend attention each
    into its rows of one output (no concatenation), one split at this batch (no merge), silu*mul."""
    launched_before = layers.rotary_kv_
    assert per_layer(tiny) == {
        "triton _rms_norm_kernel": 2, "torch linear": 2, "torch matmul": 2, "triton _rotary_kv_kernel": 1,
        "triton _decode_split_kernel": 1, "triton _extend_kernel": 1, "triton _silu_and_mul_kernel": 1}
    assert layers.rotary_kv_ is launched_before  # the counting put the layers' kernels back


def test_a_layer_of_an_fp8_mixed_step_adds_only_the_o_projections_input_quantisation(tiny):
    """Above 64 tokens (here 66) the projections are cuBLAS's fp8 GEMM; the norms and silu*mul quantise
    their own outputs, the attention output is quantised by its own launch."""
    assert per_layer(tiny, "fp8") == {
        "triton _rms_norm_kernel": 2, "torch _scaled_mm": 4, "triton _rotary_kv_kernel": 1,
        "triton _decode_split_kernel": 1, "triton _extend_kernel": 1, "triton _quantize_rows_kernel": 1,
        "triton _silu_and_mul_fp8_kernel": 1}
