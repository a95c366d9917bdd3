"""The mixture-of-experts MLP layer (Mixtral, Qwen3-MoE), tensor-parallel as the dense MLP.

Every rank keeps the whole router and, of every expert, the same slice of the intermediate
dimension: its gate/up rows and its down columns, as GatedMLP splits the dense MLP. So each rank
routes the same tokens to the same experts, computes its share of every chosen expert's output,
and one all-reduce after the experts sums the shares (kernels/fused_moe.py does the rest).
With `--quantization fp8` the experts are stored in fp8 (one scale per output row of each expert)
and both grouped GEMMs run on fp8 inputs; the router stays in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightllm.utils.dist import TPGroup
from lightllm.kernels import fused_moe, route_topk
from lightllm.kernels.fused_moe import interleave_gate_up, quantize_experts_fp8

from .config import ModelConfig, ModelConfigError
from .layers import split_even

# architecture -> (the MLP's checkpoint name, the gate, up and down projections' names in an expert)
EXPERT_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    **{arch: ("mlp", "gate_proj", "up_proj", "down_proj") for arch in (
        "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")},
}


class SparseMoE:
    """sum over each token's top-k experts of weight * down(silu(gate(x)) * up(x))."""

    def __init__(self, weights, tp: TPGroup, cfg: ModelConfig, layer_prefix: str):
        if cfg.hidden_act != "silu":
            raise ModelConfigError(f"mixture-of-experts layers run silu experts only, not {cfg.hidden_act}")
        moe, hidden = cfg.moe, cfg.hidden_size
        block, gate, up, down = EXPERT_NAMES[cfg.architecture]
        prefix = f"{layer_prefix}.{block}"
        inter = moe.intermediate_size
        start, count = split_even(inter, tp, "the experts' intermediate size")
        self.router = weights.get(f"{prefix}.gate.weight", (moe.num_experts, hidden))
        experts = [f"{prefix}.experts.{e}" for e in range(moe.num_experts)]
        # [E, 2 * count, H]: this rank's gate and up rows, interleaved (the kernel's layout)
        gate_w, up_w = (torch.stack([weights.get(f"{name}.{proj}.weight", (inter, hidden), 0, start, count)
                                     for name in experts]) for proj in (gate, up))
        w_gate_up = interleave_gate_up(gate_w, up_w)
        del gate_w, up_w
        w_down = torch.stack([weights.get(f"{name}.{down}.weight", (hidden, inter), 1, start, count)
                              for name in experts])  # [E, H, count]
        self.experts = _fp8_experts(w_gate_up, w_down) if cfg.quantization == "fp8" else (w_gate_up, w_down)
        self.top_k, self.renormalize, self.tp = moe.top_k, moe.renormalize, tp
        self.router_bias, self.expert_options = None, {}  # fused_moe's biases and activation (gpt_oss.py)
        self.reduce_output = True  # off (defer_reduce): the norm that takes the output all-reduces it

    def defer_reduce(self, norm) -> bool:
        """Leave the all-reduce to `norm` (an RMSNorm), the next to take this output, as
        RowParallelLinear.defer_reduce: fused with its residual add where TPGroup.reduce_add_rms_norm
        can. False (nothing changed) at tp 1."""
        if self.tp.world_size == 1:
            return False
        self.reduce_output, norm.reduce = False, self.tp
        return True

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = route_topk(F.linear(h, self.router, self.router_bias), self.top_k, self.renormalize)
        w_gate_up, w_down, *scales = self.experts
        out = fused_moe(h, w_gate_up, w_down, topk_weights, topk_ids, *scales, **self.expert_options)
        return self.tp.all_reduce(out) if self.reduce_output else out


def check_fp8_device(weight: torch.Tensor) -> None:
    if weight.is_cuda and torch.cuda.get_device_capability(weight.device) < (8, 9):
        raise ModelConfigError("--quantization fp8 needs a GPU of compute capability 8.9 or above (Ada, Hopper)")


def _fp8_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple:
    """(gate/up fp8, down fp8, gate/up scales, down scales): fused_moe's arguments after the routing."""
    check_fp8_device(w_gate_up)
    (gate_up, gate_up_scale), (down, down_scale) = quantize_experts_fp8(w_gate_up), quantize_experts_fp8(w_down)
    return gate_up, down, gate_up_scale, down_scale
