"""ForwardBatch of one request, without a runner (the EAGLE-3 head's tests and its cost benchmark).

The request sits in row 0 of `req_to_token`, and its token at position p in KV slot p
(`slot_table` writes that identity), so a batch needs only the positions of its new tokens.
"""

from __future__ import annotations

import torch

from lightllm.kernels.extend_attention import extend_q_blocks
from lightllm.models import ForwardBatch


def slot_table(max_len: int, device) -> torch.Tensor:
    """req_to_token [1, max_len] int32 with slot p at position p."""
    return torch.arange(max_len, dtype=torch.int32, device=device)[None]


def extend_batch(input_ids: torch.Tensor, start: int, req_to_token: torch.Tensor, head_dim: int,
                 aux_layers: tuple[int, ...] = ()) -> ForwardBatch:
    """The tokens input_ids [n] at positions start .. start + n - 1 as one chunk over the first
    `start` cached ones; logits of every token."""
    n, device = input_ids.shape[0], input_ids.device
    positions = torch.arange(start, start + n, dtype=torch.int64, device=device)
    blocks = torch.tensor(extend_q_blocks([n], head_dim), dtype=torch.int32, device=device).view(2, -1)
    return ForwardBatch(input_ids, positions, positions.clone(), req_to_token,
                        ext_rows=torch.zeros(1, dtype=torch.int32, device=device),
                        ext_cu_q=torch.tensor([0, n], dtype=torch.int32, device=device),
                        ext_kv_lens=torch.tensor([start + n], dtype=torch.int32, device=device),
                        ext_q_blocks=blocks, aux_layers=aux_layers)


def decode_batch(input_ids: torch.Tensor, positions: torch.Tensor, req_to_token: torch.Tensor, max_seqlen: int,
                 aux_layers: tuple[int, ...] = ()) -> ForwardBatch:
    """One token ([1] ids, [1] int64 positions, both on the device, so that a CUDA graph may
    capture the batch and change them between replays) decoding over its request's cache;
    max_seqlen bounds its position + 1."""
    return ForwardBatch(input_ids, positions, positions, req_to_token,
                        decode_rows=torch.zeros(1, dtype=torch.int32, device=input_ids.device),
                        decode_seq_lens=(positions + 1).int(), decode_max_seqlen=max_seqlen, aux_layers=aux_layers)
