"""Shared layers of the Llama family; all tensor-parallel logic lives here.

Weights come from a weight source (`weights.py`) as this rank's slice. Column-parallel
layers keep a slice of the output features, row-parallel layers a slice of the input
features and all-reduce their output; the vocabulary is split (and padded) across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightllm.utils.dist import TPGroup
from lightllm.kernels import (add_rms_norm, decode_attention, extend_attention, fp8_gemm, fp8_linear,
                              gelu_tanh_and_mul, rms_norm, rotary_kv_, silu_and_mul)
from lightllm.kernels.fp8_linear import quantize_fp8_weight

from .config import ModelConfig, ModelConfigError


@dataclass
class ForwardBatch:
    """One step's metadata, already on the device (built by the model runner in one copy).

    Tokens are packed decodes first (one per request), then prefill chunks. Every new token's
    K/V is written to the token table first; attention then reads the requests' rows there.
    A graph-replayed step pads every array to its bucket (cuda_graph.py): its decode rows then
    cover its first min(bucket, max batch) tokens (those past the real decodes attend to the
    scratch slot and chunk tokens' rows are then written by extend attention), and its chunk
    arrays have empty padding chunks."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its request
    slots: torch.Tensor  # [T] int64, KV slot of each new token
    req_to_token: torch.Tensor  # [R, L] int32
    decode_rows: torch.Tensor | None = None  # [D] int32, the first D tokens' request rows
    decode_seq_lens: torch.Tensor | None = None  # [D] int32, including the new token
    decode_max_seqlen: int = 0  # host-side bound on decode_seq_lens
    decode_plan_for: tuple[int, int] | None = None  # (batch, max_seqlen) decode attention's plan is chosen for
    ext_rows: torch.Tensor | None = None  # [C] int32, one per chunk
    ext_cu_q: torch.Tensor | None = None  # [C+1] int32, chunk bounds within all T tokens (from D on)
    ext_kv_lens: torch.Tensor | None = None  # [C] int32, tokens in the cache including the chunk
    ext_q_blocks: torch.Tensor | None = None  # [2, NB] int32, extend attention's block table
    logit_index: torch.Tensor | None = None  # [S] int64 rows whose logits are wanted; None: all
    lora_slots: torch.Tensor | None = None  # [T] int64, each token's LoRA adapter slot (-1: none); None: no adapter
    # the decode rows verify drafts: each request's consecutive rows (its token and its drafts) are one
    # run, which the linear-attention layers verify without moving its request's state
    decode_verify: bool = False
    # layers whose input hidden states (the residual stream entering them) of all T tokens the
    # forward returns beside the logits, concatenated in this order (an EAGLE-3 head's features)
    aux_layers: tuple[int, ...] = ()

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_rows is None else self.decode_rows.shape[0]

    @property
    def has_chunks(self) -> bool:
        return self.ext_rows is not None


def split_even(units: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """This rank's (start, count) of `units` split evenly across the ranks."""
    if units % tp.world_size:
        raise ModelConfigError(f"{what} = {units} is not divisible by tensor parallel size {tp.world_size}")
    count = units // tp.world_size
    return tp.rank * count, count


def split_kv_heads(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """KV heads per rank; with fewer KV heads than ranks each head is replicated on
    world_size / num_kv_heads consecutive ranks, matching the q heads those ranks hold."""
    if num_kv_heads >= tp.world_size:
        return split_even(num_kv_heads, tp, "num_key_value_heads")
    if tp.world_size % num_kv_heads:
        raise ModelConfigError(f"num_key_value_heads = {num_kv_heads} can neither be split nor "
                               f"replicated across tensor parallel size {tp.world_size}")
    return tp.rank * num_kv_heads // tp.world_size, 1


class Fp8Weight:
    """x W^T with W [out, in] stored in fp8, one scale per output row (`--quantization fp8`):
    `fp8_linear` quantises x per token and multiplies on fp8 tensor cores (kernels/fp8_linear.py).
    x may come quantised already, as the pair (fp8 rows, scales) an RMSNorm with fp8_out returns."""

    def __init__(self, weight: torch.Tensor):
        out_features, in_features = weight.shape
        if out_features % 16 or in_features % 16:  # cuBLAS's fp8 GEMM takes no other sizes
            raise ModelConfigError(f"--quantization fp8 needs projection sizes divisible by 16; this rank has "
                                   f"{out_features}x{in_features}")
        if weight.is_cuda and torch.cuda.get_device_capability(weight.device) < (8, 9):
            raise ModelConfigError("--quantization fp8 needs a GPU of compute capability 8.9 or above (Ada, Hopper)")
        self.out_dtype = weight.dtype
        self.weight, self.scale = quantize_fp8_weight(weight)

    def __call__(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if isinstance(x, tuple):
            return fp8_gemm(*x, self.weight, self.scale, self.out_dtype)
        return fp8_linear(x, self.weight, self.scale)


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


class ColumnParallelLinear:
    """y = x W^T + b over this rank's output rows; several checkpoint matrices (q/k/v,
    gate/up) are concatenated into one weight so that one GEMM serves them all."""

    def __init__(self, weights, parts: list[tuple[str, int, int, int]], in_features: int, bias: bool,
                 quantization: str | None = None):
        # parts: (checkpoint prefix, full output size, first row kept, rows kept)
        weight = torch.cat([weights.get(f"{name}.weight", (out, in_features), 0, start, count)
                            for name, out, start, count in parts])
        self.bias = torch.cat([weights.get(f"{name}.bias", (out,), 0, start, count)
                               for name, out, start, count in parts]) if bias else None
        self.fp8 = Fp8Weight(weight) if quantization == "fp8" else None
        self.weight = None if self.fp8 else weight
        self.parts, self.in_slice = parts, (0, in_features)  # what a LoRA adapter's A and B are cut to
        self.lora = None  # models/lora.py's LoraTarget, where LoRA adapters are served

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.base(x)
        s = self.lora.start(x)  # the adapters' shrink, queued before the GEMM: it runs beside it
        return self.lora.finish(s, self.base(x))

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b, without the LoRA adapters."""
        if self.fp8 is None:
            return F.linear(x, self.weight, self.bias)
        return _add_bias(self.fp8(x), self.bias)


# RowParallelLinear.defer_split_sum: the slices of K, and the most rows a step may have to take them.
# H100, bench-8b's down projection (K 14336), in CUDA graphs over 8 copies of the weight: cuBLAS
# 43.3 / 43.0 / 44.0 us at 1 / 4 / 16 rows, two slices 41.0 / 40.7 / 41.5 (four: 40.8 / 41.2 / 42.1).
# In the decode step's graph replay (2026-11-28): batch 1 5.688 against 5.717 ms, 4 5.936 against
# 5.957, 32 7.527 against 7.551, 64 9.108 against 9.154; served one at a time 5.64 against 5.68 ms
# a token. Not measured above 64 rows, where cuBLAS no longer splits K.
SPLIT_SUM_PARTS = 2
SPLIT_SUM_ROWS = 64


class RowParallelLinear:
    """y = all_reduce(x_rank W_rank^T) + b, where this rank holds input features [start, start + count).

    The weight is kept transposed, [in, out] row-major (`weight_t`): for the o and down
    projections cuBLAS serves x @ W^T faster from that layout where decode steps are
    memory-bound (H100, bench-8b, 2026-11-23, 3df4290: o at batch 1 18.6 us against 29.8 us; down
    at batch 256 51.4 against 59.1; docs/benchmarks-history.md)."""

    def __init__(self, weights, tp: TPGroup, name: str, out_features: int, in_features: int,
                 start: int, count: int, bias: bool, quantization: str | None = None):
        self.tp = tp
        weight = weights.get(f"{name}.weight", (out_features, in_features), 1, start, count)
        self.fp8 = Fp8Weight(weight) if quantization == "fp8" else None
        self.weight_t = None if self.fp8 else weight.t().contiguous()
        self.bias = weights.get(f"{name}.bias", (out_features,)) if bias else None
        self.parts, self.in_slice = [(name, out_features, 0, out_features)], (start, count)
        self.lora = None  # models/lora.py's LoraTarget: its share of x's features, added before the reduce
        # Off (`defer_reduce`): the output is this rank's partial sum and the RMSNorm that takes
        # it all-reduces it, fused with its residual add where it can (RMSNorm.reduce).
        self.reduce_output = True
        # > 1 (`defer_split_sum`): small bf16 steps on a GPU return SPLIT_SUM_PARTS fp32 partial
        # sums over slices of K, which the RMSNorm that takes the output adds up.
        self.split_sum = 0
        # Set (`defer_lora_sum`): the RMSNorm that takes the output, which adds the LoRA adapters'
        # share of a small step (LoraTarget.share_beside) with its residual.
        self.lora_norm: RMSNorm | None = None

    def defer_reduce(self, norm: RMSNorm) -> bool:
        """Leave the all-reduce to `norm`, the next to take this output; False (and nothing
        changed) with a bias, which must be added once, after the sum."""
        if self.bias is not None or self.tp.world_size == 1:
            return False
        self.reduce_output, norm.reduce = False, self.tp
        return True

    def defer_split_sum(self, norm: RMSNorm) -> bool:
        """One GPU, bf16 (tp 1; not with fp8 weights, a bias, or a `norm` with fp8 output): steps
        of up to SPLIT_SUM_ROWS rows return fp32 partial sums [SPLIT_SUM_PARTS, T, out] over slices
        of K, one batched GEMM, for `norm` to add up with its residual (add_rms_norm_triton). cuBLAS splits
        these GEMMs over K itself and adds the slices in a kernel of its own; here the norm does
        (H100, bench-8b's down projection: 41.0 against 43.3 us at one row). False (nothing
        changed) where K does not split into slices of whole 64-column blocks. Not taken for the
        o projection (K 4096): two slices were no faster at one row there (14.2 against 14.0 us)."""
        k = self.weight_t.shape[0] if self.weight_t is not None else 0
        if (self.bias is not None or self.tp.world_size > 1 or norm.fp8_out or not k
                or k % (SPLIT_SUM_PARTS * 64)):
            return False
        self.split_sum = SPLIT_SUM_PARTS
        return True

    def defer_lora_sum(self, norm: RMSNorm) -> bool:
        """tp 1: in a step of up to SHARE_ROWS rows (models/lora.py) with adapter rows, the adapters'
        share is computed beside the GEMM on a second stream into an fp32 [T, out] that `norm` adds
        to this output with its residual (add_rms_norm's `extra`), so that no LoRA launch waits for
        the GEMM. False (nothing changed) with a bias, tp > 1 or a `norm` with fp8 output."""
        if self.bias is not None or self.tp.world_size > 1 or norm.fp8_out:
            return False
        self.lora_norm = norm
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        share = self.lora.share_beside(x) if self.lora is not None and self.lora_norm is not None else None
        s = self.lora.start(x) if self.lora is not None and share is None else None  # the shrink, beside the GEMM
        if (self.split_sum and x.is_cuda and x.dim() == 2 and x.shape[0] <= SPLIT_SUM_ROWS and x.is_contiguous()
                and x.dtype == self.weight_t.dtype == torch.bfloat16):
            rows, k = x.shape
            parts = self.split_sum
            y = torch.bmm(x.view(rows, parts, k // parts).transpose(0, 1),
                          self.weight_t.view(parts, k // parts, -1), out_dtype=torch.float32)
            if share is not None:
                self._hand_over(share)
            elif self.lora is not None:
                self.lora.finish(s, y[0])  # the adapter's share, added to the first partial sum in place
            return y
        y = x @ self.weight_t if self.fp8 is None else self.fp8(x)
        if share is not None:
            self._hand_over(share)
        elif self.lora is not None:
            y = self.lora.finish(s, y)
        if not self.reduce_output:
            return y
        return _add_bias(self.tp.all_reduce(y), self.bias)

    def _hand_over(self, share: torch.Tensor) -> None:
        """The LoRA share to the norm that takes this output next, once its stream is joined."""
        self.lora.join()
        self.lora_norm.lora_share = share


def vocab_shard(weights, tp: TPGroup, name: str, vocab: int, hidden: int) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] matrix, zero-padded to ceil(vocab / world_size)."""
    per_rank = -(-vocab // tp.world_size)
    start = tp.rank * per_rank
    count = max(0, min(per_rank, vocab - start))
    part = weights.get(name, (vocab, hidden), 0, start, count)
    return F.pad(part, (0, 0, 0, per_rank - count))


class VocabParallelEmbedding:
    def __init__(self, weights, tp: TPGroup, name: str, vocab: int, hidden: int):
        self.tp = tp
        self.weight = vocab_shard(weights, tp, name, vocab, hidden)
        self.start = tp.rank * self.weight.shape[0]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(out.masked_fill_(~inside[:, None], 0))


class ParallelLMHead:
    """fp32 logits over the whole vocabulary: each rank scores its vocab shard, then all-gather.

    An untied head is kept transposed ([hidden, vocab shard], as RowParallelLinear: faster for
    cuBLAS at decode batch sizes); a head tied to the embedding table uses that table as it is.

    `defer_rows`, set for one call (the runner's, for a step with prompt logprobs): the call scores
    all but its last `defer_rows` rows and keeps those rows' hidden states in `deferred`, for
    `logits` to score a slice at a time, so that a chunk's prompt logprobs never hold its
    [tokens, vocab] logits whole (engine/sampling.py's chunk_prompt_logprobs)."""

    def __init__(self, weight: torch.Tensor, tp: TPGroup, vocab: int, tied: bool, softcap: float = 0.0):
        self.weight_t = weight.t() if tied else weight.t().contiguous()
        self.tp, self.vocab = tp, vocab
        self.softcap = softcap  # > 0: logits capped at +-softcap by tanh (Gemma 2)
        self.defer_rows = 0
        self.deferred: torch.Tensor | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.defer_rows:
            scored = h.shape[0] - self.defer_rows
            self.deferred, self.defer_rows = h[scored:], 0
            h = h[:scored]
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the hidden states h [rows, hidden]."""
        logits = self.tp.all_gather((h @ self.weight_t).float(), dim=-1)[:, : self.vocab]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class RMSNorm:
    """fp8_out: the norm feeds fp8 projections and returns its output quantised for them.
    offset: the norm scales by (offset + weight), Gemma's (1 + weight), kept in fp32 as Gemma
    computes it (a bf16 1 + w would round away w's low bits). The normalised x is still rounded to
    its dtype before the scale, as for Llama, where Gemma rounds once at the end: the same in fp32,
    one rounding more in bf16."""

    def __init__(self, weights, name: str, hidden: int, eps: float, fp8_out: bool = False, offset: float = 0.0):
        self.weight = weights.get(name, (hidden,))
        if offset:
            self.weight = self.weight.float() + offset
        self.eps = eps
        self.fp8_out = fp8_out
        # Set where x comes unreduced from a row-parallel projection (`RowParallelLinear.reduce_output`
        # off): the norm all-reduces it first, in the same kernel where TPGroup.reduce_add_rms_norm can.
        self.reduce: TPGroup | None = None
        # The LoRA adapters' share of the projection this norm takes next (RowParallelLinear.defer_lora_sum):
        # fp32 [T, H], added to x with the residual by the next call, which takes it.
        self.lora_share: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple:
        """(norm(residual + x), residual + x); residual is updated in place. None: x starts the stream.
        x [P, T, H] in fp32: a split projection's partial sums (RowParallelLinear.split_sum), added here."""
        if self.reduce is not None:
            fused = None if self.fp8_out else self.reduce.reduce_add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = self.reduce.all_reduce(x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.fp8_out), x
        share, self.lora_share = self.lora_share, None
        return add_rms_norm(x, residual, self.weight, self.eps, self.fp8_out, extra=share), residual

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] (a strided view of q or k) normalised over each head's D, as a new tensor."""
        return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if scaling["rope_type"] == "proportional":  # Gemma 4's global layers: the first pairs turn, the rest stay
        turning = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        return torch.cat([inv_freq[:turning], torch.zeros_like(inv_freq[turning:])]) / scaling.get("factor", 1.0)
    return llama3_inv_freq(inv_freq, scaling)


def yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: the frequencies that turn fewer than beta_slow times over the original context are
    slowed by `factor`, those that turn more than beta_fast times kept, a linear ramp between."""
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns `turns` times over old_context
        return head_dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (so q.k by its square): its attention_factor, else
    0.1 ln(factor) + 1 (with mscale and mscale_all_dim, the ratio of two such); 1 otherwise."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a linear blend between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    blend = ((old_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelen < old_context / high, inv_freq, scaled)
    return torch.where(wavelen > old_context / low, inv_freq / factor, scaled)


class RotaryEmbedding:
    """cos/sin tables [max_positions, head_dim / 2] in fp32, indexed by token position."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                 device: torch.device):
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        factor = rope_attention_factor(scaling)
        self.cos = (freqs.cos() * factor).to(device)
        self.sin = (freqs.sin() * factor).to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, head_dim / 2] for the step's tokens, looked up once for all layers."""
        return self.cos[positions], self.sin[positions]


class Attention:
    """q/k/v projection (column-parallel, merged), rotary, KV written to the token table,
    attention over the requests' rows of the table, o projection."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, prefix: str, window: int = 0,
                 in_features: int | None = None):
        """in_features: q/k/v's input width where it is not hidden_size (an EAGLE-3 head's 2 x hidden)."""
        d = cfg.head_dim
        q_start, self.q_heads = split_even(cfg.num_heads, tp, "num_attention_heads")
        kv_start, self.kv_heads = split_kv_heads(cfg.num_kv_heads, tp)
        kv_parts = [(f"{prefix}.{n}_proj", cfg.num_kv_heads * d, kv_start * d, self.kv_heads * d) for n in "kv"]
        q_part = (f"{prefix}.q_proj", cfg.num_heads * d, q_start * d, self.q_heads * d)
        self.qkv = ColumnParallelLinear(weights, [q_part] + kv_parts, in_features or cfg.hidden_size, cfg.qkv_bias,
                                        cfg.quantization)
        self.o = RowParallelLinear(weights, tp, f"{prefix}.o_proj", cfg.hidden_size, cfg.num_heads * d,
                                   q_start * d, self.q_heads * d, cfg.o_bias, cfg.quantization)
        self.head_dim = d
        self.scale = 1.0 / math.sqrt(cfg.query_pre_attn_scalar or d)
        self.window, self.softcap = window, cfg.attn_softcap  # host numbers: Triton constexprs, fixed in a graph
        # fp32 [q heads of this rank]: each head's sink logit (gpt-oss)
        self.sinks = (weights.get(f"{prefix}.sinks", (cfg.num_heads,), 0, q_start, self.q_heads).float()
                      if cfg.attn_sinks else None)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm, self.k_norm = (RMSNorm(weights, f"{prefix}.{n}_norm.weight", d, cfg.rms_norm_eps,
                                                offset=cfg.norm_offset) for n in "qk")

    def __call__(self, h, batch: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor],
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """h: the normed hidden states, or their fp8 rows and scales (RMSNorm's fp8_out). In a small
        step with LoRA adapter rows (and no q/k norm between), q/k/v's share is computed beside its
        GEMM and added by rotary_kv_ (its `extra`): no LoRA launch waits for the GEMM."""
        lora = self.qkv.lora
        share = lora.share_beside(h) if lora is not None and self.q_norm is None else None
        qkv = self.qkv(h) if share is None else self.qkv.base(h)
        tokens, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = q.view(tokens, -1, d), k.view(tokens, -1, d), v.view(tokens, -1, d)
        if self.q_norm is not None:
            q, k = self.q_norm.heads(q), self.k_norm.heads(k)
        if share is not None:
            lora.join()
        rotary_kv_(q, k, v, *rope, k_cache, v_cache, batch.slots, extra=share)
        return self.o(self._attend(q, batch, k_cache, v_cache).reshape(tokens, -1))

    def _attend(self, q: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """Decode rows through the split-K decode kernel, chunks through extend attention, each
        writing its rows of one output (no concatenation: one launch and copy fewer a layer)."""
        n = batch.num_decodes
        out = torch.empty_like(q)
        if n:
            decode_attention(q[:n], k_cache, v_cache, batch.req_to_token, batch.decode_rows, batch.decode_seq_lens,
                             batch.decode_max_seqlen, self.scale, out=out[:n], window=self.window,
                             softcap=self.softcap, plan_for=batch.decode_plan_for, sinks=self.sinks)
        if batch.has_chunks:  # after the decodes: a padded step's decode rows overlap the chunks' rows
            extend_attention(q, k_cache, v_cache, batch.req_to_token, batch.ext_rows, batch.ext_cu_q,
                             batch.ext_kv_lens, batch.ext_q_blocks, self.scale, out=out, window=self.window,
                             softcap=self.softcap, sinks=self.sinks)
        return out


class GatedMLP:
    """down(act(gate(x)) * up(x)) with gate/up merged into one column-parallel weight; act is silu,
    or GELU's tanh form (Gemma)."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, prefix: str):
        inter = cfg.intermediate_size
        start, count = split_even(inter, tp, "intermediate_size")
        parts = [(f"{prefix}.{n}_proj", inter, start, count) for n in ("gate", "up")]
        self.gate_up = ColumnParallelLinear(weights, parts, cfg.hidden_size, False, cfg.quantization)
        self.down = RowParallelLinear(weights, tp, f"{prefix}.down_proj", cfg.hidden_size, inter,
                                      start, count, False, cfg.quantization)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def __call__(self, h) -> torch.Tensor:
        """h: the normed hidden states, or their fp8 rows and scales (RMSNorm's fp8_out). In a small
        step with LoRA adapter rows, gate/up's share is computed beside its GEMM and added by the
        activation (its `extra`): no LoRA launch waits for the GEMM."""
        act_and_mul = gelu_tanh_and_mul if self.gelu else silu_and_mul  # looked up here: tests swap the kernels
        lora = self.gate_up.lora
        share = lora.share_beside(h) if lora is not None else None
        if share is None:
            return self.down(act_and_mul(self.gate_up(h), self.down.fp8 is not None))
        y = self.gate_up.base(h)
        lora.join()
        return self.down(act_and_mul(y, False, extra=share))
