"""The Gated DeltaNet references (kernels/gated_delta_rule.py, kernels/causal_conv1d.py) against
transformers' own torch implementations (Qwen3-Next's), on fresh random inputs: whole sequences,
the same sequences cut into chunks at random points with the state carried, and token by token
through the decode step's pooled, in-place states (fp32: within 1e-5)."""

import inspect
from functools import partial

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (causal_conv1d_fn, torch_chunk_gated_delta_rule,
                                                                torch_recurrent_gated_delta_rule)

from lightllm.kernels import causal_conv1d_step, causal_conv1d_varlen, gated_delta_rule_step, gated_delta_rule_varlen
from lightllm.kernels.causal_conv1d import causal_conv1d_ref as causal_conv1d
from lightllm.kernels.gated_delta_rule import gated_delta_rule_chunk_ref as gated_delta_rule_chunk

TOL = dict(atol=1e-5, rtol=1e-5)


def delta_inputs(gen, tokens, k_heads, v_heads, dk, dv):
    q, k = torch.randn(tokens, k_heads, dk, generator=gen), torch.randn(tokens, k_heads, dk, generator=gen)
    v = torch.randn(tokens, v_heads, dv, generator=gen)
    g = -torch.rand(tokens, v_heads, generator=gen) * 2  # log decay: exp(g) in (0.13, 1]
    return q, k, v, g, torch.rand(tokens, v_heads, generator=gen)


def cuts(gen, tokens, pieces):
    inner = torch.randperm(tokens - 1, generator=gen)[: pieces - 1] + 1
    return [0, *sorted(inner.tolist()), tokens]


@pytest.mark.parametrize("tokens,k_heads,v_heads", [(150, 2, 4), (37, 3, 3), (1, 1, 2)])
def test_gated_delta_rule_chunked_and_stepped_equal_transformers(tokens, k_heads, v_heads):
    gen = torch.Generator().manual_seed(tokens)
    q, k, v, g, beta = delta_inputs(gen, tokens, k_heads, v_heads, 16, 8)
    initial = torch.randn(v_heads, 16, 8, generator=gen) * 0.1
    # each key head serves v_heads / k_heads value heads in turn, as transformers' model repeats them
    # before its functions (which take one key head a value head in some of its releases)
    qv, kv = (t.repeat_interleave(v_heads // k_heads, dim=1) for t in (q, k))
    expected, final = torch_chunk_gated_delta_rule(qv[None], kv[None], v[None], g[None], beta[None],
                                                   initial_state=initial[None], output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    recurrent, _ = torch_recurrent_gated_delta_rule(qv[None], kv[None], v[None], g[None], beta[None],
                                                    initial_state=initial[None], use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(recurrent, expected, **TOL)  # transformers' two forms agree
    out, state = gated_delta_rule_chunk(q, k, v, g, beta, initial)
    torch.testing.assert_close(out, expected[0], **TOL)
    torch.testing.assert_close(state, final[0], **TOL)
    # chunks cut anywhere, each starting from the state the one before left
    bounds, state, parts = cuts(gen, tokens, min(4, tokens)), initial, []
    for lo, hi in zip(bounds, bounds[1:]):
        part, state = gated_delta_rule_chunk(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        parts.append(part)
    torch.testing.assert_close(torch.cat(parts), expected[0], **TOL)
    torch.testing.assert_close(state, final[0], **TOL)
    # token by token in a pool of three rows: row 2's state moves, the others stay
    pool = torch.randn(3, v_heads, 16, 8, generator=gen)
    others = pool[[0, 1]].clone()
    pool[2] = initial
    steps = [gated_delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], pool,
                                   torch.tensor([2])) for t in range(tokens)]
    torch.testing.assert_close(torch.cat(steps), expected[0], **TOL)
    torch.testing.assert_close(pool[2], final[0], **TOL)
    assert torch.equal(pool[[0, 1]], others)


def test_causal_conv1d_chunked_and_stepped_equal_transformers():
    gen = torch.Generator().manual_seed(0)
    tokens, channels, width = 23, 12, 4
    x, weight = torch.randn(tokens, channels, generator=gen), torch.randn(channels, width, generator=gen)
    expected = causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    out, final = causal_conv1d(x, weight, None)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(final, x[-(width - 1):].T)  # the last K - 1 inputs
    bounds, state, parts = [0, 1, 2, 9, tokens], None, []  # chunks shorter than the state, too
    for lo, hi in zip(bounds, bounds[1:]):
        part, state = causal_conv1d(x[lo:hi], weight, state)
        parts.append(part)
    torch.testing.assert_close(torch.cat(parts), expected, **TOL)
    pool = torch.randn(2, channels, width - 1, generator=gen)
    other = pool[0].clone()
    pool[1] = 0
    steps = [causal_conv1d_step(x[t:t + 1], weight, pool, torch.tensor([1])) for t in range(tokens)]
    torch.testing.assert_close(torch.cat(steps), expected, **TOL)
    torch.testing.assert_close(pool[1], final)
    assert torch.equal(pool[0], other)


def test_packed_sequences_equal_each_alone():
    """A step's chunks packed (lengths 1 to 70, each from its own state) give what each gives alone."""
    gen = torch.Generator().manual_seed(5)
    lengths, k_heads, v_heads, dk, dv, channels = (70, 1, 5, 2, 64), 2, 4, 16, 8, 12
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = delta_inputs(gen, cu[-1], k_heads, v_heads, dk, dv)
    states = torch.randn(len(lengths), v_heads, dk, dv, generator=gen) * 0.3
    out, final = gated_delta_rule_varlen(q, k, v, g, beta, cu, states)
    x, weight = torch.randn(cu[-1], channels, generator=gen), torch.randn(channels, 4, generator=gen)
    conv_states = torch.randn(len(lengths), channels, 3, generator=gen)
    conv_out, conv_final = causal_conv1d_varlen(x, weight, cu, conv_states)
    for i, (lo, hi) in enumerate(zip(cu, cu[1:])):
        alone, state = gated_delta_rule_chunk(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], states[i])
        torch.testing.assert_close(out[lo:hi], alone, **TOL)
        torch.testing.assert_close(final[i], state, **TOL)
        alone, state = causal_conv1d(x[lo:hi], weight, conv_states[i])
        torch.testing.assert_close(conv_out[lo:hi], alone, **TOL)
        torch.testing.assert_close(conv_final[i], state, **TOL)


# ---- the decode steps' Triton kernels against their references (the interpreter without a GPU) ----

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEP_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# the pool's recurrent states (--mamba_ssm_cache_dtype): fp32, or bf16 (computed in fp32, stored rounded)
STATE_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype,state_dtype,launch", [*((d, s, None) for d, s in STATE_CASES),
                                                       (torch.float32, torch.bfloat16, (16, 1)),
                                                       (torch.float32, torch.float32, (64, 2))])
@pytest.mark.parametrize("k_heads,v_heads,dk,dv", [(2, 4, 16, 8), (1, 1, 32, 48)])  # dv 48: two value blocks
def test_gated_delta_rule_step_triton_equals_reference(dtype, state_dtype, launch, k_heads, v_heads, dk, dv):
    """The decode step, at its default launch and at others (value dims a program takes x warps:
    more blocks than dims, fewer, one program for all of them)."""
    from lightllm.kernels.gated_delta_rule import gated_delta_rule_step_ref, gated_delta_rule_step_triton

    gen = torch.Generator().manual_seed(dk + dv)
    q, k, v, g, beta = (x.to(DEVICE) for x in delta_inputs(gen, 3, k_heads, v_heads, dk, dv))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    states = (torch.randn(5, v_heads, dk, dv, generator=gen) * 0.3).to(DEVICE, state_dtype)
    rows = torch.tensor([4, -1, 2], device=DEVICE)  # -1: a padded step's padding
    expected_states = states.clone()
    expected = gated_delta_rule_step_ref(q, k, v, g, beta, expected_states, rows)
    out = torch.full_like(v, 7.0)  # the caller's buffer, as the model passes it: every row written, padding's zeros
    got = gated_delta_rule_step_triton(q, k, v, g, beta, states, rows, out=out, launch=launch)
    assert got is out
    torch.testing.assert_close(got, expected, **STEP_TOL[dtype])
    assert (got[1] == 0).all() and torch.equal(expected_states[[0, 1, 3]], states[[0, 1, 3]])  # padding: no state
    assert states.dtype == state_dtype
    torch.testing.assert_close(states, expected_states, **STEP_TOL[state_dtype])


def test_a_bf16_state_pool_stays_near_the_fp32_one():
    """A bf16 pool is the fp32 one rounded once a token: decoding 64 tokens from it stays within a
    few bf16 roundings of the fp32 pool's outputs and states, and it is stored as bf16."""
    from lightllm.kernels.gated_delta_rule import gated_delta_rule_step_ref

    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = delta_inputs(gen, 64, 2, 4, 16, 8)
    g = g / 8  # slow decay: the state remembers long enough for rounding to add up
    pool = torch.randn(2, 4, 16, 8, generator=gen) * 0.3
    pools = [pool, pool.to(torch.bfloat16)]
    outs = [[], []]
    rows = torch.tensor([1])
    for t in range(64):
        for out, pool in zip(outs, pools):
            out.append(gated_delta_rule_step_ref(q[t: t + 1], k[t: t + 1], v[t: t + 1], g[t: t + 1], beta[t: t + 1],
                                                 pool, rows))
    torch.testing.assert_close(torch.cat(outs[1]), torch.cat(outs[0]), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(pools[1].float(), pools[0], atol=3e-2, rtol=3e-2)
    assert pools[1].dtype == torch.bfloat16 and not torch.equal(pools[1].float(), pools[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", [12, 300])  # 300: two channel blocks
def test_causal_conv1d_step_triton_equals_reference(dtype, channels):
    from lightllm.kernels.causal_conv1d import causal_conv1d_step_ref, causal_conv1d_step_triton

    gen = torch.Generator().manual_seed(channels)
    x = torch.randn(3, channels, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(channels, 4, generator=gen).to(DEVICE, dtype)
    states = torch.randn(5, channels, 3, generator=gen).to(DEVICE, dtype)
    rows = torch.tensor([1, -1, 4], device=DEVICE)  # -1: a padded step's padding
    before = states.clone()
    expected_states = states.clone()
    expected = causal_conv1d_step_ref(x, weight, expected_states, rows)
    out = torch.full_like(x, 7.0)  # the caller's buffer, as the model passes it: every row written, padding's zeros
    got = causal_conv1d_step_triton(x, weight, states, rows, out=out)
    assert got is out
    torch.testing.assert_close(got, expected, **STEP_TOL[dtype])
    assert torch.equal(states, expected_states)  # a shift: the same values moved
    assert (got[1] == 0).all() and torch.equal(states[[0, 2, 3]], before[[0, 2, 3]])  # padding: no state


# ---- the chunked forms' CUDA paths against their references: a step's chunks, states in a pool ----

def step_chunks(gen, lengths, decodes, pool_rows):
    """Absolute bounds of chunks of `lengths` after `decodes` decode tokens, each on its own pool row
    (the last empty ones on one padding row, as a padded step has them), and which start fresh."""
    cu = [decodes]
    for n in lengths:
        cu.append(cu[-1] + n)
    real = sum(1 for n in lengths if n)
    rows = torch.randperm(pool_rows - 1, generator=gen)[:real].tolist() + [pool_rows - 1] * (len(lengths) - real)
    fresh = [bool(torch.rand((), generator=gen) < 0.3) or not n for n in lengths]
    return (torch.tensor(cu, dtype=torch.int32, device=DEVICE), torch.tensor(rows, device=DEVICE),
            torch.tensor(fresh, device=DEVICE), cu[-1])


# chunk lengths: one token, shorter than the conv state, across one or more 16-token blocks, padding chunks (empty)
CHUNK_CASES = [((1, 2, 16, 37, 0, 0), 3), ((17, 5, 1), 0), ((50,), 2)]


def varlen_standing_in_for_fla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                               cu_seqlens, chunk_indices):
    """fla's chunk_gated_delta_rule as the wrapper calls it ([1, T, ...] inputs, packed sequences from
    their initial states), run by our reference: the wrapper's gather, call and scatter under test.
    The wrapper normalises q and k itself (fla's in-kernel norm autotunes per bucket of step sizes):
    fla without the flag takes them as they come, so they must arrive with unit rows."""
    assert scale == k.shape[-1] ** -0.5 and not use_qk_l2norm_in_kernel and output_final_state
    for x in (q, k):
        torch.testing.assert_close(x.float().norm(dim=-1), torch.ones_like(x[..., 0], dtype=torch.float32), atol=1e-3, rtol=0)
    bounds = cu_seqlens.tolist()
    assert_fla_blocks(bounds, chunk_indices.tolist())
    lo, hi = bounds[0], bounds[-1]
    out, final = gated_delta_rule_varlen(q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[0, lo:hi], beta[0, lo:hi],
                                         [b - lo for b in bounds], initial_state)
    whole = torch.full_like(v[0], float("nan"))  # fla leaves the tokens of no sequence as its empty output held
    whole[lo:hi] = out
    return whole[None], final


def assert_fla_blocks(bounds, index, chunk=64):
    """Every (sequence, block) of the packed sequences once, in order, then rows on the last (empty)
    sequence's block 0, which fla's kernels skip. The lead, the tail and the last sequence are empty:
    the decode tokens and the padding are in none."""
    real = [[s, b] for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])) for b in range(-(-(hi - lo) // chunk))]
    assert bounds[0] == bounds[1] and bounds[-1] == bounds[-2] == bounds[-3]
    assert index[: len(real)] == real and len(index) > len(real)
    assert all(row == [len(bounds) - 2, 0] for row in index[len(real):])


@pytest.mark.parametrize("lengths,decodes", CHUNK_CASES + [((1, 70, 64, 0), 2)])
def test_gated_delta_rule_chunks_fla_wrapper_equals_reference(lengths, decodes):
    """The CUDA path's wrapper around flash-linear-attention (its kernel replaced by our reference,
    same signature: fla's kernels do not run in Triton's interpreter; the GPU tests compare the real
    one): states gathered from the pool (zeros where a chunk starts its request), outputs written
    for the chunks' rows only, final states back to the chunks' rows, padding chunks' row untouched."""
    from lightllm.kernels.gated_delta_rule import fla_plan, gated_delta_rule_chunks_fla, gated_delta_rule_chunks_ref

    gen = torch.Generator().manual_seed(sum(lengths) + decodes)
    cu, rows, fresh, tokens = step_chunks(gen, lengths, decodes, pool_rows=8)
    q, k, v, g, beta = delta_inputs(gen, tokens + 2, 1, 2, 16, 24)  # 2 padding tokens after the chunks
    pool = torch.randn(8, 2, 16, 24, generator=gen) * 0.3
    outs, pools = [], []
    fla = partial(gated_delta_rule_chunks_fla, chunk_fn=varlen_standing_in_for_fla)
    # the plan made inside, and made once beforehand as the model makes it for all of a step's layers
    for impl in (gated_delta_rule_chunks_ref, fla, partial(fla, plan=fla_plan(cu, tokens + 2))):
        out, states = torch.full_like(v, 7.0), pool.clone()  # decode rows before the chunks, padding after: kept
        impl(q, k, v, g, beta, cu, states, rows, fresh, out)
        outs.append(out)
        pools.append(states)
    for out, states in zip(outs[1:], pools[1:]):
        torch.testing.assert_close(out, outs[0], **STEP_TOL[torch.float32])
        torch.testing.assert_close(states, pools[0], **STEP_TOL[torch.float32])
        assert (out[:decodes] == 7).all() and (out[tokens:] == 7).all()
        assert torch.equal(states[-1], pool[-1])  # the padding chunks' row


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_chunk_states_in_and_out_triton_equal_references(state_dtype):
    """The fla path's states into its packed sequences and back: filled chunks' rows (zeros where
    fresh), zeros for the lead, tail and empty sequences, and a padding chunk's initial state and
    pool row never touched (a padded step moves its real chunks' states only)."""
    from lightllm.kernels.gated_delta_rule import (STATE_BLOCK, chunk_states_in_ref, chunk_states_in_triton,
                                                   chunk_states_out_ref, chunk_states_out_triton)

    gen = torch.Generator().manual_seed(7)
    pool = (torch.randn(9, 2, 8, STATE_BLOCK // 8 + 3, generator=gen)).to(DEVICE, state_dtype)  # two blocks a state
    rows = torch.tensor([3, 8, 5, 8, 1], device=DEVICE)  # row 8: the padding chunks'
    fresh = torch.tensor([False, False, True, False, False], device=DEVICE)
    filled = torch.tensor([True, False, True, False, True], device=DEVICE)
    sentinel = torch.full((8, *pool.shape[1:]), 7.0, dtype=state_dtype, device=DEVICE)
    got, want = sentinel.clone(), sentinel.clone()
    chunk_states_in_triton(pool, rows, fresh, filled, got)
    chunk_states_in_ref(pool, rows, fresh, filled, want)
    assert torch.equal(got, want)
    assert torch.equal(got[1], pool[3]) and torch.equal(got[5], pool[1]) and (got[3] == 0).all()
    assert (got[[0, 6, 7]] == 0).all() and (got[[2, 4]] == 7).all()
    final = torch.randn(8, *pool.shape[1:], generator=gen).to(DEVICE)
    got_pool, want_pool = pool.clone(), pool.clone()
    chunk_states_out_triton(final, rows, filled, got_pool)
    chunk_states_out_ref(final, rows, filled, want_pool)
    torch.testing.assert_close(got_pool, want_pool, **STEP_TOL[state_dtype])  # the interpreter may round otherwise
    torch.testing.assert_close(got_pool[5], final[3].to(state_dtype), **STEP_TOL[state_dtype])
    assert torch.equal(got_pool[8], pool[8])
    assert torch.equal(got_pool[[0, 2, 4, 6, 7]], pool[[0, 2, 4, 6, 7]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim", [(3, 16), (16, 128)])
def test_l2norm_heads_triton_equals_reference(dtype, heads, dim):
    """The CUDA path's q/k norms before fla: each head's row unit length, in fp32, from a strided
    view (q and k are slices of the conv's output), one program a token over its heads."""
    from lightllm.kernels.gated_delta_rule import l2norm_heads_ref, l2norm_heads_triton

    gen = torch.Generator().manual_seed(heads)
    conv = (torch.randn(7, 3 * heads * dim, generator=gen) * 3).to(DEVICE, dtype)
    k = conv[:, heads * dim: 2 * heads * dim].view(7, heads, dim)
    got, expected = l2norm_heads_triton(k), l2norm_heads_ref(k)
    assert got.dtype == dtype and got.is_contiguous() and not k.is_contiguous()
    torch.testing.assert_close(got, expected, **STEP_TOL[dtype])
    torch.testing.assert_close(got.float().norm(dim=-1), torch.ones(7, heads, device=DEVICE), atol=1e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [3, 48])
def test_linear_gates_triton_equals_reference(dtype, heads):
    """The decay and write strength of every token and value head in one launch, from strided slices
    of the projection (a: past softplus's threshold too), g in fp32 and beta in b's dtype."""
    from lightllm.kernels.gated_delta_rule import linear_gates_ref, linear_gates_triton

    gen = torch.Generator().manual_seed(heads)
    projection = (torch.randn(6, 4 * heads, generator=gen) * 8).to(DEVICE, dtype)
    b, a = projection[:, heads: 2 * heads], projection[:, 3 * heads:]
    neg_a = -torch.rand(heads, generator=gen).exp().to(DEVICE)
    dt_bias = torch.randn(heads, generator=gen).to(DEVICE) + torch.linspace(-30, 30, heads).to(DEVICE)
    (g, beta), (expected_g, expected_beta) = linear_gates_triton(a, b, neg_a, dt_bias), linear_gates_ref(a, b, neg_a,
                                                                                                       dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, expected_g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta, expected_beta, **STEP_TOL[dtype])


def test_stand_in_takes_fla_arguments():
    """The stand-in's keywords are ones fla 0.6's chunk_gated_delta_rule takes (where fla is installed)."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    accepted = inspect.signature(fla.chunk_gated_delta_rule).parameters
    assert set(inspect.signature(varlen_standing_in_for_fla).parameters) <= set(accepted)


@pytest.mark.parametrize("lengths,decodes", CHUNK_CASES + [((1, 70, 64, 0), 2), ((200,), 1)])  # 2 and 4 blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_chunks_triton_equals_reference(lengths, decodes, dtype):
    from lightllm.kernels.causal_conv1d import causal_conv1d_chunks_ref, causal_conv1d_chunks_triton

    gen = torch.Generator().manual_seed(sum(lengths) + decodes)
    cu, rows, fresh, tokens = step_chunks(gen, lengths, decodes, pool_rows=8)
    channels = 40  # a block of 32 channels and a partial one (128 on a GPU)
    x = torch.randn(tokens + 2, channels, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(channels, 4, generator=gen).to(DEVICE, dtype)
    pool = torch.randn(8, channels, 3, generator=gen).to(DEVICE, dtype)
    outs, pools = [], []
    for impl in (causal_conv1d_chunks_ref, causal_conv1d_chunks_triton):
        out = torch.full_like(x, 7.0)
        states = pool.clone()
        impl(x, weight, cu, states, rows, fresh, out)
        outs.append(out)
        pools.append(states)
    torch.testing.assert_close(outs[1], outs[0], **STEP_TOL[dtype])
    torch.testing.assert_close(pools[1], pools[0], **STEP_TOL[dtype])
    assert (outs[1][:decodes] == 7).all() and (outs[1][tokens:] == 7).all()
    assert torch.equal(pools[1][-1], pool[-1]) and torch.equal(pools[0][-1], pool[-1])  # padding chunks: no state



# ---- a verify step's runs (and the commit of the tokens each request kept) ----

# (pool row, first token, length) a request: runs with gaps between them (a commit keeps a prefix of
# each request's tokens), one of no tokens, and a padding row (-1)
RUNS = [(3, 0, 3), (-1, 3, 2), (0, 5, 1), (5, 8, 0), (1, 9, 4)]
RUN_TOKENS = 14


def runs_tensors(device=DEVICE):
    return tuple(torch.tensor([run[i] for run in RUNS], device=device) for i in range(3))


def delta_stepped(q, k, v, g, beta, pool):
    """The oracle: the decode step's reference token after token over each run, on `pool` in place."""
    out = torch.zeros_like(v)
    for row, first, length in RUNS:
        for t in range(first, first + length):
            if row >= 0:
                out[t: t + 1] = gated_delta_rule_step(q[t: t + 1], k[t: t + 1], v[t: t + 1], g[t: t + 1],
                                                      beta[t: t + 1], pool, torch.tensor([row]))
    return out


def conv_stepped(x, weight, pool):
    out = torch.zeros_like(x)
    for row, first, length in RUNS:
        for t in range(first, first + length):
            if row >= 0:
                out[t: t + 1] = causal_conv1d_step(x[t: t + 1], weight, pool, torch.tensor([row]))
    return out


@pytest.mark.parametrize("update", [False, True])
def test_runs_references_equal_the_decode_step_token_after_token(update):
    """A verify reads each request's state through its run and leaves the pool as it was; a commit
    leaves the state after the run's last token, as that many decode steps would."""
    from lightllm.kernels.causal_conv1d import causal_conv1d_runs_ref
    from lightllm.kernels.gated_delta_rule import gated_delta_rule_runs_ref

    gen = torch.Generator().manual_seed(int(update))
    rows, starts, lengths = runs_tensors("cpu")
    q, k, v, g, beta = delta_inputs(gen, RUN_TOKENS, 2, 4, 16, 8)
    pool = torch.randn(6, 4, 16, 8, generator=gen) * 0.3
    stepped_pool, states = pool.clone(), pool.clone()
    expected = delta_stepped(q, k, v, g, beta, stepped_pool)
    torch.testing.assert_close(gated_delta_rule_runs_ref(q, k, v, g, beta, states, rows, starts, lengths, update),
                               expected, **TOL)
    torch.testing.assert_close(states, stepped_pool if update else pool, **TOL)
    x, weight = torch.randn(RUN_TOKENS, 12, generator=gen), torch.randn(12, 4, generator=gen)
    conv_pool = torch.randn(6, 12, 3, generator=gen)
    stepped_pool, states = conv_pool.clone(), conv_pool.clone()
    expected = conv_stepped(x, weight, stepped_pool)
    torch.testing.assert_close(causal_conv1d_runs_ref(x, weight, states, rows, starts, lengths, update), expected,
                               **TOL)
    torch.testing.assert_close(states, stepped_pool if update else conv_pool, **TOL)


@pytest.mark.parametrize("update", [False, True])
@pytest.mark.parametrize("dtype,state_dtype", STATE_CASES)
def test_runs_triton_equal_reference(dtype, state_dtype, update):
    from lightllm.kernels.causal_conv1d import causal_conv1d_runs_ref, causal_conv1d_runs_triton
    from lightllm.kernels.gated_delta_rule import gated_delta_rule_runs_ref, gated_delta_rule_runs_triton

    gen = torch.Generator().manual_seed(7 + int(update))
    runs = runs_tensors()
    q, k, v, g, beta = (x.to(DEVICE) for x in delta_inputs(gen, RUN_TOKENS, 1, 2, 32, 48))  # dv 48: two blocks
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    pool = (torch.randn(6, 2, 32, 48, generator=gen) * 0.3).to(DEVICE, state_dtype)
    outs, pools = [], []
    for impl in (gated_delta_rule_runs_ref, gated_delta_rule_runs_triton):
        pools.append(pool.clone())
        outs.append(impl(q, k, v, g, beta, pools[-1], *runs, update))
    torch.testing.assert_close(outs[1], outs[0], **STEP_TOL[dtype])
    assert pools[1].dtype == state_dtype
    torch.testing.assert_close(pools[1], pools[0], **STEP_TOL[state_dtype])
    assert (outs[1][[3, 4, 6, 7, 8, 13]] == 0).all()  # tokens of padding and of no run
    if not update:
        assert torch.equal(pools[1], pool)
    channels = 300  # two channel blocks
    x = torch.randn(RUN_TOKENS, channels, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(channels, 4, generator=gen).to(DEVICE, dtype)
    conv_pool = torch.randn(6, channels, 3, generator=gen).to(DEVICE, dtype)
    outs, pools = [], []
    for impl in (causal_conv1d_runs_ref, causal_conv1d_runs_triton):
        pools.append(conv_pool.clone())
        outs.append(impl(x, weight, pools[-1], *runs, update))
    torch.testing.assert_close(outs[1], outs[0], **STEP_TOL[dtype])
    assert torch.equal(pools[1], pools[0])  # a shift: the same values moved
    assert (outs[1][[3, 4, 6, 7, 8, 13]] == 0).all()
    if not update:
        assert torch.equal(pools[1], conv_pool)
