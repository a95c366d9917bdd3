"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, and with experts Mixtral and Qwen3-MoE): one model,
differences come from the config."""

from __future__ import annotations

import torch

from lightllm.common.token_table import TokenTable
from lightllm.utils.dist import TPGroup

from .config import ModelConfig
from .layers import (Attention, ForwardBatch, GatedMLP, ParallelLMHead, RMSNorm, RotaryEmbedding,
                     VocabParallelEmbedding, vocab_shard)
from .moe import SparseMoE


class DecoderLayer:
    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, index: int):
        prefix = f"model.layers.{index}"
        fp8 = cfg.quantization == "fp8"  # the norms feed the q/k/v and gate/up projections their fp8 input
        sparse = cfg.moe is not None and index in cfg.moe.layers
        self.input_norm = RMSNorm(weights, f"{prefix}.input_layernorm.weight", cfg.hidden_size, cfg.rms_norm_eps,
                                  fp8)
        self.attn = Attention(weights, tp, cfg, f"{prefix}.self_attn")
        # the router reads the experts' input unquantised: fused_moe quantises it for the experts
        self.post_norm = RMSNorm(weights, f"{prefix}.post_attention_layernorm.weight", cfg.hidden_size,
                                 cfg.rms_norm_eps, fp8 and not sparse)
        self.mlp = SparseMoE(weights, tp, cfg, prefix) if sparse else GatedMLP(weights, tp, cfg, f"{prefix}.mlp")

    def __call__(self, x, residual, batch: ForwardBatch, rope, k_cache, v_cache):
        h, residual = self.input_norm(x, residual)
        x = self.attn(h, batch, rope, k_cache, v_cache)
        h, residual = self.post_norm(x, residual)
        return self.mlp(h), residual


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights, tp: TPGroup, max_positions: int, device: torch.device):
        self.config = cfg
        self.embed = VocabParallelEmbedding(weights, tp, "model.embed_tokens.weight", cfg.vocab_size,
                                            cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, device)
        self.layers = [DecoderLayer(weights, tp, cfg, i) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(weights, "model.norm.weight", cfg.hidden_size, cfg.rms_norm_eps)
        head = self.embed.weight if cfg.tie_word_embeddings else vocab_shard(
            weights, tp, "lm_head.weight", cfg.vocab_size, cfg.hidden_size)
        self.lm_head = ParallelLMHead(head, tp, cfg.vocab_size, tied=cfg.tie_word_embeddings)
        self.kv_heads = self.layers[0].attn.kv_heads  # per rank
        self.dtype = self.embed.weight.dtype

    def forward(self, batch: ForwardBatch, kv: TokenTable) -> torch.Tensor:
        """fp32 logits [S, vocab] of the tokens at batch.logit_index (all tokens when None)."""
        x, residual = self.embed(batch.input_ids), None
        rope = self.rotary(batch.positions)
        for layer, k_cache, v_cache in zip(self.layers, kv.k, kv.v):
            x, residual = layer(x, residual, batch, rope, k_cache, v_cache)
        if batch.logit_index is not None:
            x, residual = x[batch.logit_index], residual[batch.logit_index]
        h, _ = self.norm(x, residual)
        return self.lm_head(h)
