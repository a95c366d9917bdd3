"""The recurrent state of the hybrid models' linear-attention layers, one slot per request row.

Each Gated DeltaNet layer keeps, per running request, its causal convolution's last inputs
[conv_dim, kernel - 1] (the model's dtype) and its recurrent state [v_heads, k_dim, v_dim]
(fp32, as the delta rule accumulates it, unless --mamba_ssm_cache_dtype asks for less; the
kernels compute in fp32 whatever the pool holds). Slot i belongs to request row i (ReqTable), so a
request that holds a row holds its state: the scheduler's row limit is the state's admission
limit, and the pool is allocated once at start, before the KV budget is measured, so that its
memory is counted as in use there. A request's first chunk starts from zeros (the model does not
read the slot then), so a freed row needs no clearing. One more slot serves a padding row.

The prefix cache's snapshots of the state (models with recurrent state) are a second pool of the
same shapes (`like`), its slots named by the radix tree; `copy_slot` moves one slot's state, every
layer's, between the two.

Speculative decoding verifies drafts without moving the states (a rejected draft must leave no
trace): the verify pass reads each request's state, and stashes per linear layer the small inputs
of each verified token's recurrence (`VerifyStash`: the conv input, the decay and the write
strength); once the host knows how many drafts were accepted, a commit pass advances the states
over the accepted tokens alone. The stash holds a token where a state copy would hold a request's
whole state (qwen3.5-27b: about 1 MiB a token against 146.8 MiB a request).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class StatePool:
    def __init__(self, slots: int, num_layers: int, conv_shape: tuple[int, int], recurrent_shape: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device | str, recurrent_dtype: torch.dtype = torch.float32):
        self.slots = slots
        self.conv = [torch.zeros((slots, *conv_shape), dtype=dtype, device=device) for _ in range(num_layers)]
        self.recurrent = [torch.zeros((slots, *recurrent_shape), dtype=recurrent_dtype, device=device)
                          for _ in range(num_layers)]
        logger.info("state pool: %d slots x %d linear-attention layers, %.2f MiB a request, %.2f GiB",
                    slots, num_layers, self.slot_bytes() / 2**20, self.nbytes() / 2**30)

    def like(self, slots: int) -> StatePool:
        """A pool of `slots` slots of this one's shapes, on its device."""
        conv, recurrent = self.conv[0], self.recurrent[0]
        return StatePool(slots, len(self.conv), tuple(conv.shape[1:]), tuple(recurrent.shape[1:]), conv.dtype,
                         conv.device, recurrent.dtype)

    def copy_slot(self, slot: int, source: StatePool, source_slot: int) -> None:
        """Slot `slot` takes `source`'s slot `source_slot` (every layer's conv and recurrent state)."""
        for mine, theirs in zip(self.conv + self.recurrent, source.conv + source.recurrent):
            mine[slot].copy_(theirs[source_slot])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.recurrent)

    def slot_bytes(self) -> int:
        return self.nbytes() // self.slots


class VerifyStash:
    """Per linear layer, the recurrence inputs of a verify step's decode tokens (`tokens` at most):
    conv inputs [N, conv_dim] (the model's dtype), decay g and write strength beta [N, v_heads] fp32."""

    def __init__(self, tokens: int, num_layers: int, conv_channels: int, v_heads: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.tokens = tokens
        self.mixed = [torch.zeros((tokens, conv_channels), dtype=dtype, device=device) for _ in range(num_layers)]
        self.g, self.beta = ([torch.zeros((tokens, v_heads), dtype=torch.float32, device=device)
                              for _ in range(num_layers)] for _ in range(2))

    @staticmethod
    def token_bytes(num_layers: int, conv_channels: int, v_heads: int, dtype: torch.dtype) -> int:
        return num_layers * (conv_channels * dtype.itemsize + 2 * v_heads * 4)
