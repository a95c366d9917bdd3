"""RMSNorm and the projection that takes its output, in one launch, for steps of a few tokens;
`gated`: the projection's gate and up halves through SiLU-and-mul in the same launch.

    residual' = residual + x          (x alone where residual is None: the first layer)
    y = rms_norm(residual') W^T (+ b)
    gated: y = silu(y[:, :I]) * y[:, I:]     (W [2I, K]: the gate rows, then the up rows)

Returns (y, residual'). A decode step of one request runs about ten kernels a layer, each of
which pays its ramp and its tail (docs/benchmarks.md, "Batch-1 decode"); this takes the two
RMSNorms and the SiLU-and-mul out of them, the q/k/v and gate/up projections streaming their
weights as a split-K kernel (fp8_linear's small-M one, for bf16 weights).

The norm's scale factors out of the dot product,

    y[m, n] = rstd[m] * sum_k W[n, k] (g[k] s[m, k]),   rstd[m] = rsqrt(mean_k s[m, k]^2 + eps),

so each program streams its K slice of W once, with s = x + residual loaded beside it (a few
rows: a sliver of the weight's bytes) and its sum of squares gathered in the same loop. Each
column block's last slice to finish (counted on a device counter, as decode attention merges
its chunks) adds the slices' sums and sums of squares, scales and stores. The programs of
column block 0 store residual' (a new tensor: the other blocks still read the old one).

The reference is the unfused path itself (add_rms_norm_ref, the projection, silu_and_mul_ref):
the CPU path and the oracle. The paths differ by rounding only: the reference rounds the
normalised row, then its product with g, to x's dtype (as transformers), the kernel rounds
g * s and applies rstd to the fp32 sums.
"""
import torch
import torch.nn.functional as F

from ._triton import cdiv, fast_launch, num_sms, tl, triton, zeroed_counters
from .rms_norm import add_rms_norm_ref, rms_norm_ref
from .silu_and_mul import silu_and_mul_ref

SMALL_M_MAX = 1  # the tokens a step sends here (llama.py): a GEMV, one request decoding
NUM_COUNTERS = 8192  # column blocks one split launch may have (8B gate/up in blocks of 32: 448)


def norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False):
    """(y, residual'): x, residual [M, K]; weight [N, K] (gated: N = 2I, y [M, I]); residual is
    not modified (residual' is a new tensor, or x itself when residual is None)."""
    if residual is None:
        residual, h = x, rms_norm_ref(x, norm_weight, eps)
    else:
        residual = residual.clone()
        h = add_rms_norm_ref(x, residual, norm_weight, eps)
    y = F.linear(h, weight, bias)
    return (silu_and_mul_ref(y) if gated else y), residual


def norm_linear_plan(m: int, n: int, k: int, gated: bool, sms: int, block_n: int | None = None,
                     block_k: int = 128, waves: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, splits): columns of the output per program (gated: that many gate and
    as many up rows of W), and K cut into `splits` equal slices, whole BLOCK_Ks, until there are
    about `waves` programs per SM. Gated layers are wide (8B: I = 14336 in blocks of 32, 448
    programs): K stays whole and nothing is summed across programs."""
    if block_n is None:
        block_n = 16 if gated else 32
    col_blocks = cdiv(n, block_n)
    k_blocks = cdiv(k, block_k)
    splits = max(1, min(k_blocks, cdiv(waves * sms, col_blocks)))
    splits = cdiv(k_blocks, cdiv(k_blocks, splits))  # equal slices, none empty
    return block_n, block_k, splits


@triton.jit
def _finish(y, y_up, ss, b_ptr, out_ptr, cols, col_mask, n, k, eps, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """Scale the fp32 sums by rstd, add the bias, (gated) SiLU-and-mul, store."""
    rstd = tl.rsqrt(ss / k + eps)
    y = y * rstd
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if GATED:  # gate and up rounded to the output's dtype first, as silu_and_mul_ref takes them
        gate = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = (y_up * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)


@fast_launch
@triton.jit
def _norm_linear_kernel(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, part_ptr, ss_ptr, out_ptr, res_out_ptr, counters_ptr,
                        n, k, k_per_split, splits, eps, w_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """One column block of one row over one K slice, as a GEMV: each thread multiplies its part of
    the [BLOCK_N, BLOCK_K] weight tile by the normed row's slice and keeps the products, summed over
    K only after the loop (no reduction, shared memory or barrier inside it, so the weight loads
    stream). n: output columns (gated: I; W's up rows start at row n). SPLIT: the slice's sums go to
    part [splits, (2,) n] and its sum of squares to ss [column blocks, splits]; the column block's
    last slice to count itself done adds them up and finishes."""
    col_block, split = tl.program_id(0), tl.program_id(1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    w_rows = w_ptr + cols[:, None].to(tl.int64) * w_stride
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, k), BLOCK_K):
        kk = k0 + ks
        k_mask = kk < k
        s = tl.load(x_ptr + kk, mask=k_mask, other=0.0)
        if HAS_RES:  # the sum rounded to the residual's dtype, stored once (column block 0), then normalised
            s = (s.to(tl.float32) + tl.load(res_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)).to(
                res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + kk, s, mask=kk < tl.where(col_block == 0, k, 0))
        s = s.to(tl.float32)
        squares += s * s
        a = (s * tl.load(g_ptr + kk, mask=k_mask, other=0.0).to(tl.float32))[None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        acc += tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0).to(tl.float32) * a
        if GATED:
            acc_up += tl.load(w_rows + n * w_stride + kk[None, :], mask=w_mask, other=0.0).to(tl.float32) * a
    y = tl.sum(acc, axis=1)
    y_up = tl.sum(acc_up, axis=1)
    ss = tl.sum(squares, axis=0)
    if SPLIT:
        per_split = n * (2 if GATED else 1)
        tl.store(part_ptr + split * per_split + cols, y, mask=col_mask)
        if GATED:
            tl.store(part_ptr + split * per_split + n + cols, y_up, mask=col_mask)
        tl.store(ss_ptr + col_block * splits + split, ss)
        tl.debug_barrier()  # every thread's stores before the count (the atomic releases them)
        counter = counters_ptr + col_block
        if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:  # the last slice done: add them up
            tl.store(counter, 0)  # every slice has counted: ready for the next launch
            tl.debug_barrier()  # the other slices' sums, acquired, before any thread reads them
            total = tl.zeros([BLOCK_N], tl.float32)
            total_up = tl.zeros([BLOCK_N], tl.float32)
            total_ss = 0.0
            for i in range(0, splits):  # L1 may hold none of them: bypass it
                total += tl.load(part_ptr + i * per_split + cols, mask=col_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    total_up += tl.load(part_ptr + i * per_split + n + cols, mask=col_mask, other=0.0,
                                        cache_modifier=".cg")
                total_ss += tl.load(ss_ptr + col_block * splits + i, cache_modifier=".cg")
            _finish(total, total_up, total_ss, b_ptr, out_ptr, cols, col_mask, n, k, eps, HAS_BIAS, GATED)
    else:
        _finish(y, y_up, ss, b_ptr, out_ptr, cols, col_mask, n, k, eps, HAS_BIAS, GATED)


def norm_linear_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                       plan: tuple[int, int, int] | None = None, num_warps: int = 4, num_stages: int = 3):
    """norm_linear_ref's result in one launch, for one row (SMALL_M_MAX); `plan`
    (norm_linear_plan's) overrides the choice."""
    m, k = x.shape
    assert m <= SMALL_M_MAX and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert not (gated and bias is not None), "a gated projection has no bias here"
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    block_n, block_k, splits = plan or norm_linear_plan(m, n, k, gated, num_sms(x.device, elsewhere=4))
    split = splits > 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    has_res = residual is not None
    if has_res:
        assert residual.stride(-1) == 1
        res_out = torch.empty_like(x)
    else:
        residual = res_out = x  # unread, unwritten
    col_blocks = cdiv(n, block_n)
    if split:
        assert col_blocks <= NUM_COUNTERS
        part = torch.empty(splits, 2 if gated else 1, n, dtype=torch.float32, device=x.device)
        ss = torch.empty(col_blocks, splits, dtype=torch.float32, device=x.device)
        counters = zeroed_counters("norm_linear", NUM_COUNTERS, x.device)
    else:  # K whole: the partials are never touched
        part = ss = counters = out
    _norm_linear_kernel[(col_blocks, splits)](
        x, residual, norm_weight, weight, bias if bias is not None else out, part, ss, out, res_out, counters, n, k,
        cdiv(cdiv(k, block_k), splits) * block_k, splits, eps, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT=split, HAS_RES=has_res, HAS_BIAS=bias is not None, GATED=gated, num_warps=num_warps,
        num_stages=num_stages)
    return out, res_out
