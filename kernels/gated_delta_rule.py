"""The gated delta rule (Gated DeltaNet's linear attention, Qwen3-Next and Qwen3.5), in fp32.

Per value head a state S [dk, dv] decays by exp(g_t) each token, then takes the delta rule's
correction toward v_t along the (L2-normalised) key: S = a S + k (beta (v - k^T a S))^T, and the
output reads it with the scaled, L2-normalised query: o = S^T q. Two forms with one meaning:

- `gated_delta_rule_chunk_ref`: one sequence's tokens (a prompt chunk) from an initial state,
  in blocks of CHUNK tokens (the WY form: each block is a triangular solve and a few matmuls,
  and the state is carried block to block); the prefill and extend path.
- `gated_delta_rule_step_ref`: one token for each of B requests, their states updated in place
  in a pool by row; the decode path.

Key heads fewer than value heads are shared by consecutive value heads (GQA-style). These are
the CPU path and the oracle; a Triton kernel (or flash-linear-attention's) is what a GPU wants.
"""
import torch

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, dk] -> fp32 [..., Hv, dk], L2-normalised, q scaled by dk^-1/2."""
    groups = num_v_heads // q.shape[-2]
    q, k = (x.float().repeat_interleave(groups, dim=-2) if groups > 1 else x.float() for x in (q, k))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def gated_delta_rule_chunk_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [T, Hk, dk], v [T, Hv, dv], g (log decay, <= 0) and beta [T, Hv], state
    [Hv, dk, dv] fp32 or None (zeros). Returns (o [T, Hv, dv] in v's dtype, final state fp32)."""
    tokens, num_heads, dv = v.shape
    dtype = v.dtype
    q, k = _prepare(q, k, num_heads)
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))  # [H, T, d]
    g, beta = g.float().T, beta.float().T  # [H, T]
    pad = -tokens % CHUNK
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    blocks = (tokens + pad) // CHUNK
    q, k, v = (x.reshape(num_heads, blocks, CHUNK, -1) for x in (q, k, v))
    g, beta = g.reshape(num_heads, blocks, CHUNK).cumsum(-1), beta.reshape(num_heads, blocks, CHUNK, 1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]
    k_beta = k * beta
    # (I + strictly-lower(beta K K^T decay)) U = beta V: the block's corrected values (WY form)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * g.exp()[..., None]
    k_to_end = k * (g[..., -1:] - g).exp()[..., None]
    s = q.new_zeros(num_heads, k.shape[-1], dv) if state is None else state.float()
    out = torch.empty_like(v)
    for i in range(blocks):
        new = values[:, i] - k_decayed[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ new
        s = s * g[:, i, -1, None, None].exp() + k_to_end[:, i].transpose(-1, -2) @ new
    out = out.reshape(num_heads, -1, dv)[:, :tokens].transpose(0, 1)
    return out.to(dtype).contiguous(), s


def gated_delta_rule_step_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                              states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One token each of B requests: q, k [B, Hk, dk], v [B, Hv, dv], g and beta [B, Hv]; states
    [S, Hv, dk, dv] fp32, rows [B] each request's state, updated in place. Returns o [B, Hv, dv]."""
    q, k = _prepare(q, k, v.shape[1])
    s = states[rows] * g.float().exp()[..., None, None]
    delta = (v.float() - (s * k[..., None]).sum(-2)) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    states[rows] = s
    return (s * q[..., None]).sum(-2).to(v.dtype)
