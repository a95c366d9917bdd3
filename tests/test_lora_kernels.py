"""LoRA's segmented shrink and expand (kernels/lora.py): the Triton kernels against the torch
reference, and the reference against a per-row computation, on a batch that mixes adapters, rows
of no adapter and slots no row uses. Tiny shapes: the CPU runs Triton's interpreter."""
import os

import pytest
import torch

from lightllm.kernels import lora as lora_kernels
from lightllm.kernels.lora import (BLOCK_ROWS, LARGE_BLOCK_ROWS, block_rows, lora_expand_ref, lora_expand_triton,
                                   lora_segments, lora_shrink_ref, lora_shrink_triton, max_row_blocks)

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
    rows, starts, blocks, rows_per_block = lora_segments(slots, 4)
    assert rows_per_block == BLOCK_ROWS
    assert starts.tolist() == [0, 2, 3, 5, 5]
    assert blocks.tolist() == [0, 1, 2, 3, 3]  # one row block each for slots 0-2, none for slot 3
    assert rows.tolist()[:5] == [2, 4, 6, 0, 3] and sorted(rows.tolist()[5:]) == [1, 5]


@pytest.mark.parametrize("tokens,num_slots", [(1, 16), (7, 3), (40, 3), (256, 16), (300, 4), (1100, 16)])
def test_max_row_blocks_bounds_every_mix(tokens, num_slots):
    """The grid fits the blocks of any mix: the worst ones leave each used slot's last block
    nearly empty, and a mix over fewer slots never needs more."""
    grid = max_row_blocks(tokens, num_slots)
    for _ in range(50):
        used = torch.randint(1, num_slots + 1, ()).item()
        slots = torch.randint(-1, used, (tokens,))
        assert lora_segments(slots, num_slots).blocks[-1].item() <= grid
    worst = [s for s in range(min(tokens, num_slots)) for _ in range(block_rows(tokens) + 1)][:tokens]
    slots = torch.tensor(worst + [0] * (tokens - len(worst)))
    assert lora_segments(slots, num_slots).blocks[-1].item() <= grid


def test_reference_applies_each_rows_adapter():
    slots, x, a, b, y = mixed_batch(23, 4, 8, 32, 40)
    seg = lora_segments(slots, 4)
    s = lora_shrink_ref(x, a, seg)
    got = lora_expand_ref(y.clone(), s, b, seg)
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
    seg = lora_segments(slots, 3)
    expected_s = lora_shrink_ref(x, a, seg)
    s = lora_shrink_triton(x, a, seg, splits)
    assert s.shape == (splits or 1, 37, rank) and expected_s.shape == (1, 37, rank)
    used = slots >= 0  # rows of no adapter are never written
    torch.testing.assert_close(s.sum(0)[used], expected_s[0, used], **FP32_TOL)  # fp32 sums either way
    expected = lora_expand_ref(y.clone(), expected_s, b, seg)
    for partial_sums in (expected_s, s):
        got = lora_expand_triton(y.clone(), partial_sums, b, seg)
        assert_close(got, expected, dtype)
        assert torch.equal(got[~used], y[~used])


UNEVEN = {  # slot of each row, shuffled: a slot of many rows beside slots of one, empty slots, rows of none
    "uneven": [0] * 35 + [3] + [5] * 17 + [-1] * 6 + [6],
    "one slot, the last": [6] * 19,
    "no adapter": [-1] * 21,
    "one row": [4],
}


@pytest.mark.parametrize("plan", ["small", "large"])
@pytest.mark.parametrize("case", list(UNEVEN))
def test_row_blocks_find_their_slot(case, plan, monkeypatch):
    """The grid over the step's row blocks: each block finds its slot (empty slots have no blocks,
    blocks past the step's leave), on very uneven counts; the shrink's partial sums too. "large":
    the plan of large steps (blocks of LARGE_BLOCK_ROWS rows, wider expand tiles) at these sizes."""
    if plan == "large":
        monkeypatch.setattr(lora_kernels, "LARGE_ROWS", 1)
    slots = torch.tensor(UNEVEN[case], device=DEVICE)
    slots = slots[torch.randperm(len(slots), device=DEVICE)]
    tokens, num_slots, rank, k, n = len(slots), 7, 8, 64, 40
    x, y = torch.randn(tokens, k, device=DEVICE), torch.randn(tokens, n, device=DEVICE)
    a, b = torch.randn(num_slots, rank, k, device=DEVICE), torch.randn(num_slots, n, rank, device=DEVICE)
    seg = lora_segments(slots, num_slots)
    assert seg.block_rows == (LARGE_BLOCK_ROWS if plan == "large" else BLOCK_ROWS)
    expected = per_row(slots, x, a, b, y)
    for splits in (1, 2):
        got = lora_expand_triton(y.clone(), lora_shrink_triton(x, a, seg, splits), b, seg)
        torch.testing.assert_close(got, expected, **FP32_TOL)


@pytest.mark.skipif(DEVICE == "cpu", reason="streams and CUDA graphs need a GPU")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shrink_beside_the_gemm_gives_the_in_place_result(dtype, graph):
    """models/lora.py's `shrink_beside` (the shrink on a second stream while the base GEMM runs, the
    expand after both) gives bit for bit what the shrink and expand after the GEMM give, rows of no
    adapter untouched; also inside a CUDA graph, the two streams its two branches."""
    from lightllm.models.lora import shrink_beside

    slots, x, a, b, y = mixed_batch(37, 3, 8, 64, 40, dtype)
    w = torch.randn(40, 64, device=DEVICE).to(dtype)
    seg = lora_segments(slots, 3)
    expected = lora_expand_triton(x @ w.T, lora_shrink_triton(x, a, seg), b, seg)
    stream = torch.cuda.Stream()

    def beside():
        s = shrink_beside(x, a, seg, stream)
        torch.matmul(x, w.T, out=y)  # the base GEMM, queued after the shrink
        torch.cuda.current_stream().wait_stream(stream)
        lora_expand_triton(y, s, b, seg)

    beside()  # eager, and the warm-up of a capture: Triton compiles outside it
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            beside()
        y.zero_()
        captured.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expected)
    assert torch.equal(y[slots < 0], (x @ w.T)[slots < 0])
