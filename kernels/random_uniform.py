"""Counter-based uniform random numbers for seeded sampling, bit-identical on CPU and GPU.

u[b, c] depends only on (seeds[b], steps[b], c): a request's random stream never depends on
the batch it runs in. The hash is murmur3's fmix32 applied to a Weyl sequence, done in int64
with every product split into 16-bit halves, so no step can overflow and torch (any device)
and Triton produce the same bits without relying on wrapping arithmetic.
"""
import torch

from ._triton import cdiv, fast_launch, tl, triton

# murmur3 fmix32 multipliers and the golden-ratio Weyl increment, as (high 16, low 16) bits.
_MIX1 = (0x85EB, 0xCA6B)
_MIX2 = (0xC2B2, 0xAE35)
_GOLDEN = (0x9E37, 0x79B9)
_INV_2_24 = 1.0 / (1 << 24)


def _mod32_ref(x: torch.Tensor) -> torch.Tensor:
    return x - ((x >> 32) << 32)  # x mod 2^32 for any int64, with an arithmetic shift


def _mul32_ref(a: torch.Tensor, m: tuple[int, int]) -> torch.Tensor:
    """(a * m) mod 2^32 for 0 <= a < 2^32; every partial product stays below 2^48."""
    high = ((a * m[0]) & 0xFFFF) << 16
    return _mod32_ref(a * m[1] + high)


def _fmix32_ref(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32_ref(h, _MIX1)
    h = h ^ (h >> 13)
    h = _mul32_ref(h, _MIX2)
    return h ^ (h >> 16)


def _row_key_ref(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    key = _fmix32_ref(_mod32_ref(seeds))
    key = _fmix32_ref(key ^ _mod32_ref(seeds >> 32))
    key = _fmix32_ref(key ^ _mod32_ref(steps))
    return _fmix32_ref(key ^ _mod32_ref(steps >> 32))


def random_uniform_ref(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """u [B, vocab] fp32 in the open interval (0, 1): odd multiples of 2^-24."""
    key = _row_key_ref(seeds.long(), steps.long())[:, None]
    cols = torch.arange(1, vocab + 1, device=seeds.device, dtype=torch.int64)[None, :]
    h = _fmix32_ref(_mod32_ref(key + _mul32_ref(cols, _GOLDEN)))
    return ((h >> 9) * 2 + 1).float() * _INV_2_24


@triton.jit
def _mod32(x):
    return x - ((x >> 32) << 32)


@triton.jit
def _mul32(a, m_high, m_low):
    return _mod32(a * m_low + (((a * m_high) & 0xFFFF) << 16))


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EB, 0xCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2, 0xAE35)
    return h ^ (h >> 16)


@fast_launch
@triton.jit
def _random_uniform_kernel(seeds_ptr, steps_ptr, u_ptr, vocab, u_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    step = tl.load(steps_ptr + row).to(tl.int64)
    key = _fmix32(_mod32(seed))
    key = _fmix32(key ^ _mod32(seed >> 32))
    key = _fmix32(key ^ _mod32(step))
    key = _fmix32(key ^ _mod32(step >> 32))
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _fmix32(_mod32(key + _mul32((cols + 1).to(tl.int64), 0x9E37, 0x79B9)))
    u = ((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2^-24, exact
    tl.store(u_ptr + row * u_stride + cols, u, mask=cols < vocab)


def random_uniform_triton(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    u = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    block = 1024
    _random_uniform_kernel[(seeds.shape[0], cdiv(vocab, block))](seeds, steps, u, vocab, u.stride(0),
                                                                        BLOCK=block, num_warps=4)
    return u
