"""The MTP layer of `{"method": "mtp"}` (models/mtp.py: shipped in the target's own checkpoint), run by
every worker beside the target as an EAGLE-3 head is (eagle3_runner.py), with other features.

Features. While it is served every target step stores, for each of its tokens, the target's final
hidden state (after the model's last norm) [hidden, the model's dtype] at the token's KV slot (one
row per target slot and one for the padding rows' scratch slot, counted in each token of the KV
budget as the head's are). Rows, KV and chains are the EAGLE-3 head's: the row at p pairs the
feature at p with the token at p + 1 and predicts p + 2; the MTP layer's K/V go to a token table of
its own with one row per target slot and k_max scratch rows per request row; a proposal catches up
on the rows its KV lacks, then k - 1 chained steps feed the layer's own output hidden state, replayed
from the head's decode graphs as an EAGLE-3 head's are (HeadGraphs; the catch-up runs eagerly). Its
vocabulary is the target's.
"""

from __future__ import annotations

import torch

from lightllm.engine.cuda_graph import graph_memory_bytes
from lightllm.engine.spec.eagle3_runner import Eagle3Runner
from lightllm.models import ModelConfig
from lightllm.models.mtp import load_mtp


class MtpRunner(Eagle3Runner):
    def __init__(self, target, target_config: ModelConfig, *, dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device, tp, k_max: int, rows: int, load_format: str = "auto"):
        """`target`: the loaded hybrid model, whose embedding, LM head and rotary the layer shares."""
        self.config = target_config
        self.head = load_mtp(target_config, target, dtype=dtype, device=device, tp=tp, load_format=load_format)
        self.features: torch.Tensor | None = None  # [target slots + 1, hidden]: each slot's final hidden state
        self._init_kv(self.head.kv_shapes, device, kv_dtype, k_max, rows)

    def target_forward(self, model):
        """The target's forward that also stores each token's final hidden state at its slot."""

        def forward(batch, kv):
            logits, hidden = model.forward_with_hidden(batch, kv)
            self.features.index_copy_(0, batch.slots, hidden)
            return logits

        return forward

    def graph_bytes(self, max_batch: int, target_graph_tokens: int, itemsize: int) -> int:
        """The chained steps' graphs (the target's graphs store one hidden state a token, in place)."""
        cfg = self.config
        return graph_memory_bytes(max_batch, max_batch, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
                                  itemsize)
