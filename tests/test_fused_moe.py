"""The fused MoE kernels against their torch reference under ragged expert loads, the reference
against transformers' Mixtral and Qwen3-MoE blocks, and the routing and alignment invariants.
Without a GPU the Triton kernels run in the interpreter (conftest.py); shapes are tiny."""
import os

import importlib

import pytest
import torch

from lightllm.kernels.fused_moe import (DECODE_PLAN, MoEPlan, align_by_expert_ref, align_by_expert_triton,
                                        descriptor_fits, fused_moe_ref, fused_moe_triton, interleave_gate_up,
                                        padded_pairs_bound, quantize_experts_fp8, route_topk)

# the package's public `fused_moe` function shadows the submodule of the same name
fused_moe_module = importlib.import_module("lightllm.kernels.fused_moe")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: summation order only. bf16: gate/up, the product and each expert's output are rounded to
# bf16 on both paths, but at different points of an fp32 sum (and the interpreter rounds toward
# zero), so a few ulps of 2^-8.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
HIDDEN, INTER = 40, 48  # neither a multiple of the blocks: masked columns and K tails


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


def experts(num_experts, dtype, hidden=HIDDEN, inter=INTER):
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, inter, device=DEVICE) / inter ** 0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def random_routing(tokens, num_experts, top_k):
    """Distinct experts per token (as top-k gives) with weights that sum to 1."""
    ids = torch.rand(tokens, num_experts, device=DEVICE).argsort(dim=1)[:, :top_k].to(torch.int32)
    return torch.softmax(torch.randn(tokens, top_k, device=DEVICE), dim=1), ids


def skewed_routing(tokens, num_experts, top_k, hot=0):
    """Every token's first choice is expert `hot`; the others come from the lower half of the rest,
    so the upper experts get no tokens at all."""
    cold = torch.arange(num_experts, device=DEVICE)
    cold = cold[cold != hot][: max(top_k - 1, (num_experts - 1) // 2)]
    rest = cold[torch.rand(tokens, len(cold), device=DEVICE).argsort(dim=1)[:, : top_k - 1]]
    ids = torch.cat([torch.full((tokens, 1), hot, device=DEVICE), rest], dim=1).to(torch.int32)
    return torch.softmax(torch.randn(tokens, top_k, device=DEVICE), dim=1), ids


def assert_triton_matches_ref(x, w_gate_up, w_down, weights, ids, plan=None):
    expected = fused_moe_ref(x, w_gate_up, w_down, weights, ids)
    actual = fused_moe_triton(x, w_gate_up, w_down, weights, ids, plan=plan)
    assert actual.dtype == x.dtype and actual.shape == x.shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 4, 1), (5, 8, 2), (19, 8, 8), (3, 16, 8)])
def test_fused_moe_triton_matches_ref(dtype, tokens, num_experts, top_k):
    x = torch.randn(tokens, HIDDEN, device=DEVICE).to(dtype)
    assert_triton_matches_ref(x, *experts(num_experts, dtype), *random_routing(tokens, num_experts, top_k))


@pytest.mark.parametrize("chunked", [False, True], ids=["one-launch alignment", "chunked alignment"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_fused_moe_one_expert_takes_every_token_and_some_take_none(top_k, chunked, monkeypatch):
    """Expert 3 gets all 40 tokens (three blocks of 16, the last one ragged); the upper half of
    the experts get none, so their blocks are absent and the padding past them is skipped.
    chunked: the prefill's alignment (ids in chunks of 16)."""
    if chunked:
        monkeypatch.setattr(fused_moe_module, "ALIGN_BLOCK", 16)
        monkeypatch.setattr(fused_moe_module, "ALIGN_ONE_LAUNCH_PAIRS", 0)
    num_experts, tokens = 16, 40
    weights, ids = skewed_routing(tokens, num_experts, top_k, hot=3)
    counts = torch.bincount(ids.flatten().long(), minlength=num_experts)
    assert counts[3] == tokens and (counts[num_experts // 2 + 1:] == 0).all()
    x = torch.randn(tokens, HIDDEN, device=DEVICE)
    assert_triton_matches_ref(x, *experts(num_experts, torch.float32), weights, ids, plan=DECODE_PLAN)


def test_fused_moe_prefill_sized_blocks():
    """Row blocks of 64, columns of 32 and K blocks of 16: several K steps, one block per
    expert with most rows padding."""
    x = torch.randn(24, HIDDEN, device=DEVICE)
    plan = MoEPlan(block_m=64, block_n=32, block_k=16, num_warps=4, num_stages=2)
    assert_triton_matches_ref(x, *experts(4, torch.float32), *random_routing(24, 4, 2), plan=plan)


def test_moe_plan_grows_its_row_block_with_the_groups():
    """Each plan's row block holds 1.5x the mean group up to the largest plan (128 rows, chosen by
    moe_bench --tune on the H100), which takes every larger group; 128-row blocks compute right."""
    from lightllm.kernels.fused_moe import LARGE_PLAN, moe_plan, moe_plans

    experts_n, blocks = 128, []
    for pairs in (8, 1024, 2048, 4096, 8192, 16384, 65536):
        plan = moe_plan(pairs, experts_n)
        blocks.append(plan.block_m)
        assert plan.block_m >= min(1.5 * pairs / experts_n, LARGE_PLAN.block_m)
    assert blocks == sorted(blocks) and blocks[-1] == LARGE_PLAN.block_m == 128
    for fp8 in (False, True):  # each kernel its own tuned plan, on the alignment's one row block
        gate_up, down = moe_plans(65536, experts_n, fp8)
        assert gate_up.block_m == down.block_m and moe_plans(8, experts_n, fp8) == (moe_plan(8, experts_n),) * 2
    x = torch.randn(40, HIDDEN, device=DEVICE)
    plan = MoEPlan(block_m=LARGE_PLAN.block_m, block_n=32, block_k=16, num_warps=4, num_stages=2)
    assert_triton_matches_ref(x, *experts(4, torch.float32), *random_routing(40, 4, 2), plan=plan)


@pytest.mark.parametrize("num_blocks,num_cols,group_m", [(7, 3, 0), (7, 3, 1), (7, 3, 3), (5, 4, 8), (1, 6, 4)])
def test_moe_tile_order_visits_every_tile_once_in_groups(num_blocks, num_cols, group_m):
    """moe_tile maps the 1-D grid onto every (row block, column tile) exactly once; with groups,
    the first group_m * num_cols programs are the first group_m blocks' every tile (a ragged last
    group included), the blocks of a group fastest."""
    from lightllm.kernels._triton import tl, triton

    @triton.jit
    def tiles(out_ptr, num_blocks, num_cols, GROUP_M: tl.constexpr):
        block, col_tile = fused_moe_module.moe_tile(num_blocks, num_cols, GROUP_M)
        tl.store(out_ptr + tl.program_id(0) * 2, block)
        tl.store(out_ptr + tl.program_id(0) * 2 + 1, col_tile)

    out = torch.full((num_blocks * num_cols, 2), -1, dtype=torch.int32, device=DEVICE)
    tiles[(num_blocks * num_cols,)](out, num_blocks, num_cols, GROUP_M=group_m)
    visited = [tuple(t) for t in out.tolist()]
    assert sorted(visited) == [(b, c) for b in range(num_blocks) for c in range(num_cols)]
    if group_m == 0:
        assert visited == [(b, c) for c in range(num_cols) for b in range(num_blocks)]
    else:
        for first in range(0, num_blocks, group_m):
            rows = min(group_m, num_blocks - first)
            group = visited[first * num_cols:(first + rows) * num_cols]
            assert group == [(first + b, c) for c in range(num_cols) for b in range(rows)]


@pytest.mark.parametrize("group_m", [1, 3])
def test_fused_moe_grouped_tile_order_matches_ref(group_m):
    """Both kernels in grouped order (several row blocks and column tiles, a ragged last group)
    give the reference's output."""
    x = torch.randn(33, HIDDEN, device=DEVICE)
    plan = MoEPlan(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2, group_m=group_m)
    assert_triton_matches_ref(x, *experts(4, torch.float32), *random_routing(33, 4, 2), plan=plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"])
def test_fused_moe_gate_up_weight_tiles_through_a_descriptor(dtype):
    """The gate/up kernel's weight tiles through a tensor descriptor (MoEPlan.tma): tiles of 2 x 32
    rows over each expert's 96 (I = 48), so the second column tile reads 32 rows of the next expert
    (the last expert's: past the end, zeros), which must only fill masked columns; H = 48 with K
    blocks of 32 leaves a K tail past the end. Same output as per-thread loads and the reference."""
    hidden = 48
    fp8 = dtype == "fp8"
    x = torch.randn(37, hidden, device=DEVICE).to(torch.bfloat16 if fp8 else dtype)
    w_gate_up, w_down = experts(5, x.dtype, hidden=hidden)
    scales = ()
    if fp8:
        (w_gate_up, gate_up_scale), (w_down, down_scale) = quantize_experts_fp8(w_gate_up), quantize_experts_fp8(w_down)
        scales = (gate_up_scale, down_scale)
    assert descriptor_fits(w_gate_up)
    weights, ids = random_routing(37, 5, 3)
    plan = MoEPlan(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=1, tma=True)
    expected = fused_moe_ref(x, w_gate_up, w_down, weights, ids, *scales)
    by_descriptor = fused_moe_triton(x, w_gate_up, w_down, weights, ids, *scales, plan=plan)
    by_loads = fused_moe_triton(x, w_gate_up, w_down, weights, ids, *scales, plan=plan._replace(tma=False))
    torch.testing.assert_close(by_descriptor, by_loads, atol=0, rtol=0)
    wide = plan._replace(block_n=256)  # 512 weight rows a tile: over a descriptor's 256, so per-thread loads
    wide_by_loads = fused_moe_triton(x, w_gate_up, w_down, weights, ids, *scales, plan=wide._replace(tma=False))
    torch.testing.assert_close(fused_moe_triton(x, w_gate_up, w_down, weights, ids, *scales, plan=wide), wide_by_loads,
                               atol=0, rtol=0)
    if fp8:
        assert relative_error(by_descriptor, expected) < FP8_REL_ERR[torch.bfloat16]
    else:
        torch.testing.assert_close(by_descriptor.float(), expected.float(), **TOL[dtype])


def test_descriptor_fits_only_back_to_back_aligned_rows():
    w = torch.zeros(3, 8, 40, device=DEVICE)
    assert descriptor_fits(w) and descriptor_fits(w.to(torch.bfloat16))
    assert not descriptor_fits(w[:, :, :36])  # rows not back to back
    assert not descriptor_fits(torch.zeros(3, 8, 36, device=DEVICE, dtype=torch.bfloat16))  # 72-byte rows
    assert not descriptor_fits(torch.zeros(961, device=DEVICE)[1:].view(3, 8, 40))  # a base 4 bytes off


def test_fit_plan_keeps_fp8_k_blocks_of_at_least_32():
    """fp32 activations halve the K blocks of bf16/fp32 experts (shared memory), but fp8 experts
    multiply fp8 tiles whatever x's dtype, and fp8 tensor cores take no K block under 32 (an H100
    refused to compile MoEPlan(32, 32, 32, 4, 2) halved to 16 with fp32 activations)."""
    plans = [fused_moe_module.DECODE_PLAN, fused_moe_module.MID_PLAN, fused_moe_module.PREFILL_PLAN,
             fused_moe_module.FP8_PREFILL_PLAN, *fused_moe_module.LARGE_PLANS[False], *fused_moe_module.LARGE_PLANS[True], MoEPlan(32, 32, 32, 4, 2)]
    for plan in plans:
        for dtype in (torch.float32, torch.bfloat16):
            assert fused_moe_module.fit_plan(plan, dtype, fp8=True) == plan
        assert fused_moe_module.fit_plan(plan, torch.bfloat16, fp8=False) == plan
        assert fused_moe_module.fit_plan(plan, torch.float32, fp8=False).block_k == max(16, plan.block_k // 2)


def test_fused_moe_down_kernel_takes_its_own_plan():
    """The down kernel tiled apart from the gate/up kernel (K blocks that divide I = 48, so its K
    loop runs unmasked, while H = 40 leaves the gate/up kernel a masked tail) gives the reference's
    output; row blocks that differ from the alignment's are refused."""
    x = torch.randn(30, HIDDEN, device=DEVICE)
    gate_up = MoEPlan(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)
    down = MoEPlan(block_m=32, block_n=16, block_k=16, num_warps=4, num_stages=2)
    w_gate_up, w_down = experts(4, torch.float32)
    weights, ids = random_routing(30, 4, 3)
    expected = fused_moe_ref(x, w_gate_up, w_down, weights, ids)
    actual = fused_moe_triton(x, w_gate_up, w_down, weights, ids, plan=gate_up, down_plan=down)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    with pytest.raises(AssertionError, match="row blocks"):
        fused_moe_triton(x, w_gate_up, w_down, weights, ids, plan=gate_up, down_plan=down._replace(block_m=16))


def test_fused_moe_reads_strided_rows_of_x():
    wide = torch.randn(6, HIDDEN + 8, device=DEVICE)
    x = wide[:, 4:HIDDEN + 4]
    assert_triton_matches_ref(x, *experts(4, torch.float32), *random_routing(6, 4, 2))


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


# fp32 activations: the per-pair rows the down projection quantises differ between the paths by
# summation order only, so they land on the same e4m3 values, except on a GPU, where the fp8 tensor
# cores' sums differ by more than that and now and then move an entry to the next e4m3 value (an
# H100, 200 draws of the 21-token case: median 1.3e-7, largest 2.5e-4, one above 1e-4). bf16: each
# path rounds those rows itself (the interpreter toward zero), and a row whose largest entry moves
# by one bf16 step is quantised on another grid: entries up to half an e4m3 step (6%) apart, a few
# percent of the norm.
FP8_REL_ERR = {torch.float32: 1e-3 if DEVICE == "cuda" else 1e-4, torch.bfloat16: 6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,plan", [(3, 2, None), (21, 8, MoEPlan(32, 32, 32, 4, 2))])
def test_fused_moe_fp8_triton_matches_ref(dtype, tokens, top_k, plan):
    num_experts = 8
    x = torch.randn(tokens, HIDDEN, device=DEVICE).to(dtype)
    w_gate_up, w_down = experts(num_experts, dtype)
    w_gate_up8, gate_up_scale, w_down8, down_scale = (*quantize_experts_fp8(w_gate_up), *quantize_experts_fp8(w_down))
    weights, ids = random_routing(tokens, num_experts, top_k)
    expected = fused_moe_ref(x, w_gate_up8, w_down8, weights, ids, gate_up_scale, down_scale)
    actual = fused_moe_triton(x, w_gate_up8, w_down8, weights, ids, gate_up_scale, down_scale, plan=plan)
    assert actual.dtype == dtype and relative_error(actual, expected) < FP8_REL_ERR[dtype]
    unquantised = fused_moe_ref(x, w_gate_up, w_down, weights, ids)
    assert 1e-3 < relative_error(expected, unquantised) < 0.1  # e4m3 rounding: a few percent, never none


def test_quantize_experts_fp8_scales_each_experts_rows():
    weight = torch.randn(3, 5, 32, device=DEVICE)
    q, scale = quantize_experts_fp8(weight)
    assert q.shape == weight.shape and scale.shape == (3, 5)
    assert torch.equal(q.float().abs().amax(-1), torch.full((3, 5), 448.0, device=DEVICE))
    # Round to nearest e4m3: within half a step, 2**-4 of the value among normals and half the
    # smallest subnormal step (2**-10 of the row's scale) below them.
    error = (q.float() * scale[..., None] - weight).abs()
    bound = torch.maximum(weight.abs() * 2.0 ** -4, scale[..., None] * 2.0 ** -10)
    assert (error <= bound * (1 + 1e-6)).all()


def test_fused_moe_ref_is_the_sum_of_each_tokens_experts():
    """The experts' gate and up projections, given apart, interleaved into w_gate_up (the layout
    both paths take): the reference sums each token's weighted expert MLPs."""
    tokens, num_experts, top_k = 7, 6, 3
    x = torch.randn(tokens, HIDDEN, device=DEVICE)
    gate_w, up_w = (torch.randn(num_experts, INTER, HIDDEN, device=DEVICE) / HIDDEN ** 0.5 for _ in range(2))
    _, w_down = experts(num_experts, torch.float32)
    w_gate_up = interleave_gate_up(gate_w, up_w)
    assert torch.equal(w_gate_up[:, 0::2], gate_w) and torch.equal(w_gate_up[:, 1::2], up_w)
    weights, ids = random_routing(tokens, num_experts, top_k)
    expected = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(top_k):
            e = ids[t, j]
            hidden = torch.nn.functional.silu(gate_w[e] @ x[t]) * (up_w[e] @ x[t])
            expected[t] += weights[t, j] * (w_down[e] @ hidden)
    torch.testing.assert_close(fused_moe_ref(x, w_gate_up, w_down, weights, ids), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_moe_triton(x, w_gate_up, w_down, weights, ids), expected, **TOL[torch.float32])


def test_route_topk_renormalised_is_softmax_over_the_chosen_logits():
    logits = torch.randn(9, 8, device=DEVICE)
    weights, ids = route_topk(logits, 2, renormalize=True)
    top_logits, top_ids = torch.topk(logits, 2, dim=-1)
    assert torch.equal(ids.long(), top_ids)
    torch.testing.assert_close(weights, torch.softmax(top_logits, dim=-1))
    shares, _ = route_topk(logits, 2, renormalize=False)
    torch.testing.assert_close(shares, torch.softmax(logits, dim=-1).gather(1, top_ids))


@pytest.mark.parametrize("tokens,num_experts,top_k,block_m", [(1, 8, 1, 16), (13, 8, 3, 4), (40, 16, 8, 16)])
def test_align_by_expert_groups_every_pair_once_in_blocks_of_one_expert(tokens, num_experts, top_k, block_m):
    _, ids = random_routing(tokens, num_experts, top_k)
    sorted_pairs, block_experts = align_by_expert_ref(ids, num_experts, block_m)
    num_pairs = tokens * top_k
    assert sorted_pairs.shape[0] == padded_pairs_bound(num_pairs, num_experts, block_m) == block_m * len(block_experts)
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair once
    assert (sorted_pairs[sorted_pairs >= num_pairs] == num_pairs).all()
    block_of_slot = block_experts.repeat_interleave(block_m)
    slot_ok = sorted_pairs < num_pairs
    assert torch.equal(block_of_slot[slot_ok], ids.flatten()[sorted_pairs[slot_ok].long()])
    used = block_experts[block_experts < num_experts]
    assert torch.equal(used, used.sort().values)  # runs in expert order, then the unused tail
    assert (block_experts[len(used):] == num_experts).all()
    assert set(used.tolist()) == set(ids.flatten().tolist())  # no block for an expert without pairs


@pytest.mark.parametrize("chunks", [None, 4, 64], ids=["one launch", "chunks of 4+", "chunks of 64"])
@pytest.mark.parametrize("tokens,num_experts,top_k,block_m", [(1, 8, 1, 16), (13, 8, 3, 4), (40, 16, 8, 16),
                                                              (300, 6, 2, 32)])
def test_align_by_expert_triton_equals_ref(tokens, num_experts, top_k, block_m, chunks, monkeypatch):
    """Both stable, so equal slot for slot; 300 tokens: long runs, and with steps of 64 ids the
    one-launch kernel's loops take 10 steps. chunks: the chunked path (counts, runs, placement)
    with the ids cut into at most that many chunks of at least 64 (600 pairs: 3 or 10 chunks)."""
    monkeypatch.setattr(fused_moe_module, "ALIGN_BLOCK", 64)
    if chunks:
        monkeypatch.setattr(fused_moe_module, "ALIGN_ONE_LAUNCH_PAIRS", 0)
        monkeypatch.setattr(fused_moe_module, "ALIGN_MAX_CHUNKS", chunks)
    _, ids = random_routing(tokens, num_experts, top_k)
    for expected, actual in zip(align_by_expert_ref(ids, num_experts, block_m),
                                align_by_expert_triton(ids, num_experts, block_m)):
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("chunked", [False, True])
def test_align_by_expert_triton_with_empty_experts_and_a_hot_one(chunked, monkeypatch):
    if chunked:
        monkeypatch.setattr(fused_moe_module, "ALIGN_BLOCK", 32)
        monkeypatch.setattr(fused_moe_module, "ALIGN_ONE_LAUNCH_PAIRS", 0)
    _, ids = skewed_routing(37, 16, 4, hot=5)
    for expected, actual in zip(align_by_expert_ref(ids, 16, 16), align_by_expert_triton(ids, 16, 16)):
        assert torch.equal(actual, expected)


def test_moe_ab_compares_two_trees_that_agree(capsys):
    """test/benchmark/kernels/moe_ab.py's checks and table, on tiny shapes (--smoke), with this tree's
    kernels as the "old" tree too: every row checked (both paths against their references, the
    references equal), one table row a case."""
    if DEVICE == "cuda":
        pytest.skip("--smoke runs under the interpreter, on the CPU")
    from pathlib import Path

    from benchmark.kernels import moe_ab

    assert moe_ab.main(["--old", str(Path(fused_moe_module.__file__).parent), "--smoke", "--rounds", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| bf16", "| fp8"))]
    assert [row.split(" | ")[:2] for row in rows] == [["| bf16", "3"], ["| bf16", "300"], ["| fp8", "300"]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_gelu_experts_match_ref_and_transformers_form(dtype):
    """Gemma 4's experts: GELU's tanh form in place of silu, in the kernel as in the reference, and the
    reference as transformers computes an expert (act(gate) * up, then down)."""
    tokens, num_experts, top_k = 7, 4, 2
    x = torch.randn(tokens, HIDDEN, device=DEVICE).to(dtype)
    w_gate_up, w_down = experts(num_experts, dtype)
    weights, ids = random_routing(tokens, num_experts, top_k)
    expected = fused_moe_ref(x, w_gate_up, w_down, weights, ids, gelu=True)
    got = fused_moe_triton(x, w_gate_up, w_down, weights, ids, gelu=True, plan=DECODE_PLAN)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])
    if dtype == torch.float32:
        gate, up = w_gate_up[:, 0::2], w_gate_up[:, 1::2]
        by_hand = torch.zeros_like(x)
        for t in range(tokens):
            for j in range(top_k):
                e = int(ids[t, j])
                h = torch.nn.functional.gelu(gate[e] @ x[t], approximate="tanh") * (up[e] @ x[t])
                by_hand[t] += weights[t, j] * (w_down[e] @ h)
        torch.testing.assert_close(expected, by_hand, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(expected, fused_moe_ref(x, w_gate_up, w_down, weights, ids), atol=1e-2)
