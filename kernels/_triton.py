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


@triton.jit
def attend_kv_block(q, m_i, l_i, acc, k_ptr, v_ptr, token_row, cols, col_mask, allowed, kv_head, dims, dim_mask,
                    k_slot_stride, k_head_stride, v_slot_stride, v_head_stride, scale_log2,
                    DOT_UPCAST: tl.constexpr):
    """One step of the online softmax over a block of keys gathered through the token table:
    the queries' running max m_i, sum l_i and output acc, updated with keys `cols` (valid where
    col_mask) where `allowed` [rows, cols] lets a query see a key. Shared by the attention kernels."""
    slots = tl.load(token_row + cols, mask=col_mask, other=0).to(tl.int64)  # entries past the length may be unset
    k = tl.load(k_ptr + slots[None, :] * k_slot_stride + kv_head * k_head_stride + dims[:, None],
                mask=col_mask[None, :] & dim_mask[:, None], other=0.0)
    scores = tl.where(allowed, dot(q, k, DOT_UPCAST) * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    v = tl.load(v_ptr + slots[:, None] * v_slot_stride + kv_head * v_head_stride + dims[None, :],
                mask=col_mask[:, None] & dim_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_UPCAST)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


__all__ = ["HAS_TRITON", "LOG2E", "attend_kv_block", "dot", "triton", "tl"]
