"""Gated DeltaNet's short causal convolution: per channel, out_t = silu(sum_j w[j] x_{t-K+1+j}),
with the last K - 1 inputs of a sequence kept as its state, so that a later chunk or decode step
continues where the last one stopped.

- `causal_conv1d_ref`: one sequence's chunk [T, C] after its state [C, K-1] (zeros at its start);
  returns the outputs and the new state.
- `causal_conv1d_step_ref`: one token for each of B requests, their states in a pool by row,
  updated in place.

Plain torch: the CPU path and the oracle.
"""
import torch
import torch.nn.functional as F


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
