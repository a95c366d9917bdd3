"""The hybrid family (Qwen3-Next, Qwen3.5 dense and MoE, and the text model of the multimodal
Qwen3.5 checkpoints): Gated DeltaNet layers (linear attention over a recurrent state, config's
`layer_types`) beside gated full attention, zero-centred norms, and with experts a shared expert.

Full-attention layers keep K/V in the token table (only they: `ModelConfig.num_kv_layers`); the
linear layers keep a conv and a recurrent state per request row in the state pool
(common/state_pool.py). Their checkpoint tensors are rearranged once at load so that the shared
layers and kernels serve them unchanged:
- q_proj holds each head's query and output gate side by side: split into queries and gates, one
  GEMM with k and v still;
- rotary turns only the first `rotary_dim` of each head, pairing i with i + rotary_dim / 2: the
  q/k head dimensions (and the q/k norms' weights) are permuted so that those pairs become the
  i, i + head_dim / 2 pairs that rotary_kv_ turns, and the other angles are zero. q.k is the same
  under a common permutation of q's and k's dimensions, so attention is unchanged;
- Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped by key head, and Qwen3.5's in_proj_qkv/z/b/a
  become one projection [q | k | v | z | b | a] of this rank's heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from lightllm.common.state_pool import StatePool, VerifyStash
from lightllm.common.token_table import TokenTable
from lightllm.kernels import (causal_conv1d_chunks, causal_conv1d_runs, causal_conv1d_step, gated_delta_rule_chunks,
                              gated_delta_rule_runs, gated_delta_rule_step, gated_rms_norm, linear_gates, require_fla,
                              rotary_kv_)
from lightllm.kernels.gated_delta_rule import FlaPlan, fla_plan
from lightllm.utils.dist import TPGroup

from .config import ModelConfig, ModelConfigError
from .layers import (Attention, ColumnParallelLinear, ForwardBatch, GatedMLP, ParallelLMHead, RMSNorm,
                     RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding, split_even, split_kv_heads,
                     vocab_shard)
from .moe import SparseMoE


class _Tensors:
    """A weight source over tensors built here, for the shared linear layers to take as they are."""

    def __init__(self, **tensors: torch.Tensor):
        self.tensors = tensors

    def get(self, name: str, shape, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        tensor = self.tensors[name.removesuffix(".weight")]
        return tensor.narrow(dim, start, tensor.shape[dim] - start if length is None else length)


def _linear(weight: torch.Tensor, quantization: str | None) -> ColumnParallelLinear:
    return ColumnParallelLinear(_Tensors(w=weight), [("w", weight.shape[0], 0, weight.shape[0])], weight.shape[1],
                                False, quantization)


def rotary_pairing(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dimensions in which the rotated pairs (i, i + rotary_dim / 2) sit at
    (i, i + head_dim / 2), the unrotated ones filling the rest of each half."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = [*range(half), *range(rotary_dim, rotary_dim + rest)]
    second = [*range(half, rotary_dim), *range(rotary_dim + rest, head_dim)]
    return torch.tensor(first + second)


def partial_rotary(cfg: ModelConfig, max_positions: int, device: torch.device) -> RotaryEmbedding:
    """cos/sin [P, head_dim / 2]: rotary_dim's angles, then angle 0 for the unrotated pairs."""
    rotary = RotaryEmbedding(cfg.linear_attn.rotary_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, device)
    rest = cfg.head_dim // 2 - rotary.cos.shape[1]
    rotary.cos, rotary.sin = F.pad(rotary.cos, (0, rest), value=1.0), F.pad(rotary.sin, (0, rest))
    return rotary


class GatedAttention(Attention):
    """Full attention with an output gate: o(attention * sigmoid(gate)), q/k normed per head."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, prefix: str):
        d, hidden = cfg.head_dim, cfg.hidden_size
        if cfg.qkv_bias or cfg.o_bias:
            raise ModelConfigError("attention_bias=true is not supported for the hybrid models")
        q_start, self.q_heads = split_even(cfg.num_heads, tp, "num_attention_heads")
        kv_start, self.kv_heads = split_kv_heads(cfg.num_kv_heads, tp)
        order = rotary_pairing(d, cfg.linear_attn.rotary_dim)
        q_gate = weights.get(f"{prefix}.q_proj.weight", (2 * cfg.num_heads * d, hidden), 0, 2 * q_start * d,
                             2 * self.q_heads * d).view(self.q_heads, 2, d, hidden)
        k, v = (weights.get(f"{prefix}.{n}_proj.weight", (cfg.num_kv_heads * d, hidden), 0, kv_start * d,
                            self.kv_heads * d) for n in "kv")
        q, k = q_gate[:, 0, order], k.view(self.kv_heads, d, hidden)[:, order]
        self.qkv = _linear(torch.cat([q.reshape(-1, hidden), k.reshape(-1, hidden), v,
                                      q_gate[:, 1].reshape(-1, hidden)]), cfg.quantization)
        self.o = RowParallelLinear(weights, tp, f"{prefix}.o_proj", hidden, cfg.num_heads * d, q_start * d,
                                   self.q_heads * d, False, cfg.quantization)
        self.head_dim, self.scale, self.window, self.softcap, self.sinks = d, d ** -0.5, 0, 0.0, None
        self.q_norm, self.k_norm = (RMSNorm(weights, f"{prefix}.{n}_norm.weight", d, cfg.rms_norm_eps,
                                            offset=cfg.norm_offset) for n in "qk")
        self.q_norm.weight, self.k_norm.weight = self.q_norm.weight[order], self.k_norm.weight[order]

    def __call__(self, h, batch: ForwardBatch, rope, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(h)
        tokens, d = qkv.shape[0], self.head_dim
        q, k, v, gate = qkv.split([self.q_heads * d, self.kv_heads * d, self.kv_heads * d, self.q_heads * d], dim=-1)
        q, k = self.q_norm.heads(q.view(tokens, -1, d)), self.k_norm.heads(k.view(tokens, -1, d))
        rotary_kv_(q, k, v.view(tokens, -1, d), *rope, k_cache, v_cache, batch.slots)
        out = self._attend(q, batch, k_cache, v_cache).reshape(tokens, -1)
        return self.o(out * torch.sigmoid(gate))


@dataclass
class Sequences:
    """The step's requests as the linear layers take them: the decode rows (one token each, first),
    then the prompt chunks: their request rows, which of them start their request (and so start
    from zero states), and their bounds among all the step's tokens, all on the device (no host
    read: a padded step's forward is captured in a CUDA graph, cuda_graph.py). A padded step's
    padding decode rows (sequence length 1: a real decode follows at least one token), among them
    those over a mixed step's chunk tokens, are -1 here, and its padding chunks are empty: the
    kernels read and write no state for either, and the chunks' write their tokens' rows after the
    decodes'."""

    num_decodes: int
    decode_rows: torch.Tensor | None
    chunk_rows: torch.Tensor | None = None
    chunk_starts: torch.Tensor | None = None  # [C] bool: the chunk starts its request
    chunk_bounds: torch.Tensor | None = None  # [C+1] int32
    # a step that verifies drafts: each decoding request's row and run of tokens (its first among the
    # decode tokens and its length, on the device); None: one token a request, its state updated in place
    verify_rows: torch.Tensor | None = None
    verify_starts: torch.Tensor | None = None
    verify_lengths: torch.Tensor | None = None
    chunk_plan: FlaPlan | None = None  # the CUDA path's, made by the first linear layer, shared by the rest

    def plan_for(self, tokens: torch.Tensor) -> FlaPlan | None:
        """The chunks' `fla_plan` over the step's `tokens` on CUDA (None on the CPU, whose reference needs none)."""
        if self.chunk_plan is None and tokens.is_cuda:
            self.chunk_plan = fla_plan(self.chunk_bounds, tokens.shape[0])
        return self.chunk_plan

    @classmethod
    def of(cls, batch: ForwardBatch) -> Sequences:
        n = batch.num_decodes
        rows = None if not n else torch.where(batch.decode_seq_lens > 1, batch.decode_rows, -1).long()
        seqs = cls(n, rows)
        if batch.decode_verify and n:
            seqs.verify_rows, seqs.verify_starts, seqs.verify_lengths = verify_runs(rows)
        if not batch.has_chunks:
            return seqs
        cu = batch.ext_cu_q
        starts = batch.ext_kv_lens == cu[1:] - cu[:-1]
        seqs.chunk_rows, seqs.chunk_starts, seqs.chunk_bounds = batch.ext_rows.long(), starts, cu
        return seqs


def verify_runs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify step's runs from its decode rows [B] (each request's token and drafts on consecutive
    rows of its request row, padding -1), on the device and in fixed sizes (a CUDA graph replays
    them): for each position, the request row of the run that starts there, its first token and its
    length; positions inside a run (and padding) get row -1 and length 0, which the runs kernels skip."""
    at = torch.arange(rows.shape[0], device=rows.device)
    first = torch.ones_like(rows, dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    # the next run's first position after each position: a suffix minimum over the starts
    starts_at = torch.where(first, at, rows.shape[0])
    next_start = torch.cat([starts_at[1:].flip(0).cummin(0).values.flip(0), at.new_full((1,), rows.shape[0])])
    lengths = torch.where(first & (rows >= 0), next_start - at, 0)
    return torch.where(lengths > 0, rows, -1), at, lengths


class GatedDeltaNet:
    """in_proj -> causal conv1d over [q | k | v] -> gated delta rule -> gated norm by z -> out_proj.
    Tensor parallel over key heads (and the value heads that share them)."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, prefix: str):
        lin, hidden = cfg.linear_attn, cfg.hidden_size
        if lin.num_v_heads % lin.num_k_heads:
            raise ModelConfigError(f"linear_num_value_heads {lin.num_v_heads} is not a multiple of "
                                   f"linear_num_key_heads {lin.num_k_heads}")
        k_start, self.k_heads = split_even(lin.num_k_heads, tp, "linear_num_key_heads")
        ratio = lin.num_v_heads // lin.num_k_heads
        v_start, self.v_heads = k_start * ratio, self.k_heads * ratio
        self.dk, self.dv, self.eps = lin.k_head_dim, lin.v_head_dim, cfg.rms_norm_eps
        project = _grouped_projection if lin.grouped_projections else _separate_projection
        self.in_proj = _linear(project(weights, lin, prefix, hidden, k_start, self.k_heads), cfg.quantization)
        kd, vd = lin.num_k_heads * self.dk, lin.num_v_heads * self.dv
        conv = [(start * self.dk, self.k_heads * self.dk) for start in (k_start, lin.num_k_heads + k_start)]
        conv.append((2 * kd + v_start * self.dv, self.v_heads * self.dv))
        self.conv_weight = torch.cat([weights.get(f"{prefix}.conv1d.weight", (lin.conv_dim, 1, lin.conv_kernel), 0,
                                                  start, n) for start, n in conv])[:, 0]
        self.neg_a = -weights.get(f"{prefix}.A_log", (lin.num_v_heads,), 0, v_start, self.v_heads).float().exp()
        self.dt_bias = weights.get(f"{prefix}.dt_bias", (lin.num_v_heads,), 0, v_start, self.v_heads).float()
        self.norm_weight = weights.get(f"{prefix}.norm.weight", (self.dv,))
        self.out = RowParallelLinear(weights, tp, f"{prefix}.out_proj", hidden, vd, v_start * self.dv,
                                     self.v_heads * self.dv, False, cfg.quantization)

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.dk + self.v_heads * self.dv

    def __call__(self, h, seqs: Sequences, conv_states: torch.Tensor, states: torch.Tensor,
                 stash: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """`stash`: this layer's (conv inputs, g, beta) rows of the VerifyStash, for a step that verifies."""
        vd, vh = self.v_heads * self.dv, self.v_heads
        mixed, z, b, a = self.in_proj(h).split([self.conv_channels, vd, vh, vh], dim=-1)
        tokens = mixed.shape[0]
        g, beta = linear_gates(a, b, self.neg_a, self.dt_bias)
        if seqs.verify_rows is not None:  # the recurrence's inputs, for the commit of the accepted tokens
            n = seqs.num_decodes
            for kept, now in zip(stash, (mixed, g, beta)):
                kept[:n] = now[:n]
        q, k, v = self._heads(self._conv(mixed, seqs, conv_states))
        out = self._delta_rule(q, k, v, g, beta, seqs, states)
        out = gated_rms_norm(out, z.view(tokens, vh, self.dv), self.norm_weight, self.eps)
        return self.out(out.reshape(tokens, vd))

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kd, tokens = self.k_heads * self.dk, conv.shape[0]
        q, k, v = conv.split([kd, kd, self.v_heads * self.dv], dim=-1)
        return q.view(tokens, -1, self.dk), k.view(tokens, -1, self.dk), v.view(tokens, self.v_heads, self.dv)

    def commit(self, stash: tuple[torch.Tensor, ...], rows: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
               conv_states: torch.Tensor, states: torch.Tensor) -> None:
        """Advance the states of `rows` over the tokens each kept, stash rows [starts[i], starts[i] +
        lengths[i]), from the states the verify pass read."""
        mixed, g, beta = stash
        conv = causal_conv1d_runs(mixed, self.conv_weight, conv_states, rows, starts, lengths, update=True)
        _, k, v = self._heads(conv)
        gated_delta_rule_runs(k, k, v, g, beta, states, rows, starts, lengths, update=True)  # outputs unused

    def _conv(self, mixed: torch.Tensor, seqs: Sequences, conv_states: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(mixed)
        n = seqs.num_decodes
        if seqs.verify_rows is not None:  # read, not moved: the commit moves it past the accepted tokens
            out[:n] = causal_conv1d_runs(mixed[:n], self.conv_weight, conv_states, seqs.verify_rows,
                                         seqs.verify_starts, seqs.verify_lengths, update=False)
        elif n:
            causal_conv1d_step(mixed[:n], self.conv_weight, conv_states, seqs.decode_rows, out=out[:n])
        if seqs.chunk_rows is not None:  # after the decodes, whose rows a padded step's chunks may overlap
            causal_conv1d_chunks(mixed, self.conv_weight, seqs.chunk_bounds, conv_states, seqs.chunk_rows,
                                 seqs.chunk_starts, out, plan=seqs.plan_for(mixed))
        return out

    def _delta_rule(self, q, k, v, g, beta, seqs: Sequences, states: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(v)
        n = seqs.num_decodes
        if seqs.verify_rows is not None:
            out[:n] = gated_delta_rule_runs(q[:n], k[:n], v[:n], g[:n], beta[:n], states, seqs.verify_rows,
                                            seqs.verify_starts, seqs.verify_lengths, update=False)
        elif n:
            gated_delta_rule_step(q[:n], k[:n], v[:n], g[:n], beta[:n], states, seqs.decode_rows, out=out[:n])
        if seqs.chunk_rows is not None:
            gated_delta_rule_chunks(q, k, v, g, beta, seqs.chunk_bounds, states, seqs.chunk_rows, seqs.chunk_starts,
                                    out, plan=seqs.plan_for(v))
        return out


def _grouped_projection(weights, lin, prefix: str, hidden: int, k_start: int, k_heads: int) -> torch.Tensor:
    """Qwen3-Next: in_proj_qkvz holds per key head [q, k, v, z] (v and z of its value heads), in_proj_ba
    per key head [b, a]; returns this rank's rows as [q | k | v | z | b | a]."""
    ratio = lin.num_v_heads // lin.num_k_heads
    dk, vdim = lin.k_head_dim, ratio * lin.v_head_dim
    group = 2 * dk + 2 * vdim
    qkvz = weights.get(f"{prefix}.in_proj_qkvz.weight", (lin.num_k_heads * group, hidden), 0, k_start * group,
                       k_heads * group).view(k_heads, group, hidden)
    ba = weights.get(f"{prefix}.in_proj_ba.weight", (lin.num_k_heads * 2 * ratio, hidden), 0, k_start * 2 * ratio,
                     k_heads * 2 * ratio).view(k_heads, 2 * ratio, hidden)
    parts = qkvz.split([dk, dk, vdim, vdim], dim=1) + ba.split([ratio, ratio], dim=1)
    return torch.cat([p.reshape(-1, hidden) for p in parts])


def _separate_projection(weights, lin, prefix: str, hidden: int, k_start: int, k_heads: int) -> torch.Tensor:
    """Qwen3.5: in_proj_qkv [all q | all k | all v], in_proj_z, in_proj_b, in_proj_a; this rank's rows."""
    ratio, dk, dv = lin.num_v_heads // lin.num_k_heads, lin.k_head_dim, lin.v_head_dim
    kd, vd, v_start, v_heads = lin.num_k_heads * dk, lin.num_v_heads * dv, k_start * ratio, k_heads * ratio
    qkv = f"{prefix}.in_proj_qkv.weight"
    rows = [(qkv, 2 * kd + vd, k_start * dk, k_heads * dk), (qkv, 2 * kd + vd, kd + k_start * dk, k_heads * dk),
            (qkv, 2 * kd + vd, 2 * kd + v_start * dv, v_heads * dv), (f"{prefix}.in_proj_z.weight", vd, v_start * dv,
                                                                       v_heads * dv)]
    rows += [(f"{prefix}.in_proj_{n}.weight", lin.num_v_heads, v_start, v_heads) for n in "ba"]
    return torch.cat([weights.get(name, (out, hidden), 0, start, n) for name, out, start, n in rows])


class _FusedExperts:
    """The experts of a checkpoint that stores them fused, as the published Qwen3.5-MoE ones do
    (`mlp.experts.gate_up_proj` [E, 2I, H]: each expert's gate rows, then its up rows;
    `mlp.experts.down_proj` [E, H, I]), served under the per-expert names SparseMoE asks for."""

    def __init__(self, weights, experts_prefix: str, num_experts: int, hidden: int, inter: int):
        self.weights, self.prefix = weights, experts_prefix
        self.gate_up_shape, self.down_shape = (num_experts, 2 * inter, hidden), (num_experts, hidden, inter)

    def get(self, name: str, shape, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        if not name.startswith(self.prefix + "."):
            return self.weights.get(name, shape, dim, start, length)
        expert, proj, _ = name[len(self.prefix) + 1:].split(".")
        length = shape[dim] - start if length is None else length
        if proj == "down_proj":
            whole = self.weights.get(f"{self.prefix}.down_proj", self.down_shape, 0, int(expert), 1)[0]
            return whole.narrow(dim, start, length)
        rows = self.weights.get(f"{self.prefix}.gate_up_proj", self.gate_up_shape, 0, int(expert), 1)[0]
        return rows.narrow(0, (proj == "up_proj") * shape[0] + start, length)


class SharedExpertMoE:
    """The routed experts plus a shared expert whose output is scaled by sigmoid(x . shared_gate)."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, layer_prefix: str):
        fused = f"{layer_prefix}.mlp.experts"
        if f"{fused}.gate_up_proj" in getattr(weights, "entries", ()):
            weights = _FusedExperts(weights, fused, cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size)
        self.routed = SparseMoE(weights, tp, cfg, layer_prefix)
        shared = cfg.moe.shared_intermediate_size
        self.shared = GatedMLP(weights, tp, replace(cfg, intermediate_size=shared),
                               f"{layer_prefix}.mlp.shared_expert") if shared else None
        self.shared_gate = weights.get(f"{layer_prefix}.mlp.shared_expert_gate.weight", (1, cfg.hidden_size)) \
            if shared else None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        out = self.routed(h)
        if self.shared is None:
            return out
        return out + torch.sigmoid(F.linear(h, self.shared_gate)) * self.shared(h)


class HybridLayer:
    """norm -> Gated DeltaNet or gated attention -> norm -> MLP (dense, or experts and a shared one)."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, index: int, cache_index: int):
        prefix = f"{cfg.linear_attn.weight_prefix}.layers.{index}"
        self.linear = index in cfg.linear_attn.layers
        self.cache_index = cache_index  # into the state pool (linear) or the token table (attention)
        self.mixer = (GatedDeltaNet(weights, tp, cfg, f"{prefix}.linear_attn") if self.linear
                      else GatedAttention(weights, tp, cfg, f"{prefix}.self_attn"))
        sparse = cfg.moe is not None and index in cfg.moe.layers
        self.mlp = SharedExpertMoE(weights, tp, cfg, prefix) if sparse else GatedMLP(weights, tp, cfg, f"{prefix}.mlp")
        self.input_norm, self.post_norm = (RMSNorm(weights, f"{prefix}.{n}.weight", cfg.hidden_size, cfg.rms_norm_eps,
                                                   offset=cfg.norm_offset)
                                           for n in ("input_layernorm", "post_attention_layernorm"))

    def __call__(self, x, residual, batch: ForwardBatch, rope, kv: TokenTable, pool: StatePool, seqs: Sequences,
                 stash: VerifyStash | None):
        h, residual = self.input_norm(x, residual)
        i = self.cache_index
        if self.linear:
            kept = None if stash is None else (stash.mixed[i], stash.g[i], stash.beta[i])
            x = self.mixer(h, seqs, pool.conv[i], pool.recurrent[i], kept)
        else:
            x = self.mixer(h, batch, rope, kv.k[i], kv.v[i])
        h, residual = self.post_norm(x, residual)
        return self.mlp(h), residual


def _cache_indices(cfg: ModelConfig) -> list[int]:
    """Each layer's index among its kind: a linear layer's in the state pool, a full one's in the token table."""
    linear, counts, out = set(cfg.linear_attn.layers), [0, 0], []
    for i in range(cfg.num_layers):
        out.append(counts[i in linear])
        counts[i in linear] += 1
    return out


class HybridModel:
    serves_lora = False  # not yet: --max_loras is refused for it
    lora = None

    def __init__(self, cfg: ModelConfig, weights, tp: TPGroup, max_positions: int, device: torch.device):
        self.config = cfg
        if device.type == "cuda":
            require_fla()
        prefix = cfg.linear_attn.weight_prefix
        self.embed = VocabParallelEmbedding(weights, tp, f"{prefix}.embed_tokens.weight", cfg.vocab_size,
                                            cfg.hidden_size)
        self.rotary = partial_rotary(cfg, max_positions, device)
        self.layers = [HybridLayer(weights, tp, cfg, i, index) for i, index in enumerate(_cache_indices(cfg))]
        self.norm = RMSNorm(weights, f"{prefix}.norm.weight", cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.norm_offset)
        head = self.embed.weight if cfg.tie_word_embeddings else vocab_shard(
            weights, tp, "lm_head.weight", cfg.vocab_size, cfg.hidden_size)
        self.lm_head = ParallelLMHead(head, tp, cfg.vocab_size, tied=cfg.tie_word_embeddings)
        attention = [layer.mixer for layer in self.layers if not layer.linear]
        if not attention:
            raise ModelConfigError("a hybrid model needs at least one full_attention layer")
        self.kv_heads = attention[0].kv_heads  # per rank
        self.kv_shapes = [(self.kv_heads, cfg.head_dim)] * len(attention)  # each K/V buffer's (heads, dim)
        self.dtype = self.embed.weight.dtype
        self.state_pool: StatePool | None = None
        self.verify_stash: VerifyStash | None = None

    @property
    def _deltas(self) -> list[GatedDeltaNet]:
        return [layer.mixer for layer in self.layers if layer.linear]

    def state_slot_bytes(self, verify_tokens: int = 0, state_dtype: torch.dtype = torch.float32) -> int:
        """One request's state over every linear layer: conv (the model's dtype) and recurrent
        (`state_dtype`), and the verify stash of `verify_tokens` tokens a request row (VerifyStash)."""
        deltas = self._deltas
        first, kernel = deltas[0], self.config.linear_attn.conv_kernel
        per_layer = (first.conv_channels * (kernel - 1) * self.dtype.itemsize
                     + first.v_heads * first.dk * first.dv * state_dtype.itemsize)
        stash = VerifyStash.token_bytes(len(deltas), first.conv_channels, first.v_heads, self.dtype)
        return len(deltas) * per_layer + verify_tokens * stash

    def new_state_pool(self, slots: int, verify_tokens: int = 0, state_dtype: torch.dtype = torch.float32) -> StatePool:
        """The linear layers' states for `slots` request rows (the recurrent ones in `state_dtype`),
        kept by the model for its forwards, and a verify stash of `verify_tokens` tokens (0: none, no
        drafts are verified)."""
        deltas = self._deltas
        first, device = deltas[0], self.embed.weight.device
        self.state_pool = StatePool(slots, len(deltas), (first.conv_channels, self.config.linear_attn.conv_kernel - 1),
                                    (first.v_heads, first.dk, first.dv), self.dtype, device, state_dtype)
        self.verify_stash = VerifyStash(verify_tokens, len(deltas), first.conv_channels, first.v_heads, self.dtype,
                                        device) if verify_tokens else None
        return self.state_pool

    def commit_verified(self, rows: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, tokens: int) -> None:
        """After a verify step of `tokens` decode tokens: each verifying request's (`rows`) linear-layer
        states advance over the tokens it keeps, the stash's rows [starts[i], starts[i] + lengths[i])
        (all on the device; the kernels' outputs span the step's rows of the stash only)."""
        pool, stash = self.state_pool, self.verify_stash
        for i, delta in enumerate(self._deltas):
            delta.commit((stash.mixed[i][:tokens], stash.g[i][:tokens], stash.beta[i][:tokens]), rows, starts,
                         lengths, pool.conv[i], pool.recurrent[i])

    def forward(self, batch: ForwardBatch, kv: TokenTable) -> torch.Tensor:
        """fp32 logits [S, vocab] of the tokens at batch.logit_index (all tokens when None)."""
        x, residual = self._layers(batch, kv)
        if batch.logit_index is not None:
            x, residual = x[batch.logit_index], residual[batch.logit_index]
        h, _ = self.norm(x, residual)
        return self.lm_head(h)

    def forward_with_hidden(self, batch: ForwardBatch, kv: TokenTable) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits as `forward`'s, the final hidden state [T, hidden] of every token, after the
        last norm: an MTP head's features, models/mtp.py)."""
        h, _ = self.norm(*self._layers(batch, kv))
        return self.lm_head(h if batch.logit_index is None else h[batch.logit_index]), h

    def _layers(self, batch: ForwardBatch, kv: TokenTable) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.embed(batch.input_ids), None
        rope, seqs = self.rotary(batch.positions), Sequences.of(batch)
        stash = self.verify_stash if seqs.verify_rows is not None else None
        for layer in self.layers:
            x, residual = layer(x, residual, batch, rope, kv, self.state_pool, seqs, stash)
        return x, residual
