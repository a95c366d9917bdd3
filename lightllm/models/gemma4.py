"""Gemma 4's text model (`Gemma4ForCausalLM`, and the language model of a multimodal
`Gemma4ForConditionalGeneration` checkpoint): Gemma 3's layers with what Gemma 4 brings
(config.py's Gemma4Layers). Global layers have heads of their own size and count, their rotary
turns a part of each head only (proportional rope), and their v may be k's projection; v is normed
without a scale. The last layers attend over the K/V that the last earlier layer of their type
wrote: they have no k/v projections and own no buffer in the token table. Each layer adds a
per-layer input after its MLP (a gated projection of the token's slice of a second embedding table,
mixed with a projection of the embeddings) and scales its output by a learned scalar.

Checkpoint layout under `model.` (multimodal: `model.language_model.`): `embed_tokens_per_layer`
[V', L P], `per_layer_model_projection` [L P, H], `per_layer_projection_norm` [P]; per layer
`per_layer_input_gate` [P, H], `per_layer_projection` [H, P], `post_per_layer_input_norm` [H],
`layer_scalar` [1].
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from lightllm.common.token_table import TokenTable
from lightllm.kernels import route_topk
from lightllm.kernels.fused_moe import interleave_gate_up
from lightllm.kernels.extend_attention import extend_block_m
from lightllm.utils.dist import TPGroup

from . import layers, moe
from .config import ModelConfig, ModelConfigError
from .layers import (Attention, ColumnParallelLinear, ForwardBatch, GatedMLP, ParallelLMHead, RMSNorm,
                     RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding, split_even, split_kv_heads,
                     vocab_shard)


class _UnitWeights:
    """A weight source of ones: the scale of a norm that has none (Gemma 4's v norm)."""

    def __init__(self, like: torch.Tensor):
        self.like = like

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.ones(shape, dtype=self.like.dtype, device=self.like.device)


def _rotate_(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] rotated in place (rotate_half), for a layer that writes no K/V."""
    half = q.shape[-1] // 2
    q1, q2 = q[..., :half].float(), q[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q.copy_(torch.cat((q1 * cos - q2 * sin, q2 * cos + q1 * sin), dim=-1))


class Gemma4Attention(Attention):
    """q/k/v projection, q, k and v normed per head, rotary, K/V written to this layer's buffer (or,
    in a layer that shares an earlier layer's, only q projected and rotated), attention, o."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, prefix: str, index: int):
        g, window = cfg.gemma4, cfg.window(index)
        d = cfg.head_dim if window else g.global_head_dim
        q_start, self.q_heads = split_even(cfg.num_heads, tp, "num_attention_heads")
        kv_start, self.kv_heads = split_kv_heads(cfg.num_kv_heads if window else g.global_kv_heads, tp)
        total_kv = (cfg.num_kv_heads if window else g.global_kv_heads) * d
        self.writes_kv = g.kv_source[index] == index
        self.k_eq_v = g.k_eq_v and not window
        names = ("k", "v")[: (1 if self.k_eq_v else 2) if self.writes_kv else 0]
        parts = [(f"{prefix}.q_proj", cfg.num_heads * d, q_start * d, self.q_heads * d)]
        parts += [(f"{prefix}.{n}_proj", total_kv, kv_start * d, self.kv_heads * d) for n in names]
        self.qkv = ColumnParallelLinear(weights, parts, cfg.hidden_size, cfg.qkv_bias, cfg.quantization)
        self.o = RowParallelLinear(weights, tp, f"{prefix}.o_proj", cfg.hidden_size, cfg.num_heads * d, q_start * d,
                                   self.q_heads * d, cfg.o_bias, cfg.quantization)
        self.head_dim, self.scale, self.window, self.softcap, self.sinks = d, 1.0, window, 0.0, None
        self.q_norm = RMSNorm(weights, f"{prefix}.q_norm.weight", d, cfg.rms_norm_eps)
        if self.writes_kv:
            self.k_norm = RMSNorm(weights, f"{prefix}.k_norm.weight", d, cfg.rms_norm_eps)
            self.v_norm = RMSNorm(_UnitWeights(self.q_norm.weight), "v_norm", d, cfg.rms_norm_eps)

    def __call__(self, h, batch: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor],
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(h)
        tokens, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.q_heads * d, self.kv_heads * d
        q = self.q_norm.heads(qkv[:, :q_size].view(tokens, -1, d))
        if not self.writes_kv:
            _rotate_(q, *rope)
        else:
            k = qkv[:, q_size:q_size + kv_size].view(tokens, -1, d)
            v = k if self.k_eq_v else qkv[:, q_size + kv_size:].view(tokens, -1, d)
            v, k = self.v_norm.heads(v), self.k_norm.heads(k)
            layers.rotary_kv_(q, k, v, *rope, k_cache, v_cache, batch.slots)  # looked up here: tests swap kernels
        return self.o(self._attend(q, batch, k_cache, v_cache).reshape(tokens, -1))


class Gemma4Experts:
    """The MoE variants' experts, beside the dense MLP: routed from the residual stream (normed
    without a scale, times a learned scale and hidden^-1/2), softmax over all experts, the top k
    renormalised and each weighted by its expert's scale; the experts (GELU) take the stream
    through a norm of their own. Tensor-parallel as SparseMoE: each rank a slice of every expert's
    intermediate dimension, one all-reduce.

    Checkpoint: `router.{proj.weight [E, H], scale [H], per_expert_scale [E]}`, `experts.gate_up_proj`
    [E, 2I, H] (the gate's I rows, then the up's) and `experts.down_proj` [E, H, I]."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, prefix: str):
        spec, hidden = cfg.moe, cfg.hidden_size
        start, count = split_even(spec.intermediate_size, tp, "moe_intermediate_size")
        self.router = weights.get(f"{prefix}.router.proj.weight", (spec.num_experts, hidden))
        # the router's scale and hidden^-1/2 as one vector: its input is normed, so the product is the same
        self.router_scale = weights.get(f"{prefix}.router.scale", (hidden,)) * hidden ** -0.5
        self.expert_scale = weights.get(f"{prefix}.router.per_expert_scale", (spec.num_experts,)).float()
        self.router_norm = RMSNorm(_UnitWeights(self.router), "router.norm", hidden, cfg.rms_norm_eps)
        shape = (spec.num_experts, 2 * spec.intermediate_size, hidden)
        gate, up = (weights.get(f"{prefix}.experts.gate_up_proj", shape, 1, first, count)
                    for first in (start, spec.intermediate_size + start))
        down = weights.get(f"{prefix}.experts.down_proj", (spec.num_experts, hidden, spec.intermediate_size), 2, start,
                           count)
        self.experts = (interleave_gate_up(gate, up), down)
        self.top_k, self.tp = spec.top_k, tp

    def __call__(self, stream: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """stream: the residual stream, which routes; h: the experts' input (its normed copy)."""
        routed, _ = self.router_norm(stream, None)
        weights, ids = route_topk(F.linear(routed * self.router_scale, self.router), self.top_k, True)
        weights = weights * self.expert_scale[ids.long()]
        return self.tp.all_reduce(moe.fused_moe(h, *self.experts, weights, ids, gelu=True))


class Gemma4Layer:
    """norm -> attention -> norm, added to the stream; norm -> MLP -> norm, added; the per-layer
    input's gated projection, normed, added; the whole stream times the layer's scalar."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, index: int):
        g = cfg.gemma4
        prefix = f"{g.prefix}layers.{index}"

        def norm(name: str) -> RMSNorm:
            return RMSNorm(weights, f"{prefix}.{name}.weight", cfg.hidden_size, cfg.rms_norm_eps)

        self.input_norm, self.attn_out_norm = norm("input_layernorm"), norm("post_attention_layernorm")
        self.mlp_norm, self.mlp_out_norm = norm("pre_feedforward_layernorm"), norm("post_feedforward_layernorm")
        self.attn = Gemma4Attention(weights, tp, cfg, f"{prefix}.self_attn", index)
        self.global_rope = not cfg.window(index)
        wide = g.double_wide_mlp and not self.attn.writes_kv
        mlp_cfg = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size * (2 if wide else 1))
        self.mlp = GatedMLP(weights, tp, mlp_cfg, f"{prefix}.mlp")
        self.experts = None
        if cfg.moe is not None:
            self.experts = Gemma4Experts(weights, tp, cfg, prefix)
            self.dense_out_norm, self.experts_out_norm = (norm(f"post_feedforward_layernorm_{n}") for n in "12")
            self.experts_norm = norm("pre_feedforward_layernorm_2")
        size, hidden = g.per_layer_input_size, cfg.hidden_size
        if size:  # replicated: [P, H] and [H, P] are small beside the layer's projections
            self.input_gate = weights.get(f"{prefix}.per_layer_input_gate.weight", (size, hidden))
            self.input_projection = weights.get(f"{prefix}.per_layer_projection.weight", (hidden, size))
            self.input_norm_out = norm("post_per_layer_input_norm")
        self.scalar = weights.get(f"{prefix}.layer_scalar", (1,))

    def __call__(self, x, batch: ForwardBatch, ropes, k_cache, v_cache, layer_input):
        h, _ = self.input_norm(x, None)
        attn, _ = self.attn_out_norm(self.attn(h, batch, ropes[self.global_rope], k_cache, v_cache), None)
        h, x = self.mlp_norm(attn, x)  # x += attn, in place
        mlp = self.mlp(h)
        if self.experts is not None:
            mlp, _ = self.dense_out_norm(mlp, None)
            experts, _ = self.experts_out_norm(self.experts(x, self.experts_norm(x, None)[0]), None)
            mlp = mlp + experts
        mlp, _ = self.mlp_out_norm(mlp, None)
        x = x + mlp
        if layer_input is not None:
            gated = F.gelu(F.linear(x, self.input_gate), approximate="tanh") * layer_input
            extra, _ = self.input_norm_out(F.linear(gated, self.input_projection), None)
            x = x + extra
        return x * self.scalar


class Gemma4Model:
    serves_lora = False  # not yet: --max_loras is refused for it
    lora = None

    def __init__(self, cfg: ModelConfig, weights, tp: TPGroup, max_positions: int, device: torch.device):
        g = self.gemma4 = cfg.gemma4
        if extend_block_m(cfg.head_dim) != extend_block_m(g.global_head_dim):
            raise ModelConfigError(f"head_dim {cfg.head_dim} and the global layers' {g.global_head_dim} take "
                                   "extend attention blocks of different sizes; supported: the same")
        self.config = cfg
        self.embed = VocabParallelEmbedding(weights, tp, f"{g.prefix}embed_tokens.weight", cfg.vocab_size,
                                            cfg.hidden_size)
        self.dtype = self.embed.weight.dtype
        # scales rounded to the activations' dtype, as transformers does
        self.embed_scale = torch.tensor(cfg.embed_scale, dtype=self.dtype).item()
        # [0] the sliding layers' rotary, [1] the global layers' (their own head size)
        self.ropes = (RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta, None, max_positions, device),
                      RotaryEmbedding(g.global_head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, device))
        self.layers = [Gemma4Layer(weights, tp, cfg, i) for i in range(cfg.num_layers)]
        writers = [i for i in range(cfg.num_layers) if g.kv_source[i] == i]
        self.kv_buffer = [writers.index(g.kv_source[i]) for i in range(cfg.num_layers)]  # layer -> its K/V buffer
        self.kv_shapes = [(self.layers[i].attn.kv_heads, self.layers[i].attn.head_dim) for i in writers]
        if g.per_layer_input_size:
            self._load_per_layer_inputs(weights, tp, cfg)
        self.norm = RMSNorm(weights, f"{g.prefix}norm.weight", cfg.hidden_size, cfg.rms_norm_eps)
        head = self.embed.weight if cfg.tie_word_embeddings else vocab_shard(
            weights, tp, "lm_head.weight", cfg.vocab_size, cfg.hidden_size)
        self.lm_head = ParallelLMHead(head, tp, cfg.vocab_size, tied=cfg.tie_word_embeddings,
                                      softcap=cfg.logit_softcap)

    def _load_per_layer_inputs(self, weights, tp: TPGroup, cfg: ModelConfig) -> None:
        g, width = self.gemma4, cfg.num_layers * self.gemma4.per_layer_input_size
        self.input_embed = VocabParallelEmbedding(weights, tp, f"{g.prefix}embed_tokens_per_layer.weight",
                                                  g.per_layer_vocab_size, width)
        self.input_embed_scale = torch.tensor(g.per_layer_input_size ** 0.5, dtype=self.dtype).item()
        self.input_projection = weights.get(f"{g.prefix}per_layer_model_projection.weight", (width, cfg.hidden_size))
        self.input_projection_norm = RMSNorm(weights, f"{g.prefix}per_layer_projection_norm.weight",
                                             g.per_layer_input_size, cfg.rms_norm_eps)

    def _per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[T, L, P]: each token's slice of the per-layer table, plus the normed projection of its
        embedding, over sqrt(2)."""
        if not self.gemma4.per_layer_input_size:
            return None
        shape = (x.shape[0], self.config.num_layers, self.gemma4.per_layer_input_size)
        own = (self.input_embed(ids) * self.input_embed_scale).view(shape)
        projected = F.linear(x, self.input_projection) * self.config.hidden_size ** -0.5
        mixed, _ = self.input_projection_norm(projected.view(-1, shape[-1]), None)
        return (mixed.view(shape) + own) * 2 ** -0.5

    def forward(self, batch: ForwardBatch, kv: TokenTable) -> torch.Tensor:
        """fp32 logits [S, vocab] of the tokens at batch.logit_index (all tokens when None)."""
        x = self.embed(batch.input_ids) * self.embed_scale
        layer_inputs = self._per_layer_inputs(batch.input_ids, x)
        ropes = tuple(rope(batch.positions) for rope in self.ropes)
        for i, layer in enumerate(self.layers):
            buffer = self.kv_buffer[i]
            x = layer(x, batch, ropes, kv.k[buffer], kv.v[buffer], None if layer_inputs is None else layer_inputs[:, i])
        if batch.logit_index is not None:
            x = x[batch.logit_index]
        h, _ = self.norm(x, None)
        return self.lm_head(h)
