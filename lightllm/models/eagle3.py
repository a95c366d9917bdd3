"""EAGLE-3 draft heads (Li et al., arXiv 2503.01840) in their published checkpoint layout, for
targets of the Llama family (Llama, Qwen2/3 and the rest of llama.py's).

A head is one Llama decoder layer that reads the target's token embedding beside a feature:

    g   = fc(concat of the target's hidden states entering three layers)  [T, 3 Ht] -> [T, H]  (first step)
        | the head's own output hidden state of the step before          [T, H]                (chained steps)
    x   = concat(input_layernorm(embed(token)), hidden_norm(g))          [T, 2 H]  (q/k/v read 2 H)
    r   = g + o(attention(x));  out = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(out)) over draft_vocab_size tokens; target id = draft id + d2t[draft id]

The row at position p pairs the target's feature at p (the hidden states that predicted token
p + 1) with the token at p + 1, and predicts token p + 2: a head's K/V are those of its own
positions, in a token table of its own (one layer). Checkpoint names: `fc.weight`,
`midlayer.*` (or `layers.0.*`), `norm.weight`, `lm_head.weight`, `d2t` and `t2d` (the target
vocabulary's mask of draft tokens: training only, not read); `embed_tokens.weight` where the
head carries its own embedding, else the target's is shared. Which target layers feed fc:
Eagle3Config.aux_layers; the target returns them beside its logits (ForwardBatch.aux_layers).
"""

from __future__ import annotations

import logging
import time

import torch

from lightllm.common.token_table import TokenTable
from lightllm.utils.dist import TPGroup

from .config import Eagle3Config, ModelConfigError
from .layers import (Attention, ForwardBatch, GatedMLP, ParallelLMHead, RMSNorm, RotaryEmbedding, RowParallelLinear,
                     VocabParallelEmbedding, split_even, vocab_shard)
from .weights import CheckpointWeights, DummyWeights, WeightLoadError

logger = logging.getLogger(__name__)

LAYER_PREFIXES = ("midlayer", "layers.0")  # the published heads' name of the decoder layer, then the speculators'


def _layer_prefix(weights) -> str:
    return next((p for p in LAYER_PREFIXES if weights.has(f"{p}.input_layernorm.weight")), LAYER_PREFIXES[0])


class Eagle3Head:
    def __init__(self, cfg: Eagle3Config, weights, tp: TPGroup, max_positions: int, device: torch.device,
                 target_embed: VocabParallelEmbedding | None = None):
        """target_embed: the target's embedding, shared unless the checkpoint has one of its own."""
        layer, hidden = cfg.layer, cfg.layer.hidden_size
        prefix = _layer_prefix(weights)
        self.config = cfg
        own_embed = target_embed is None or weights.has("embed_tokens.weight")
        self.embed = (VocabParallelEmbedding(weights, tp, "embed_tokens.weight", layer.vocab_size, hidden)
                      if own_embed else target_embed)

        def norm(name: str) -> RMSNorm:
            return RMSNorm(weights, name, hidden, layer.rms_norm_eps)

        self.input_norm, self.hidden_norm = norm(f"{prefix}.input_layernorm.weight"), norm(f"{prefix}.hidden_norm.weight")
        self.attn = Attention(weights, tp, layer, f"{prefix}.self_attn", in_features=2 * hidden)
        self.post_norm = norm(f"{prefix}.post_attention_layernorm.weight")
        self.mlp = GatedMLP(weights, tp, layer, f"{prefix}.mlp")
        self.norm = norm("norm.weight")
        self.fc_in = 3 * cfg.target_hidden_size
        self.hidden_size = hidden  # of its layer: the hidden states a chained step takes and gives
        start, count = split_even(self.fc_in, tp, "3 x target_hidden_size")
        self.fc = RowParallelLinear(weights, tp, "fc", hidden, self.fc_in, start, count, False)
        self.fc_slice = slice(start, start + count)  # this rank's features of fc's input
        self.lm_head = ParallelLMHead(vocab_shard(weights, tp, "lm_head.weight", cfg.draft_vocab_size, hidden), tp,
                                      cfg.draft_vocab_size, tied=False)
        self.draft_to_target = _draft_to_target(weights, cfg, device)  # [draft vocab] int64
        self.rotary = RotaryEmbedding(layer.head_dim, layer.rope_theta, layer.rope_scaling, max_positions, device)
        self.kv_heads = self.attn.kv_heads  # per rank
        self.kv_shapes = [(self.kv_heads, layer.head_dim)]  # its token table's one K/V buffer
        self.dtype = self.norm.weight.dtype

    def forward(self, batch: ForwardBatch, kv: TokenTable, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features: the target's hidden states entering its aux layers [T, 3 x target hidden]
        (Eagle3Config.aux_layers; through fc), or the head's own output hidden states of the step before [T, hidden] (not changed).
        Returns fp32 logits over the draft vocabulary [S, draft vocab] of the tokens at
        batch.logit_index (all when None), and the output hidden states [T, hidden] (before the
        final norm: what a chained step takes as its features)."""
        if features.shape[-1] == self.fc_in:
            residual = self.feature(features)
        else:
            residual = features.clone()  # the norms below add to the stream in place
        emb, _ = self.input_norm(self.embed(batch.input_ids), None)
        feature, _ = self.hidden_norm(residual, None)
        if self.config.norm_before_residual:
            residual = feature.clone()
        x = self.attn(torch.cat([emb, feature], dim=-1), batch, self.rotary(batch.positions), kv.k[0], kv.v[0])
        h, residual = self.post_norm(x, residual)
        h, residual = self.norm(self.mlp(h), residual)
        if batch.logit_index is not None:
            h = h[batch.logit_index]
        return self.lm_head(h), residual

    def feature(self, aux: torch.Tensor) -> torch.Tensor:
        """The head's input feature [T, hidden] of the target's aux hidden states [T, 3 x target
        hidden]: fc over this rank's share of them, all-reduced (every rank has the whole)."""
        return self.fc(aux[:, self.fc_slice])

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """The target vocabulary's ids of draft-vocabulary ids."""
        return self.draft_to_target[draft_ids]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [S, draft vocab] spread over the target's vocabulary [S, vocab],
        -inf at the tokens the head cannot propose (its distribution for rejection sampling)."""
        full = logits.new_full((logits.shape[0], self.config.layer.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_to_target, logits)


def _draft_to_target(weights, cfg: Eagle3Config, device: torch.device) -> torch.Tensor:
    """arange + d2t: each draft token's id in the target's vocabulary; without d2t (a head over
    the whole vocabulary, or dummy weights) the first draft_vocab_size ids."""
    draft, vocab = cfg.draft_vocab_size, cfg.layer.vocab_size
    ids = torch.arange(draft, dtype=torch.int64, device=device)
    if not weights.has("d2t"):
        if draft != vocab and not isinstance(weights, DummyWeights):
            raise WeightLoadError(f"the head's vocabulary ({draft}) is not the target's ({vocab}) and "
                                  f"{cfg.layer.model_dir} has no d2t to map it")
        return ids
    ids = ids + weights.get("d2t", (draft,), dtype=torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:  # once, at load
        raise WeightLoadError(f"d2t in {cfg.layer.model_dir} maps draft tokens outside the target's {vocab}")
    return ids


def load_eagle3(cfg: Eagle3Config, *, dtype: torch.dtype, device: torch.device, tp: TPGroup, max_positions: int,
                load_format: str = "auto", target_embed: VocabParallelEmbedding | None = None) -> Eagle3Head:
    """The head for this TP rank: weights from its checkpoint ("auto"), random ("dummy"), or an
    echo head ("dummy_echo", DummyWeights: beside an echo target of its vocabulary every draft is
    the target's own next token)."""
    if load_format not in ("auto", "dummy", "dummy_echo"):
        raise ModelConfigError(f"unsupported load_format {load_format!r} for an EAGLE-3 head; "
                               "supported: auto, dummy, dummy_echo")
    start = time.perf_counter()
    weights = (DummyWeights(dtype, device, seed=tp.rank + 1, echo=load_format == "dummy_echo")
               if load_format.startswith("dummy") else CheckpointWeights(cfg.layer.model_dir, dtype, device))
    with torch.inference_mode():
        head = Eagle3Head(cfg, weights, tp, max_positions, device, target_embed)
    logger.info("loaded the EAGLE-3 head %s (%s weights, %s, draft vocabulary %d) in %.1f s", cfg.layer.model_dir,
                load_format, dtype, cfg.draft_vocab_size, time.perf_counter() - start)
    return head
