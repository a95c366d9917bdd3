"""Gated DeltaNet's short causal convolution: per channel, out_t = silu(sum_j w[j] x_{t-K+1+j}),
with the last K - 1 inputs of a sequence kept as its state, so that a later chunk or decode step
continues where the last one stopped.

- `causal_conv1d_ref`: one sequence's chunk [T, C] after its state [C, K-1] (zeros at its start);
  returns the outputs and the new state.
- `causal_conv1d_step_ref`: one token for each of B requests, their states in a pool by row,
  updated in place.

The `_ref` functions are the CPU path and the oracle; the decode step has a Triton kernel
(`causal_conv1d_step_triton`).
"""
import torch
import torch.nn.functional as F

from ._triton import cdiv, next_power_of_2, tl, triton


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], weight [C, K], state [C, K-1] or None (zeros). Returns (silu(conv) [T, C], state [C, K-1])."""
    channels, width = weight.shape
    if state is None:
        state = x.new_zeros(channels, width - 1)
    seq = torch.cat([state.to(x.dtype), x.T], dim=-1)  # [C, K-1+T]
    out = F.conv1d(seq[None].to(weight.dtype), weight[:, None, :], groups=channels)[0]  # [C, T]
    return F.silu(out).T.to(x.dtype), seq[:, -(width - 1):].clone()


def causal_conv1d_step_ref(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                           rows: torch.Tensor) -> torch.Tensor:
    """x [B, C], weight [C, K], states [S, C, K-1] updated in place at rows [B]. Returns [B, C]."""
    seq = torch.cat([states[rows].to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    states[rows] = seq[..., 1:].to(states.dtype)
    return F.silu((seq.to(weight.dtype) * weight).sum(-1)).to(x.dtype)


@triton.jit
def _causal_conv1d_step_kernel(x_ptr, weight_ptr, states_ptr, rows_ptr, out_ptr, channels, x_stride, out_stride,
                               WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """One (request, block of channels): the window [state | x] times the weights, then the
    state shifted by one. States [S, C, WIDTH - 1] and weight [C, WIDTH] contiguous."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_W)[None, :]
    c_mask = (c < channels)[:, None]
    row = tl.load(rows_ptr + b).to(tl.int64)
    state = states_ptr + row * channels * (WIDTH - 1) + c[:, None] * (WIDTH - 1)
    x = tl.load(x_ptr + b * x_stride + c, mask=c < channels, other=0.0)[:, None]
    window = tl.load(state + j, mask=c_mask & (j < WIDTH - 1), other=0.0)
    window = tl.where(j == WIDTH - 1, x, window)
    shifted = tl.load(state + j + 1, mask=c_mask & (j < WIDTH - 2), other=0.0)  # read before any store
    shifted = tl.where(j == WIDTH - 2, x, shifted)
    weight = tl.load(weight_ptr + c[:, None] * WIDTH + j, mask=c_mask & (j < WIDTH), other=0.0).to(tl.float32)
    acc = tl.sum(window.to(tl.float32) * weight, axis=1)
    tl.store(state + j, shifted.to(states_ptr.dtype.element_ty), mask=c_mask & (j < WIDTH - 1))
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * out_stride + c, out.to(out_ptr.dtype.element_ty), mask=c < channels)


def causal_conv1d_step_triton(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                              rows: torch.Tensor) -> torch.Tensor:
    assert states.is_contiguous() and weight.is_contiguous() and x.stride(-1) == 1
    batch, channels = x.shape
    width = weight.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    block_c = min(next_power_of_2(channels), 256)
    _causal_conv1d_step_kernel[(batch, cdiv(channels, block_c))](
        x, weight, states, rows, out, channels, x.stride(0), out.stride(0), WIDTH=width, BLOCK_C=block_c,
        BLOCK_W=next_power_of_2(width))
    return out
