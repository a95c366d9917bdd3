"""LoRA's segmented shrink and expand (kernels/lora.py): the Triton kernels against the torch
reference, and the reference against a per-row computation, on a batch that mixes adapters, rows
of no adapter and slots no row uses. Tiny shapes: the CPU runs Triton's interpreter."""
import os

import pytest
import torch

from lightllm.kernels.lora import (lora_expand_ref, lora_expand_triton, lora_segments, lora_shrink_ref,
                                   lora_shrink_triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


def mixed_batch(tokens: int, num_slots: int, rank: int, k: int, n: int, dtype=torch.float32):
    slots = torch.randint(-1, num_slots - 1, (tokens,), device=DEVICE)  # the last slot stays unused
    x = torch.randn(tokens, k, device=DEVICE).to(dtype)
    a = torch.randn(num_slots, rank, k, device=DEVICE).to(dtype)
    b = torch.randn(num_slots, n, rank, device=DEVICE).to(dtype)
    y = torch.randn(tokens, n, device=DEVICE).to(dtype)
    return slots, x, a, b, y


def per_row(slots, x, a, b, y):
    """Each row through its own slot's A and B, one at a time."""
    out = y.clone().float()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] += (x[t].float() @ a[slot].float().T) @ b[slot].float().T
    return out


def test_segments_group_rows_by_slot():
    slots = torch.tensor([2, -1, 0, 2, 0, -1, 1], device=DEVICE)
    rows, starts = lora_segments(slots, 4)
    assert starts.tolist() == [0, 2, 3, 5, 5]
    assert rows.tolist()[:5] == [2, 4, 6, 0, 3] and sorted(rows.tolist()[5:]) == [1, 5]


def test_reference_applies_each_rows_adapter():
    slots, x, a, b, y = mixed_batch(23, 4, 8, 32, 40)
    rows, starts = lora_segments(slots, 4)
    s = lora_shrink_ref(x, a, rows, starts)
    got = lora_expand_ref(y.clone(), s, b, rows, starts)
    torch.testing.assert_close(got, per_row(slots, x, a, b, y), atol=1e-4, rtol=1e-4)


FP32_TOL = dict(atol=1e-4, rtol=1e-4)  # summation order only


def assert_close(got, expected, dtype):
    """bf16: the expand multiplies s rounded to bf16, and s summed in another order rounds to another
    bf16 value at times (an ulp, 1/128 relative), so each output may move by a few ulps of the largest."""
    tol = FP32_TOL if dtype == torch.float32 else dict(atol=2e-2 * expected.abs().max().item(), rtol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,k,n,splits", [(8, 72, 40, None), (24, 64, 130, None), (8, 200, 40, 3)])
def test_triton_matches_reference(rank, k, n, splits, dtype):
    """Splits 3: the shrink's partial sums over slices of K (the last one shorter), added up by the expand."""
    slots, x, a, b, y = mixed_batch(37, 3, rank, k, n, dtype)
    rows, starts = lora_segments(slots, 3)
    expected_s = lora_shrink_ref(x, a, rows, starts)
    s = lora_shrink_triton(x, a, rows, starts, splits)
    assert s.shape == (splits or 1, 37, rank) and expected_s.shape == (1, 37, rank)
    used = slots >= 0  # rows of no adapter are never written
    torch.testing.assert_close(s.sum(0)[used], expected_s[0, used], **FP32_TOL)  # fp32 sums either way
    expected = lora_expand_ref(y.clone(), expected_s, b, rows, starts)
    for partial_sums in (expected_s, s):
        got = lora_expand_triton(y.clone(), partial_sums, b, rows, starts)
        assert_close(got, expected, dtype)
        assert torch.equal(got[~used], y[~used])
