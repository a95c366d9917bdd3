"""The multi-token-prediction (MTP) layer that Qwen3-Next and Qwen3.5 checkpoints ship beside the
model (`mtp.*`, which transformers does not load), served as a draft head.

Its row at position p reads the target's final hidden state at p (after the model's last norm:
the state that predicted token p + 1) beside the embedding of token p + 1, and predicts token p + 2:

    x      = fc(concat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)))  [T, 2H] -> [T, H]
    out    = norm(one decoder layer of the family's full attention (gated, q/k norms, partial
             rotary) and its MLP (experts and a shared one where the model has experts), over x)
    logits = the target's lm_head(out)

A chained step feeds `out` (the head's own final hidden state) in place of the target's. The
embedding, the LM head and the rotary table are the target's; the norms are zero-centred as the
model's. Checkpoint names: `mtp.fc.weight` [H, 2H], `mtp.pre_fc_norm_embedding.weight`,
`mtp.pre_fc_norm_hidden.weight`, `mtp.layers.0.*` (a decoder layer's names), `mtp.norm.weight`.
The config counts the layers (`mtp_num_hidden_layers`, Qwen3-Next's `num_nextn_predict_layers`);
the published checkpoints have one, the one served here.
"""

from __future__ import annotations

import logging
import time

import torch

from lightllm.common.token_table import TokenTable
from lightllm.utils.dist import TPGroup

from .config import ModelConfig, ModelConfigError
from .layers import ForwardBatch, GatedMLP, RMSNorm
from .qwen3_next import GatedAttention, HybridModel, SharedExpertMoE, _linear
from .weights import CheckpointWeights, DummyWeights

logger = logging.getLogger(__name__)

PREFIX = "mtp"


class MtpHead:
    def __init__(self, cfg: ModelConfig, weights, tp: TPGroup, target: HybridModel):
        hidden, layer = cfg.hidden_size, f"{PREFIX}.layers.0"
        self.hidden_size = hidden

        def norm(name: str) -> RMSNorm:
            return RMSNorm(weights, f"{PREFIX}.{name}.weight", hidden, cfg.rms_norm_eps, offset=cfg.norm_offset)

        self.embed_norm, self.hidden_norm = norm("pre_fc_norm_embedding"), norm("pre_fc_norm_hidden")
        # replicated: every rank takes the whole embedding and hidden state, and gives the whole x
        self.fc = _linear(weights.get(f"{PREFIX}.fc.weight", (hidden, 2 * hidden)), cfg.quantization)
        self.input_norm, self.post_norm = norm("layers.0.input_layernorm"), norm("layers.0.post_attention_layernorm")
        self.attn = GatedAttention(weights, tp, cfg, f"{layer}.self_attn")
        self.mlp = SharedExpertMoE(weights, tp, cfg, layer) if cfg.moe else GatedMLP(weights, tp, cfg, f"{layer}.mlp")
        self.norm = norm("norm")
        self.embed, self.lm_head, self.rotary = target.embed, target.lm_head, target.rotary
        self.kv_shapes = [(self.attn.kv_heads, cfg.head_dim)]  # its token table's one K/V buffer
        self.dtype = target.dtype

    def forward(self, batch: ForwardBatch, kv: TokenTable, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features [T, hidden]: the target's final hidden states, or the head's own of the step
        before. Returns fp32 logits [S, vocab] of the tokens at batch.logit_index (all when None)
        and the output hidden states [T, hidden] (what a chained step takes as its features)."""
        emb, _ = self.embed_norm(self.embed(batch.input_ids), None)
        hidden, _ = self.hidden_norm(features, None)
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        h, residual = self.input_norm(x, None)
        h, residual = self.post_norm(self.attn(h, batch, self.rotary(batch.positions), kv.k[0], kv.v[0]), residual)
        out, _ = self.norm(self.mlp(h), residual)
        return self.lm_head(out if batch.logit_index is None else out[batch.logit_index]), out

    @staticmethod
    def target_ids(ids: torch.Tensor) -> torch.Tensor:
        """Its vocabulary is the target's."""
        return ids


def load_mtp(cfg: ModelConfig, target, *, dtype: torch.dtype, device: torch.device, tp: TPGroup,
             load_format: str = "auto") -> MtpHead:
    """The MTP head of the target's checkpoint for this TP rank (random under "dummy"; under
    "dummy_echo" an echo head: beside an echo target every draft is the target's own next token)."""
    if not isinstance(target, HybridModel):
        raise ModelConfigError(f"the mtp method drafts with the MTP layers of Qwen3-Next and Qwen3.5 checkpoints, "
                               f"not {cfg.architecture}")
    if cfg.linear_attn.mtp_layers != 1:
        raise ModelConfigError(f"{cfg.model_dir}: config.json names {cfg.linear_attn.mtp_layers} MTP layers "
                               "(mtp_num_hidden_layers); the mtp method serves checkpoints with one")
    start = time.perf_counter()
    weights = (DummyWeights(dtype, device, seed=tp.rank + 1, echo=load_format == "dummy_echo")
               if load_format.startswith("dummy") else CheckpointWeights(cfg.model_dir, dtype, device))
    with torch.inference_mode():
        head = MtpHead(cfg, weights, tp, target)
    logger.info("loaded the MTP layer of %s (%s weights, %s) in %.1f s", cfg.model_dir, load_format, dtype,
                time.perf_counter() - start)
    return head
