"""Counter-based uniform random numbers for seeded sampling, bit-identical on CPU and GPU.

u[b, c] depends only on (seeds[b], steps[b], c): a request's random stream never depends on
the batch it runs in. The hash is murmur3's fmix32 applied to a Weyl sequence, done in int64
with every product split into 16-bit halves, so no step can overflow and torch (any device)
and Triton produce the same bits without relying on wrapping arithmetic.
"""
import torch

from ._triton import tl, triton

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


def random_uniform_triton(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    raise NotImplementedError
