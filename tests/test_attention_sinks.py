"""Attention sinks (gpt-oss): one learned logit per query head joins each softmax's denominator.
The references against the softmax written out as transformers' eager gpt-oss attention does it
(scores and the sink concatenated, softmaxed, the sink's column dropped); the Triton kernels
(under the interpreter on the CPU) against the references, split-K and windowed included."""

import pytest
import torch
from test_kernels import (ATTN_TOL, CHUNKS, DEVICE, PROMPT_LENS, assert_close, decode_batch, decode_module, extend_batch,
                          fresh_seed, randn)  # noqa: F401 (fresh_seed: the autouse fixture)

from lightllm.kernels.decode_attention import decode_attention_ref, decode_attention_triton
from lightllm.kernels.extend_attention import extend_attention_ref, extend_attention_triton


def sinks_of(num_q_heads: int) -> torch.Tensor:
    return randn(num_q_heads) * 2.0  # of the scores' own size: the sink takes a real share


def eager_with_sinks(q, keys, values, scale, sinks, seen):
    """q [Hq, n_q, D], keys/values [Hq, n, D], seen [n_q, n] -> [Hq, n_q, D]."""
    scores = (q @ keys.transpose(1, 2) * scale).masked_fill(~seen, float("-inf"))
    combined = torch.cat([scores, sinks[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
    probs = combined.softmax(-1)[..., :-1]
    return probs @ values


@pytest.mark.parametrize("window", [0, 40])
def test_decode_attention_ref_with_sinks_is_the_eager_softmax(window):
    seq_lens = PROMPT_LENS + [50]
    q, k_cache, v_cache, req_to_token, req_rows, lens = decode_batch(seq_lens, 4, 2, 32, torch.float32)
    sinks = sinks_of(4)
    out = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, lens, max(seq_lens), 0.2,
                               window=window, sinks=sinks)
    plain = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, lens, max(seq_lens), 0.2, window=window)
    assert not torch.allclose(out, plain, atol=1e-3)  # the sinks take their share
    for b, (row, length) in enumerate(zip(req_rows.tolist(), seq_lens)):
        first = max(0, length - window) if window else 0
        slots = req_to_token[row, first:length].long()
        keys, values = (cache[slots].transpose(0, 1).repeat_interleave(2, 0) for cache in (k_cache, v_cache))
        seen = torch.ones(1, length - first, dtype=torch.bool, device=DEVICE)
        expected = eager_with_sinks(q[b][:, None], keys, values, 0.2, sinks, seen)[:, 0]
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 16])
def test_extend_attention_ref_with_sinks_is_the_eager_softmax(window):
    _, k_cache, v_cache, req_to_token, req_rows, cu_q, kv_lens, q_blocks = extend_batch(CHUNKS, 4, 2, 32,
                                                                                         torch.float32)
    full_q = [randn(new + cached, 4, 32) for new, cached in CHUNKS]
    q = torch.cat([seq_q[cached:] for seq_q, (_, cached) in zip(full_q, CHUNKS)])
    sinks = sinks_of(4)
    out = extend_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, cu_q, kv_lens, q_blocks, 0.3,
                               window=window, sinks=sinks)
    for i, (row, (new, cached)) in enumerate(zip(req_rows.tolist(), CHUNKS)):
        n = new + cached
        slots = req_to_token[row, :n].long()
        keys, values = (cache[slots].transpose(0, 1).repeat_interleave(2, 0) for cache in (k_cache, v_cache))
        pos = torch.arange(n, device=DEVICE)
        seen = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
        expected = eager_with_sinks(full_q[i].transpose(0, 1), keys, values, 0.3, sinks, seen)
        start = cu_q[i].item()
        torch.testing.assert_close(out[start:start + new], expected.transpose(0, 1)[cached:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("waves", [0, 64], ids=["one-split", "split-k"])
def test_decode_attention_triton_with_sinks_matches_ref(window, waves, monkeypatch):
    monkeypatch.setattr(decode_module, "WAVES", waves)
    seq_lens = PROMPT_LENS + [300]
    args = decode_batch(seq_lens, 4, 2, 32, torch.float32) + (max(seq_lens), 0.125)
    sinks = sinks_of(4)
    expected = decode_attention_ref(*args, window=window, sinks=sinks)
    assert_close(decode_attention_triton(*args, window=window, sinks=sinks), expected, ATTN_TOL[torch.float32])


@pytest.mark.parametrize("window", [0, 16])
def test_extend_attention_triton_with_sinks_matches_ref(window):
    args = extend_batch(CHUNKS, 4, 2, 32, torch.float32) + (0.125,)
    sinks = sinks_of(4)
    expected = extend_attention_ref(*args, window=window, sinks=sinks)
    out = extend_attention_triton(*args, window=window, sinks=sinks)
    assert not out.isnan().any()
    assert_close(out, expected, ATTN_TOL[torch.float32])
