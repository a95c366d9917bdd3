"""Triton kernels, each beside its plain-torch reference (imported as `lightllm.kernels`:
setup.py maps the folder there, lightllm/__init__.py does so in a checkout that is not installed).

Every operation lives in `<op>.py` as `<op>_ref` (torch; the CPU path and the test oracle)
and `<op>_triton` (same signature). The public `<op>` runs Triton on CUDA tensors and the
reference on anything else.
"""


def _hand_over_the_name() -> bool:
    """Imported as the top-level `kernels` (the checkout's root on sys.path: `python -m` run from it,
    PYTHONPATH=.), where something asked for the PyPI package of that name (transformers >= 5.25
    imports it): put that package, found on the rest of the path, in this module's place; True if
    there is one. Where there is none this folder goes on under that name, as it always has (its
    version, none, tells transformers it is not that package)."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.realpath(p or os.curdir) != checkout])
    if spec is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # what the import statement returns: the module in sys.modules at its end
    spec.loader.exec_module(module)
    return True


if __name__ != "kernels" or not _hand_over_the_name():
    import functools
    from typing import Callable

    from .apply_penalties import apply_penalties_ref, apply_penalties_triton
    from .decode_attention import decode_attention_ref, decode_attention_triton
    from .extend_attention import extend_attention_ref, extend_attention_triton
    from .fused_moe import fused_moe_ref, fused_moe_triton, route_topk
    from .fp8_linear import fp8_gemm_ref, fp8_gemm_triton, fp8_linear_ref, fp8_linear_triton
    from .lora import lora_expand_ref, lora_expand_triton, lora_segments, lora_shrink_ref, lora_shrink_triton
    from .greedy_sample import greedy_sample_ref, greedy_sample_triton
    from .random_uniform import random_uniform_ref, random_uniform_triton
    from .rms_norm import (add_rms_norm_ref, add_rms_norm_triton, gated_rms_norm_ref, gated_rms_norm_triton,
                           rms_norm_ref, rms_norm_triton)
    from .rotary_kv import rotary_kv_ref, rotary_kv_triton
    # Gated DeltaNet (the hybrid models): the varlen forms (host bounds, states in and out) are the math the
    # chunks' references (states in a pool, bounds on the device) run
    from .causal_conv1d import (causal_conv1d_chunks_ref, causal_conv1d_chunks_triton, causal_conv1d_runs_ref,
                                causal_conv1d_runs_triton, causal_conv1d_step_ref, causal_conv1d_step_triton)
    from .causal_conv1d import causal_conv1d_varlen_ref as causal_conv1d_varlen
    from .gated_delta_rule import gated_delta_rule_varlen_ref as gated_delta_rule_varlen
    from .gated_delta_rule import (gated_delta_rule_chunks_fla, gated_delta_rule_chunks_ref,
                                   gated_delta_rule_runs_ref, gated_delta_rule_runs_triton, gated_delta_rule_step_ref,
                                   gated_delta_rule_step_triton, linear_gates_ref, linear_gates_triton, require_fla)
    from .silu_and_mul import gelu_tanh_and_mul_ref, gelu_tanh_and_mul_triton, silu_and_mul_ref, silu_and_mul_triton


    def _by_device(ref: Callable, triton_fn: Callable) -> Callable:
        """Dispatch on the first argument's device: CUDA -> Triton, anything else -> reference."""

        @functools.wraps(ref)
        def op(first, *args, **kwargs):
            impl = triton_fn if first.is_cuda else ref
            return impl(first, *args, **kwargs)

        op.__name__ = op.__qualname__ = ref.__name__.removesuffix("_ref")
        return op


    rms_norm = _by_device(rms_norm_ref, rms_norm_triton)
    add_rms_norm = _by_device(add_rms_norm_ref, add_rms_norm_triton)
    gated_rms_norm = _by_device(gated_rms_norm_ref, gated_rms_norm_triton)
    linear_gates = _by_device(linear_gates_ref, linear_gates_triton)
    rotary_kv_ = _by_device(rotary_kv_ref, rotary_kv_triton)
    extend_attention = _by_device(extend_attention_ref, extend_attention_triton)
    decode_attention = _by_device(decode_attention_ref, decode_attention_triton)
    silu_and_mul = _by_device(silu_and_mul_ref, silu_and_mul_triton)
    gelu_tanh_and_mul = _by_device(gelu_tanh_and_mul_ref, gelu_tanh_and_mul_triton)
    apply_penalties_ = _by_device(apply_penalties_ref, apply_penalties_triton)
    random_uniform = _by_device(random_uniform_ref, random_uniform_triton)
    greedy_sample = _by_device(greedy_sample_ref, greedy_sample_triton)
    fp8_linear = _by_device(fp8_linear_ref, fp8_linear_triton)
    fp8_gemm = _by_device(fp8_gemm_ref, fp8_gemm_triton)
    fused_moe = _by_device(fused_moe_ref, fused_moe_triton)
    causal_conv1d_step = _by_device(causal_conv1d_step_ref, causal_conv1d_step_triton)
    gated_delta_rule_step = _by_device(gated_delta_rule_step_ref, gated_delta_rule_step_triton)
    causal_conv1d_chunks = _by_device(causal_conv1d_chunks_ref, causal_conv1d_chunks_triton)
    causal_conv1d_runs = _by_device(causal_conv1d_runs_ref, causal_conv1d_runs_triton)
    gated_delta_rule_runs = _by_device(gated_delta_rule_runs_ref, gated_delta_rule_runs_triton)
    # fla's kernels on CUDA
    gated_delta_rule_chunks = _by_device(gated_delta_rule_chunks_ref, gated_delta_rule_chunks_fla)
    lora_shrink = _by_device(lora_shrink_ref, lora_shrink_triton)
    lora_expand_ = _by_device(lora_expand_ref, lora_expand_triton)

    __all__ = [
        "rms_norm", "add_rms_norm", "gated_rms_norm", "rotary_kv_", "extend_attention", "decode_attention",
        "silu_and_mul", "gelu_tanh_and_mul", "apply_penalties_", "random_uniform", "greedy_sample", "fp8_linear",
        "fp8_gemm", "fused_moe", "route_topk", "causal_conv1d_varlen", "causal_conv1d_chunks", "causal_conv1d_step",
        "causal_conv1d_runs", "gated_delta_rule_varlen", "gated_delta_rule_chunks", "gated_delta_rule_step",
        "gated_delta_rule_runs", "linear_gates", "require_fla",
        "lora_shrink", "lora_expand_", "lora_segments",
    ]
