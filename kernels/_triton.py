"""Guarded Triton import: `import lightllm_kernels` must work where Triton is missing.

Without Triton the `@triton.jit` kernels are still defined (so the modules import and the
torch references stay usable) but calling one raises a clear error.
"""
import logging

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _MissingTriton:
        """Stands in for both `triton` and `triton.language` when Triton is not installed."""

        constexpr = None  # only used as an annotation

        @staticmethod
        def jit(fn=None, **_kwargs):
            def unavailable(*_args, **_kw):
                raise RuntimeError("Triton is not installed; use the *_ref torch functions")

            return unavailable if fn is not None else (lambda f: unavailable)

        def __getattr__(self, name):
            raise RuntimeError(f"Triton is not installed (needed for triton.{name})")

    triton = tl = _MissingTriton()
    logger.info("triton not importable: kernels fall back to the torch references")

LOG2E = 1.4426950408889634  # attention kernels use exp2: exp(x) = exp2(x * LOG2E)


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST (set for CPU tensors, i.e. under TRITON_INTERPRET)
    multiplies in fp32 because the interpreter multiplies bf16 blocks as their raw uint16 bits."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")  # ieee only affects fp32 inputs: no TF32 rounding


__all__ = ["HAS_TRITON", "LOG2E", "dot", "triton", "tl"]
