"""Decode attention: one query token per request over its KV slots in the token table, GQA."""
import torch

from ._triton import tl, triton


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                         max_seqlen: int, sm_scale: float) -> torch.Tensor:
    """q [B, Hq, D]; request b attends to slots req_to_token[req_rows[b], :seq_lens[b]]."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    positions = torch.arange(max_seqlen, device=q.device)
    valid = positions[None, :] < seq_lens[:, None].long()  # [B, L]
    slots = req_to_token[req_rows.long(), :max_seqlen].long()
    slots = torch.where(valid, slots, 0)  # entries past seq_len may hold stale or unset slots
    k = k_cache[slots].float()  # [B, L, Hk, D]
    v = v_cache[slots].float()
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * sm_scale
    probs = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                            max_seqlen: int, sm_scale: float) -> torch.Tensor:
    raise NotImplementedError
