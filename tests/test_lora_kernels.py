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


# fp32: summation order only. bf16: each output rounded to bf16 (the interpreter rounds toward zero
# where torch rounds to nearest: an ulp more), over sums of tens of products of unit normals.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=0.25, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,k,n", [(8, 72, 40), (24, 64, 130)])
def test_triton_matches_reference(rank, k, n, dtype):
    slots, x, a, b, y = mixed_batch(37, 3, rank, k, n, dtype)
    rows, starts = lora_segments(slots, 3)
    expected_s = lora_shrink_ref(x, a, rows, starts)
    s = lora_shrink_triton(x, a, rows, starts)
    used = slots >= 0  # rows of no adapter are never written
    torch.testing.assert_close(s[used].float(), expected_s[used].float(), **TOL[dtype])
    expected = lora_expand_ref(y.clone(), expected_s, b, rows, starts)
    got = lora_expand_triton(y.clone(), expected_s, b, rows, starts)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])
    assert torch.equal(got[~used], y[~used])
