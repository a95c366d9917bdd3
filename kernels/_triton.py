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

__all__ = ["HAS_TRITON", "triton", "tl"]
