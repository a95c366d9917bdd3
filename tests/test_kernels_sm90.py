"""Every Triton kernel the layers and the sampler launch compiles for the H100 (sm90) on this CPU
machine (test/benchmark/kernels/compile_sm90.py, run without the interpreter that conftest.py turns on):
the other kernel tests run the kernels in Triton's interpreter, which accepts code the GPU compiler
may refuse."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BENCHMARK

nvidia = pytest.importorskip("triton.backends.nvidia")
if not (Path(nvidia.__file__).parent / "bin" / "ptxas").exists() and not os.environ.get("TRITON_PTXAS_PATH"):
    pytest.skip("Triton's wheel has no ptxas here", allow_module_level=True)

TOOL = BENCHMARK / "kernels" / "compile_sm90.py"
KERNELS = {"_rms_norm_kernel", "_silu_and_mul_kernel", "_silu_and_mul_fp8_kernel", "_quantize_rows_kernel",
           "_fp8_gemm_small_m_kernel", "_rotary_kv_kernel", "_decode_split_kernel",
           "_extend_kernel", "_apply_penalties_kernel", "_random_uniform_kernel", "_greedy_sample_kernel",
           "_moe_gate_up_kernel", "_moe_down_kernel", "_align_kernel", "_align_count_kernel", "_align_runs_kernel",
           "_align_place_kernel", "_one_shot_add_rms_norm_kernel", "_shrink_kernel", "_expand_kernel",
           "_gated_delta_rule_step_kernel", "_causal_conv1d_step_kernel", "_causal_conv1d_chunks_kernel",
           "_gated_delta_rule_runs_kernel", "_gated_rms_norm_kernel", "_causal_conv1d_blocks_kernel",
           "_chunk_states_in_kernel", "_chunk_states_out_kernel", "_l2norm_heads_kernel", "_linear_gates_kernel"}


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(TOOL)], env=env, capture_output=True, text=True, timeout=600)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert all(line.startswith("OK ") for line in lines), done.stdout
    assert {re.match(r"OK\s+(\w+)\(", line).group(1) for line in lines} == KERNELS
    # both KV cache dtypes, and decode attention split (merged by its last chunk; two requests, then four) and whole;
    # a windowed, capped layer; Gemma 4's 512-dim heads (every decode plan over bf16, one over fp8, extend over
    # both), their tiles shrunk to the shared memory (the tool fails a kernel that takes more)
    assert sum("_rotary_kv_kernel(" in line for line in lines) == 4
    # the LoRA share's variants: the norm alone and after partial sums, the activation, rotary
    assert sum("HAS_EXTRA=True" in line for line in lines) == 4
    assert sum("_decode_split_kernel(" in line for line in lines) == 11
    assert sum("_extend_kernel(" in line and "HEAD_DIM=512" in line and "BLOCK_M=64" in line for line in lines) == 2
    assert sum("_extend_kernel(" in line and "WINDOW=256" in line for line in lines) == 1
    assert sum("_silu_and_mul_kernel(" in line and "GELU=True" in line for line in lines) == 1
    # the fused MoE's decode and prefill plans, with bf16 and fp8 experts, fp32 ones with the large plan,
    # and fp8 experts under fp32 activations (K blocks of 32: fp8 tensor cores take none smaller)
    # and MXFP4 experts at gpt-oss's shapes, decode and prefill
    assert sum("_moe_gate_up_kernel(" in line for line in lines) == 11
    assert sum("_moe_down_kernel(" in line for line in lines) == 11
    assert sum("_moe_down_kernel(" in line and "MXFP4=True" in line for line in lines) == 3
    assert sum("_moe_gate_up_kernel(" in line and "FP8=True" in line and "BLOCK_K=32" in line for line in lines) == 1
