"""The decoder family (Llama 2/3/3.1, Mistral, Qwen2/3, Gemma 2/3, and with experts Mixtral,
Qwen3-MoE and gpt-oss): one model, the differences come from the config (config.py): q/k norms, sliding-window
layers, Gemma's extra norms, scaled embeddings, soft caps and a second rotary base for its sliding
layers, attention sinks, and which layers' MLP is a mixture of experts (moe.py; gpt-oss's own in
gpt_oss.py)."""

from __future__ import annotations

import torch

from lightllm.common.token_table import TokenTable
from lightllm.utils.dist import TPGroup

from .config import ModelConfig
from .layers import (Attention, ForwardBatch, GatedMLP, ParallelLMHead, RMSNorm, RotaryEmbedding,
                     VocabParallelEmbedding, vocab_shard)
from .gpt_oss import GptOssMoE
from .moe import SparseMoE

MOE_LAYERS = {"GptOssForCausalLM": GptOssMoE}  # architecture -> its experts' layer, where not SparseMoE


class DecoderLayer:
    """norm -> attention -> norm -> MLP, each added to the residual stream; with sandwich norms
    (Gemma) the attention's and the MLP's outputs are normed too before they are added."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, index: int):
        prefix = f"model.layers.{index}"
        fp8 = cfg.quantization == "fp8"  # the norms feed the q/k/v and gate/up projections their fp8 input
        sparse = cfg.moe is not None and index in cfg.moe.layers

        def norm(name: str, fp8_out: bool = False) -> RMSNorm:
            return RMSNorm(weights, f"{prefix}.{name}.weight", cfg.hidden_size, cfg.rms_norm_eps, fp8_out,
                           cfg.norm_offset)

        self.input_norm = norm("input_layernorm", fp8)
        self.attn = Attention(weights, tp, cfg, f"{prefix}.self_attn", cfg.window(index))
        self.local_rope = bool(cfg.local_rope_theta and cfg.window(index))
        moe_layer = MOE_LAYERS.get(cfg.architecture, SparseMoE)
        self.mlp = moe_layer(weights, tp, cfg, prefix) if sparse else GatedMLP(weights, tp, cfg, f"{prefix}.mlp")
        mlp_fp8 = fp8 and not sparse  # a router reads the experts' input unquantised (fused_moe quantises it)
        self.attn_out_norm = self.mlp_out_norm = None
        if cfg.sandwich_norms:  # Gemma's post_attention_layernorm is on the attention's output
            self.attn_out_norm = norm("post_attention_layernorm")
            self.post_norm = norm("pre_feedforward_layernorm", mlp_fp8)
            self.mlp_out_norm = norm("post_feedforward_layernorm")
        else:
            self.post_norm = norm("post_attention_layernorm", mlp_fp8)
            # tp > 1: the all-reduce fused with the norm's add; tp 1: the norm adds a small step's LoRA share
            self.attn.o.defer_reduce(self.post_norm) or self.attn.o.defer_lora_sum(self.post_norm)

    def defer_mlp_reduce(self, next_norm: RMSNorm, last: bool) -> None:
        """tp > 1: the MLP's or the experts' all-reduce left to the norm that takes their output
        next (the next layer's input norm, or the final one), fused with its residual add; tp 1:
        the sum of a dense MLP's down projection's slices of K, in small bf16 steps
        (defer_split_sum), and but for the `last` layer (whose output the model indexes before its
        norm) a small step's LoRA share (defer_lora_sum). Not with sandwich norms (their output norm
        needs the sum alone)."""
        if self.mlp_out_norm is not None:
            return
        if isinstance(self.mlp, GatedMLP):
            down = self.mlp.down
            if not down.defer_reduce(next_norm):
                down.defer_split_sum(next_norm)
                if not last:
                    down.defer_lora_sum(next_norm)
        else:
            self.mlp.defer_reduce(next_norm)

    def __call__(self, x, residual, batch: ForwardBatch, ropes, k_cache, v_cache, capture: list | None = None):
        """capture: where given, the residual stream entering this layer is appended to it (a copy:
        the norm after attention adds to the stream in place)."""
        h, residual = self.input_norm(x, residual)
        if capture is not None:
            capture.append(residual.clone())
        x = self.attn(h, batch, ropes[self.local_rope], k_cache, v_cache)
        if self.attn_out_norm is not None:
            x, _ = self.attn_out_norm(x, None)
        h, residual = self.post_norm(x, residual)
        x = self.mlp(h)
        if self.mlp_out_norm is not None:
            x, _ = self.mlp_out_norm(x, None)
        return x, residual


class LlamaModel:
    serves_lora = True  # its forward prepares the LoRA slots' segments for each step

    def __init__(self, cfg: ModelConfig, weights, tp: TPGroup, max_positions: int, device: torch.device):
        self.config = cfg
        self.embed = VocabParallelEmbedding(weights, tp, "model.embed_tokens.weight", cfg.vocab_size,
                                            cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, device)
        self.local_rotary = (RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta, None, max_positions, device)
                             if cfg.local_rope_theta else None)
        self.layers = [DecoderLayer(weights, tp, cfg, i) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(weights, "model.norm.weight", cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.norm_offset)
        for layer, next_norm in zip(self.layers, [later.input_norm for later in self.layers[1:]] + [self.norm]):
            layer.defer_mlp_reduce(next_norm, last=next_norm is self.norm)
        head = self.embed.weight if cfg.tie_word_embeddings else vocab_shard(
            weights, tp, "lm_head.weight", cfg.vocab_size, cfg.hidden_size)
        self.lm_head = ParallelLMHead(head, tp, cfg.vocab_size, tied=cfg.tie_word_embeddings,
                                      softcap=cfg.logit_softcap)
        self.kv_heads = self.layers[0].attn.kv_heads  # per rank
        self.kv_shapes = [(self.kv_heads, cfg.head_dim)] * cfg.num_layers  # each K/V buffer's (heads, dim)
        self.dtype = self.embed.weight.dtype
        # Gemma scales by sqrt(hidden) rounded to the activations' dtype, as transformers does
        self.embed_scale = torch.tensor(cfg.embed_scale, dtype=self.dtype).item()
        self.lora = None  # models/lora.py's LoraSlots, where LoRA adapters are served


    def forward(self, batch: ForwardBatch, kv: TokenTable) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits [S, vocab] of the tokens at batch.logit_index (all tokens when None); with
        batch.aux_layers also the input hidden states of those layers for all T tokens,
        concatenated in layer order ([T, len(aux_layers) x hidden], an EAGLE-3 head's features)."""
        if self.lora is not None:
            self.lora.prepare(batch.lora_slots)
        x, residual = self.embed(batch.input_ids), None
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        # each layer takes (cos, sin) of its own base: [0] the global one, [1] the sliding layers' (Gemma 3)
        local = None if self.local_rotary is None else self.local_rotary(batch.positions)
        ropes = (self.rotary(batch.positions), local)
        aux = [] if batch.aux_layers else None
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, kv.k, kv.v)):
            x, residual = layer(x, residual, batch, ropes, k_cache, v_cache, aux if i in batch.aux_layers else None)
        if batch.logit_index is not None:  # x may be the last projection's partial sums [P, T, H]
            x, residual = x[..., batch.logit_index, :], residual[batch.logit_index]
        h, _ = self.norm(x, residual)
        if aux is None:
            return self.lm_head(h)
        assert len(aux) == len(batch.aux_layers), f"aux layers {batch.aux_layers} of {len(self.layers)} layers"
        return self.lm_head(h), torch.cat(aux, dim=-1)
