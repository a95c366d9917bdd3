"""Model configuration: the fields the decoder families need, read from config.json.

Llama, Mistral, Qwen2 and Qwen3 differ only in these fields (Qwen2 always has q/k/v biases,
Qwen3 normalises q and k per head), so one `ModelConfig` describes them all; Mixtral and
Qwen3-MoE add a `MoEConfig` (which layers route their tokens to experts, and how). Both
transformers 4 (`rope_theta`, `rope_scaling`) and transformers 5 (`rope_parameters`) layouts
are read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# architecture -> the ModelConfig fields its family fixes, whatever config.json says; q/k/v and
# o biases come from `attention_bias` where the family does not fix them
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": dict(qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": dict(qk_norm=True),
    "MixtralForCausalLM": {},
    "Qwen3MoeForCausalLM": dict(qk_norm=True),
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}


class ModelConfigError(ValueError):
    """The model directory cannot be served: names the problem and what is supported."""


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: each token's `top_k` of `num_experts` gated MLPs of width
    `intermediate_size`, in the decoder layers `layers` (the others keep the dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # the top-k weights are divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    layers: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    model_dir: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain rope; else has "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    quantization: str | None = None  # the server's --quantization: how the layers store their projections
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    moe: MoEConfig | None = None


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path} not found: a model directory needs config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}") from None


def _architecture(cfg: dict, path: Path) -> str:
    names = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type"), str(cfg.get("model_type")))]
    arch = names[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(f"unsupported architecture {arch!r} in {path}; supported: "
                               f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _rope(cfg: dict, path: Path) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters") or {}
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(f"unsupported rope scaling type {rope_type!r} in {path}; supported: "
                               f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    scaling.pop("rope_theta", None)
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **scaling}


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _eos_token_ids(cfg: dict, model_dir: Path) -> tuple[int, ...]:
    ids = _as_id_list(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        ids += _as_id_list(read_json(gen_path).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _biases(cfg: dict) -> dict:
    bias = bool(cfg.get("attention_bias", False))  # one flag for q/k/v and o
    return dict(qkv_bias=bias, o_bias=bias)


def _check_supported(cfg: dict, path: Path) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"unsupported hidden_act {act!r} in {path}; supported: silu")
    if cfg.get("mlp_bias"):
        raise ModelConfigError(f"mlp_bias=true in {path} is not supported")


def _moe(cfg: dict, arch: str, num_layers: int) -> MoEConfig | None:
    """Mixtral: every layer, top-k renormalised. Qwen3-MoE: the layers of every
    `decoder_sparse_step`-th index (from 1) less `mlp_only_layers`, renormalised by `norm_topk_prob`."""
    if arch == "MixtralForCausalLM":
        return MoEConfig(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                         int(cfg["intermediate_size"]), True, tuple(range(num_layers)))
    if arch != "Qwen3MoeForCausalLM":
        return None
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 saves the latter
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if not num_experts or not layers:
        return None
    return MoEConfig(num_experts, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                     bool(cfg.get("norm_topk_prob", False)), layers)


def read_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelConfigError(f"model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    cfg = read_json(path)
    arch = _architecture(cfg, path)
    _check_supported(cfg, path)
    theta, scaling = _rope(cfg, path)
    num_heads = int(cfg["num_attention_heads"])
    num_layers = int(cfg["num_hidden_layers"])
    use_window = cfg.get("use_sliding_window", True)
    return ModelConfig(
        model_dir=str(model_dir),
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        eos_token_ids=_eos_token_ids(cfg, model_dir),
        sliding_window=cfg.get("sliding_window") if use_window else None,
        moe=_moe(cfg, arch, num_layers),
        **{**_biases(cfg), **SUPPORTED_ARCHITECTURES[arch]},
    )


def resolve_dtype(data_type: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """"auto": float32 on CPU (the torch references are written for it); on CUDA the config's
    dtype, bfloat16 when the config names none. Any explicit name is honoured everywhere."""
    if data_type == "auto":
        if device.type != "cuda":
            return torch.float32
        return _DTYPES.get(str(config.torch_dtype).removeprefix("torch."), torch.bfloat16)
    if data_type not in _DTYPES:
        raise ModelConfigError(f"unsupported data type {data_type!r}; supported: auto, "
                               f"{', '.join(_DTYPES)}")
    return _DTYPES[data_type]


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the model's (auto) or fp8 e4m3, which the attention kernels widen as
    they read it; Triton converts e4m3 on compute capability 8.9 and above only."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype != "fp8_e4m3":
        raise ModelConfigError(f"kv_cache_dtype must be auto or fp8_e4m3, got {kv_cache_dtype!r}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ModelConfigError("--kv_cache_dtype fp8_e4m3 needs a GPU of compute capability 8.9 or above (Ada, Hopper)")
    return torch.float8_e4m3fn
