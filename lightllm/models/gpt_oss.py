"""gpt-oss: the decoder family's layers (llama.py) with what gpt-oss brings through the config
(attention sinks, YaRN rotary, alternating sliding-window and full layers, q/k/v and o biases) and
here its mixture of experts: a router with a bias, experts stored as fused tensors with biases, the
clamped SwiGLU, and the checkpoint's MXFP4 experts kept packed (fused_moe widens them as it loads
them: 120b's experts take 60.9 GB where bf16 would take 229), or with --mxfp4_experts dequantized
widened once at load for the dense experts' kernels (with --quantization fp8 re-encoded in fp8,
the same values: mxfp4_to_fp8).

Checkpoint layout: `mlp.router.{weight,bias}`; `mlp.experts.gate_up_proj` [E, H, 2I] (gate and up
interleaved along 2I, as fused_moe's rows) and `down_proj` [E, I, H], or in MXFP4
`gate_up_proj_blocks` [E, 2I, H / 32, 16] with `gate_up_proj_scales` [E, 2I, H / 32] and
`down_proj_blocks` [E, H, I / 32, 16] with its scales, already [out, in] as fused_moe wants them;
`gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, H].
"""

from __future__ import annotations

import torch

from lightllm.kernels.fused_moe import MXFP4_GROUP, dequantize_mxfp4, mxfp4_to_fp8
from lightllm.utils.dist import TPGroup

from .config import ModelConfig, ModelConfigError
from .layers import split_even
from .moe import SparseMoE, _fp8_experts, check_fp8_device


class GptOssMoE(SparseMoE):
    """SparseMoE's routing and tensor parallelism (each rank a slice of every expert's intermediate
    dimension) over gpt-oss's expert tensors. The down projection's bias is added by rank 0 alone,
    so that the all-reduce sums it once."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, layer_prefix: str):
        moe, hidden = cfg.moe, cfg.hidden_size
        prefix = f"{layer_prefix}.mlp"
        start, count = split_even(moe.intermediate_size, tp, "the experts' intermediate size")
        self.router = weights.get(f"{prefix}.router.weight", (moe.num_experts, hidden))
        self.router_bias = weights.get(f"{prefix}.router.bias", (moe.num_experts,))
        experts = f"{prefix}.experts"
        if moe.mxfp4 and cfg.mxfp4_experts == "packed":
            self.experts = _mxfp4_experts(weights, experts, moe.num_experts, hidden, moe.intermediate_size, start,
                                          count)
        else:
            fp8 = cfg.quantization == "fp8"
            if moe.mxfp4:  # --mxfp4_experts dequantized: widened once here, to fp8 or the router's dtype
                packed = _mxfp4_experts(weights, experts, moe.num_experts, hidden, moe.intermediate_size, start, count)
                self.experts = _mxfp4_fp8_experts(*packed) if fp8 else _dequantized_experts(*packed, self.router.dtype)
            else:
                dense = _dense_experts(weights, experts, moe.num_experts, hidden, moe.intermediate_size, start, count)
                self.experts = _fp8_experts(*dense) if fp8 else dense
        down_bias = weights.get(f"{experts}.down_proj_bias", (moe.num_experts, hidden))
        self.expert_options = dict(
            gate_up_bias=weights.get(f"{experts}.gate_up_proj_bias", (moe.num_experts, 2 * moe.intermediate_size), 1,
                                     2 * start, 2 * count),
            down_bias=down_bias if tp.rank == 0 else torch.zeros_like(down_bias), swiglu=moe.swiglu)
        self.top_k, self.renormalize, self.tp = moe.top_k, moe.renormalize, tp
        self.reduce_output = True


def _dense_experts(weights, name: str, experts: int, hidden: int, inter: int, start: int,
                   count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([E, 2 count, H] this rank's gate/up rows, interleaved; [E, H, count] its down columns)."""
    gate_up = weights.get(f"{name}.gate_up_proj", (experts, hidden, 2 * inter), 2, 2 * start, 2 * count)
    down = weights.get(f"{name}.down_proj", (experts, inter, hidden), 1, start, count)
    return gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()


def _mxfp4_experts(weights, name: str, experts: int, hidden: int, inter: int, start: int, count: int) -> tuple:
    """(gate/up blocks [E, 2 count, H / 2], down blocks [E, H, count / 2], their scales): fused_moe's
    MXFP4 arguments, this rank's slice, packed as the checkpoint holds them."""
    if count % MXFP4_GROUP or hidden % MXFP4_GROUP:
        raise ModelConfigError(f"MXFP4 experts need hidden_size ({hidden}) and each rank's intermediate size "
                               f"({count}) divisible by {MXFP4_GROUP}")
    packed = dict(dtype=torch.uint8)
    groups, rank_groups, first = hidden // MXFP4_GROUP, count // MXFP4_GROUP, start // MXFP4_GROUP
    gate_up = weights.get(f"{name}.gate_up_proj_blocks", (experts, 2 * inter, groups, 16), 1, 2 * start, 2 * count,
                          **packed)
    gate_up_scales = weights.get(f"{name}.gate_up_proj_scales", (experts, 2 * inter, groups), 1, 2 * start,
                                 2 * count, **packed)
    inter_groups = inter // MXFP4_GROUP
    down = weights.get(f"{name}.down_proj_blocks", (experts, hidden, inter_groups, 16), 2, first, rank_groups,
                       **packed)
    down_scales = weights.get(f"{name}.down_proj_scales", (experts, hidden, inter_groups), 2, first, rank_groups,
                              **packed)
    return (gate_up.view(experts, 2 * count, hidden // 2), down.view(experts, hidden, count // 2), gate_up_scales,
            down_scales)


def _each_expert(blocks: torch.Tensor, scales: torch.Tensor, widen) -> list[torch.Tensor]:
    """widen(blocks[e], scales[e]) (a tuple of tensors) for every expert e, into tensors allocated once:
    the float32 decode inside stays one expert's size."""
    first = widen(blocks[0], scales[0])
    outs = [torch.empty((blocks.shape[0], *t.shape), dtype=t.dtype, device=t.device) for t in first]
    for e in range(blocks.shape[0]):
        for out, t in zip(outs, first if e == 0 else widen(blocks[e], scales[e])):
            out[e] = t
    return outs


def _mxfp4_fp8_experts(gate_up: torch.Tensor, down: torch.Tensor, gate_up_scales: torch.Tensor,
                       down_scales: torch.Tensor) -> tuple:
    """_mxfp4_experts' packed tensors re-encoded in fp8 with the same values (mxfp4_to_fp8):
    _fp8_experts' (gate/up, down, their scales [E, rows])."""
    check_fp8_device(gate_up)
    (gate_up_fp8, gate_up_scale), (down_fp8, down_scale) = (
        _each_expert(blocks, scales, mxfp4_to_fp8)
        for blocks, scales in ((gate_up, gate_up_scales), (down, down_scales)))
    return gate_up_fp8, down_fp8, gate_up_scale, down_scale


def _dequantized_experts(gate_up: torch.Tensor, down: torch.Tensor, gate_up_scales: torch.Tensor,
                         down_scales: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """_mxfp4_experts' packed tensors widened to `dtype` in _dense_experts' layout ([E, 2 count, H],
    [E, H, count])."""
    (wide_gate_up,), (wide_down,) = (_each_expert(blocks, scales, lambda b, s: (dequantize_mxfp4(b, s, dtype),))
                                     for blocks, scales in ((gate_up, gate_up_scales), (down, down_scales)))
    return wide_gate_up, wide_down
