"""Model configuration: the fields the decoder families need, read from config.json.

Llama, Mistral, Qwen2/3 and Gemma 2/3 differ only in these fields (Qwen2 always has q/k/v
biases; Qwen3 normalises q and k per head; Gemma adds norms on the attention's and MLP's
outputs, sliding-window layers, GELU, scaled embeddings and soft caps), so one `ModelConfig`
describes them all; Mixtral and Qwen3-MoE add a `MoEConfig` (which layers route their tokens
to experts, and how). Both transformers 4 (`rope_theta`, `rope_scaling`, `rope_local_base_freq`)
and transformers 5 (`rope_parameters`, per layer type for Gemma 3) layouts are read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
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
    "Gemma2ForCausalLM": dict(norm_offset=1.0, sandwich_norms=True),
    "Gemma3ForCausalLM": dict(norm_offset=1.0, sandwich_norms=True, qk_norm=True),
    "MixtralForCausalLM": {},
    "Qwen3MoeForCausalLM": dict(qk_norm=True),
    "GptOssForCausalLM": dict(attn_sinks=True),
    # Gemma 4's norms scale by their weight alone, and its attention does not scale q.k (q and k are normed)
    "Gemma4ForCausalLM": dict(sandwich_norms=True, qk_norm=True, query_pre_attn_scalar=1.0),
    # its text model; the vision and audio towers' weights are left unread
    "Gemma4ForConditionalGeneration": dict(sandwich_norms=True, qk_norm=True, query_pre_attn_scalar=1.0),
    # hybrid: Gated DeltaNet layers beside gated full attention, zero-centred norms (LinearAttnConfig)
    **{arch: dict(qk_norm=True, norm_offset=1.0) for arch in (
        "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")},
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "gemma4_text": "Gemma4ForCausalLM",
                "gemma4": "Gemma4ForConditionalGeneration"}
HYBRID_ARCHITECTURES = tuple(arch for arch in SUPPORTED_ARCHITECTURES if arch.startswith(("Qwen3Next", "Qwen3_5")))
# text under text_config (Gemma 4's vision and audio towers' weights are left unread)
_MULTIMODAL = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Gemma4ForConditionalGeneration")
_GEMMA4 = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", *_GEMMA4)  # tied embeddings unless config.json says otherwise
# Where config.json has no `layer_types`: every `pattern`-th layer is global, the others slide
# (transformers' defaults); Qwen2/3's slide from max_window_layers on, the others' (Mistral,
# Mixtral, Qwen3-MoE: transformers ignores its max_window_layers) all slide.
_SLIDING_PATTERNS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "GptOssForCausalLM": 2,
                     **{arch: 6 for arch in _GEMMA4}}
_MAX_WINDOW_LAYERS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
_DEFAULT_ROPE_THETA = {"Gemma3ForCausalLM": 1_000_000.0, "GptOssForCausalLM": 150_000.0}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config.json's name -> the MLP's
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}


# The sampling fields of generation_config.json that the OpenAI-style routes may take as their
# defaults (--sampling_defaults model): vLLM's list, less max_new_tokens (the route's own).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


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
    # gpt-oss: biases on the router and on each expert's projections, and its clamped SwiGLU
    # (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at limit, up to +-limit
    biases: bool = False
    swiglu: tuple[float, float] | None = None  # (alpha, limit)
    mxfp4: bool = False  # the checkpoint's experts are MXFP4 (*_blocks, *_scales), kept so in memory
    shared_intermediate_size: int = 0  # > 0: a gated shared expert beside the routed ones (Qwen3-Next, Qwen3.5)
    gelu: bool = False  # the experts' activation is GELU's tanh form, not silu (Gemma 4)


@dataclass(frozen=True)
class Gemma4Layers:
    """What Gemma 4's text model adds to Gemma 3's fields. Its global layers have heads of their own
    size and count, and where `k_eq_v` their v is k's projection (taken before k's norm). Each layer
    attends over the K/V of layer kv_source[i]: itself, or for the last num_kv_shared_layers the last
    earlier layer of its type, whose K/V it reads and never writes (the token table holds one copy);
    those layers' MLP is twice as wide where `double_wide_mlp`. Each layer adds a per-layer input
    (of per_layer_input_size per token; 0: none) after its MLP, and scales its output by its
    `layer_scalar`."""

    global_head_dim: int
    global_kv_heads: int
    k_eq_v: bool
    kv_source: tuple[int, ...]
    per_layer_input_size: int
    per_layer_vocab_size: int
    double_wide_mlp: bool
    prefix: str  # the text model's checkpoint names: "model." or, multimodal, "model.language_model."



@dataclass(frozen=True)
class LinearAttnConfig:
    """The hybrid models (Qwen3-Next, Qwen3.5): `layers` are Gated DeltaNet layers (linear attention
    with a recurrent state per request and a causal conv1d), the others gated full attention (an
    output gate from q_proj, rotary over the first `rotary_dim` of each head)."""

    layers: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    rotary_dim: int
    grouped_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped by key head
    weight_prefix: str = "model"  # "model.language_model" in the multimodal checkpoints
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint ships (`mtp.*`; models/mtp.py)
    ssm_dtype: str | None = None  # the checkpoint's `mamba_ssm_dtype`: the recurrent state's dtype it asks for

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


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
    # generation_config.json's SAMPLING_FIELDS, as written there (the HTTP side checks their ranges)
    sampling_defaults: dict = field(default_factory=dict)
    quantization: str | None = None  # the server's --quantization: how the layers store their projections
    mxfp4_experts: str = "packed"  # the server's --mxfp4_experts, resolved: MXFP4 experts packed or widened at load
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    # Per layer: how many positions a query sees, its own included (transformers' sliding window);
    # 0 for a global layer. Empty: every layer is global.
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # the sliding layers' own rope base, unscaled (Gemma 3)
    moe: MoEConfig | None = None
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_tanh
    norm_offset: float = 0.0  # RMSNorms scale by (norm_offset + weight): Gemma's 1
    sandwich_norms: bool = False  # Gemma: norms on the attention's and the MLP's outputs too
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim's
    attn_softcap: float = 0.0  # attention scores capped at +-attn_softcap by tanh (Gemma 2); 0: none
    logit_softcap: float = 0.0  # the same for the final logits
    attn_sinks: bool = False  # a learned logit per head in each attention softmax's denominator (gpt-oss)
    linear_attn: LinearAttnConfig | None = None  # the hybrid models' linear-attention layers
    gemma4: Gemma4Layers | None = None

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V in the token table (the hybrid models' full-attention layers)."""
        return self.num_layers - (len(self.linear_attn.layers) if self.linear_attn else 0)

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0


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


def _rope(cfg: dict, path: Path, default_theta: float) -> tuple[float, dict | None, float | None]:
    """(theta, scaling) of the global layers and the sliding layers' own theta (Gemma 3), if any."""
    params = cfg.get("rope_parameters") or {}
    local_theta = cfg.get("rope_local_base_freq")
    if "full_attention" in params:  # transformers 5 with a rope per layer type
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelConfigError(f"unsupported rope scaling on the sliding layers in {path}; supported: none")
        local_theta = local.get("rope_theta", local_theta)
        params = params["full_attention"]
    theta, scaling = _rope_scaling(cfg, params, path, default_theta)
    return theta, scaling, None if local_theta is None else float(local_theta)


def _rope_scaling(cfg: dict, params: dict, path: Path, default_theta: float) -> tuple[float, dict | None]:
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
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


def _generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    return read_json(path) if path.exists() else {}


def _eos_token_ids(cfg: dict, generation: dict) -> tuple[int, ...]:
    ids = _as_id_list(cfg.get("eos_token_id")) + _as_id_list(generation.get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _biases(cfg: dict) -> dict:
    bias = bool(cfg.get("attention_bias", False))  # one flag for q/k/v and o
    return dict(qkv_bias=bias, o_bias=bias)


def _activation(cfg: dict, path: Path) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")  # Gemma names it hidden_activation
    if act not in ACTIVATIONS:
        raise ModelConfigError(f"unsupported hidden_act {act!r} in {path}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def _check_supported(cfg: dict, path: Path) -> None:
    if cfg.get("mlp_bias"):
        raise ModelConfigError(f"mlp_bias=true in {path} is not supported")
    if cfg.get("use_bidirectional_attention") in (True, "all"):  # Gemma 4's "vision" touches image tokens only
        raise ModelConfigError(f"use_bidirectional_attention=true in {path} (an embedding model) is not supported")


def _layer_windows(cfg: dict, arch: str, num_layers: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types is None and arch in _SLIDING_PATTERNS:
        pattern = int(cfg.get("sliding_window_pattern", _SLIDING_PATTERNS[arch]))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif types is None:
        first = int(cfg.get("max_window_layers", 0)) if arch in _MAX_WINDOW_LAYERS else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ModelConfigError(f"layer_types names {len(types)} layers, num_hidden_layers is {num_layers}")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def _gemma(cfg: dict) -> dict:
    """What Gemma reads from config.json beyond the fields every family has."""
    return dict(embed_scale=float(cfg["hidden_size"]) ** 0.5, query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
                attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),  # null: no cap
                logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0))


def _kv_sources(cfg: dict, windows: tuple[int, ...], num_layers: int, path: Path) -> tuple[int, ...]:
    """Per layer, the layer whose K/V it attends over: the last num_kv_shared_layers read those of
    the last earlier layer of their type (sliding or global), as transformers' kv_sharing_modes."""
    first_shared = num_layers - int(cfg.get("num_kv_shared_layers") or 0)
    kinds = [bool(windows[i]) if windows else False for i in range(num_layers)]
    sources = []
    for i in range(num_layers):
        owners = [j for j in range(min(i + 1, first_shared)) if kinds[j] == kinds[i]]
        if not owners:
            raise ModelConfigError(f"layer {i} shares the K/V of no earlier layer of its type in {path}")
        sources.append(owners[-1])
    return tuple(sources)


def _gemma4(cfg: dict, windows: tuple[int, ...], num_layers: int, prefix: str, path: Path) -> Gemma4Layers:
    globals_ = [i for i in range(num_layers) if not (windows and windows[i])]
    overrides = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    head_dim = int(cfg.get("head_dim") or 256)
    shapes = {(overrides.get(i, {}).get("head_dim", cfg.get("global_head_dim", head_dim)),
               overrides.get(i, {}).get("num_key_value_heads", cfg.get("num_global_key_value_heads")
                                        or cfg.get("num_key_value_heads"))) for i in globals_}
    if len(shapes) > 1:
        raise ModelConfigError(f"global layers of different head sizes in {path}; supported: one")
    (global_head_dim, global_kv_heads), = shapes
    return Gemma4Layers(int(global_head_dim), int(global_kv_heads), bool(cfg.get("attention_k_eq_v")),
                        _kv_sources(cfg, windows, num_layers, path), int(cfg.get("hidden_size_per_layer_input") or 0),
                        int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]),
                        bool(cfg.get("use_double_wide_mlp")), prefix)


def _moe(cfg: dict, arch: str, num_layers: int) -> MoEConfig | None:
    """Mixtral: every layer, top-k renormalised. Qwen3-MoE: the layers of every
    `decoder_sparse_step`-th index (from 1) less `mlp_only_layers`, renormalised by `norm_topk_prob`."""
    if arch == "MixtralForCausalLM":
        return MoEConfig(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                         int(cfg["intermediate_size"]), True, tuple(range(num_layers)))
    if arch == "GptOssForCausalLM":
        return _gpt_oss_moe(cfg, num_layers)
    if arch in _GEMMA4:  # experts beside the dense MLP in every layer, top-k renormalised
        return MoEConfig(int(cfg["num_experts"]), int(cfg["top_k_experts"]), int(cfg["moe_intermediate_size"]), True,
                         tuple(range(num_layers)), gelu=True) if cfg.get("enable_moe_block") else None
    if arch in HYBRID_ARCHITECTURES:
        return _hybrid_moe(cfg, arch, num_layers)
    if arch != "Qwen3MoeForCausalLM":
        return None
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 saves the latter
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if not num_experts or not layers:
        return None
    return MoEConfig(num_experts, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                     bool(cfg.get("norm_topk_prob", False)), layers)


def _gpt_oss_moe(cfg: dict, num_layers: int) -> MoEConfig:
    """gpt-oss: experts in every layer, softmax over the top-k logits (renormalised), biases, the
    clamped SwiGLU; MXFP4 experts where the checkpoint says so (its quantization_config)."""
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise ModelConfigError(f"unsupported quantization {quant!r} of gpt-oss experts; supported: mxfp4")
    return MoEConfig(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]), int(cfg["intermediate_size"]),
                     True, tuple(range(num_layers)), biases=True,
                     swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
                     mxfp4=quant == "mxfp4")


def _hybrid_moe(cfg: dict, arch: str, num_layers: int) -> MoEConfig | None:
    """Qwen3-Next: as Qwen3-MoE's layers; Qwen3.5-MoE: every layer, renormalised. Both add a shared expert."""
    num_experts = int(cfg.get("num_experts") or 0)
    if not num_experts or arch in ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"):
        return None
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    renormalize = bool(cfg.get("norm_topk_prob", True)) or arch != "Qwen3NextForCausalLM"
    return MoEConfig(num_experts, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                     renormalize, layers, shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))


def _linear_attn(cfg: dict, arch: str, num_layers: int, head_dim: int) -> LinearAttnConfig | None:
    if arch not in HYBRID_ARCHITECTURES:
        return None
    interval = int(cfg.get("full_attention_interval", 4))
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                       for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ModelConfigError(f"layer_types must name linear_attention or full_attention for each of "
                               f"{num_layers} layers, got {types}")
    factor = float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    return LinearAttnConfig(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        num_k_heads=int(cfg["linear_num_key_heads"]), num_v_heads=int(cfg["linear_num_value_heads"]),
        k_head_dim=int(cfg["linear_key_head_dim"]), v_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)), rotary_dim=int(head_dim * factor),
        grouped_projections=arch == "Qwen3NextForCausalLM",
        weight_prefix="model.language_model" if arch in _MULTIMODAL else "model",
        mtp_layers=int(cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers")) or 0),
        ssm_dtype=cfg.get("mamba_ssm_dtype"))


def _text_config(cfg: dict, arch: str) -> dict:
    """The multimodal checkpoints' text model: text_config's fields over the top level's."""
    if arch not in _MULTIMODAL:
        return cfg
    merged = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    merged.update(cfg.get("text_config") or {})
    if "tie_word_embeddings" in cfg:  # the top level's is the one transformers ties by
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged


def read_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelConfigError(f"model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    return _model_config(model_dir, read_json(path), path)


def _model_config(model_dir: Path, cfg: dict, path: Path) -> ModelConfig:
    arch = _architecture(cfg, path)
    cfg = _text_config(cfg, arch)
    if arch in HYBRID_ARCHITECTURES:  # Qwen3.5-MoE's config names no dense width: it has no dense layer
        cfg.setdefault("intermediate_size", cfg.get("moe_intermediate_size"))
    _check_supported(cfg, path)
    theta, scaling, local_theta = _rope(cfg, path, _DEFAULT_ROPE_THETA.get(arch, 10000.0))
    num_heads = int(cfg["num_attention_heads"])
    num_layers = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
    generation = _generation_config(model_dir)
    windows = _layer_windows(cfg, arch, num_layers)
    prefix = "model.language_model." if arch == "Gemma4ForConditionalGeneration" else "model."
    return ModelConfig(
        model_dir=str(model_dir),
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in _GEMMA)),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        eos_token_ids=_eos_token_ids(cfg, generation),
        sampling_defaults={name: generation[name] for name in SAMPLING_FIELDS if generation.get(name) is not None},
        layer_windows=windows,
        local_rope_theta=(local_theta or 10000.0) if arch in ("Gemma3ForCausalLM", *_GEMMA4) else None,
        hidden_act=_activation(cfg, path),
        moe=_moe(cfg, arch, num_layers),
        linear_attn=_linear_attn(cfg, arch, num_layers, head_dim),
        gemma4=_gemma4(cfg, windows, num_layers, prefix, path) if arch in _GEMMA4 else None,
        **{**_biases(cfg), **(_gemma(cfg) if arch in _GEMMA else {}), **SUPPORTED_ARCHITECTURES[arch]},
    )


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft head: one Llama decoder layer (`layer`) whose q/k/v read the normed token
    embedding beside the normed feature (2 x hidden_size), `fc` from three target layers' hidden
    states (3 x target_hidden_size) to hidden_size, and its own final norm and LM head over a
    reduced vocabulary of draft_vocab_size tokens (d2t maps them to the target's)."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    # eagle_config.eagle_aux_hidden_state_layer_ids: the target layers whose outputs feed fc; None: the default
    aux_layer_ids: tuple[int, ...] | None = None
    # the residual stream starts from hidden_norm(feature), not the feature (some trained heads' config.json)
    norm_before_residual: bool = False

    def aux_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose input hidden states feed fc, ascending: (2, L // 2, L - 3) of an
        L-layer target, as the published heads were trained, or the config's ids + 1 (it names
        each layer whose output it takes, the input of the next)."""
        ids = ((2, target_layers // 2, target_layers - 3) if self.aux_layer_ids is None
               else tuple(i + 1 for i in self.aux_layer_ids))
        if len(ids) != 3 or list(ids) != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < target_layers:
            raise ModelConfigError(f"an EAGLE-3 head takes three ascending layers of the target's {target_layers}; "
                                   f"got the inputs of layers {ids}")
        return ids


EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def read_eagle3_config(model_dir: str | Path) -> Eagle3Config:
    """An EAGLE-3 head's directory: its config.json names one of EAGLE3_ARCHITECTURES, or (the
    first published heads) LlamaForCausalLM with a draft_vocab_size."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelConfigError(f"draft model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    top = read_json(path)
    arch = (top.get("architectures") or [None])[0]
    if arch not in EAGLE3_ARCHITECTURES and "draft_vocab_size" not in top:
        raise ModelConfigError(f"{path} is not an EAGLE-3 head: architecture {arch!r} without draft_vocab_size; "
                               f"supported: {', '.join(EAGLE3_ARCHITECTURES)}")
    cfg = {**top, **(top.get("transformer_layer_config") or {})}  # the speculators layout nests the layer's fields
    unsupported = [name for name in ("norm_before_fc", "fc_norm") if cfg.get(name)]
    if unsupported:
        raise ModelConfigError(f"{path}: {', '.join(unsupported)} (norms on the target's hidden states) not supported")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        logger.warning("%s says num_hidden_layers %s; an EAGLE-3 head has one decoder layer", path,
                       cfg["num_hidden_layers"])
    layer = _model_config(model_dir, {**cfg, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}, path)
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or cfg.get(
        "eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(layer, int(cfg.get("draft_vocab_size") or layer.vocab_size),
                        int(cfg.get("target_hidden_size") or layer.hidden_size),
                        tuple(int(i) for i in ids) if ids else None, bool(cfg.get("norm_before_residual", False)))


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


def resolve_mxfp4_experts(choice: str, config: ModelConfig, dtype: torch.dtype, gpu_bytes: float | None,
                          tp: int = 1) -> str:
    """--mxfp4_experts: packed or dequantized as given; auto (the default) widens an MXFP4
    checkpoint's experts at load on a GPU where this rank's share of them, widened (to fp8 under
    --quantization fp8, else to `dtype`), takes at most half of `gpu_bytes` (the memory the server
    may use on it), and keeps them packed elsewhere (gpt-oss-120b on one H200; gpu_bytes None: the
    CPU). A model without MXFP4 experts keeps `choice`: there is nothing to widen."""
    moe = config.moe
    if choice != "auto" or moe is None or not moe.mxfp4:
        return choice
    width = 1 if config.quantization == "fp8" else dtype.itemsize
    widened = len(moe.layers) * moe.num_experts * 3 * moe.intermediate_size * config.hidden_size * width / tp
    return "dequantized" if gpu_bytes is not None and widened <= gpu_bytes / 2 else "packed"


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


STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_state_dtype(mamba_ssm_cache_dtype: str, linear_attn: LinearAttnConfig | None) -> torch.dtype:
    """The dtype of the hybrid models' recurrent states in their pool (`--mamba_ssm_cache_dtype`):
    auto takes the checkpoint's `mamba_ssm_dtype`, else float32 (the delta rule accumulates in fp32;
    a bf16 pool halves a request's state and the bytes a decode step moves, at the cost of rounding
    the state once a step)."""
    name = mamba_ssm_cache_dtype
    if name == "auto":
        name = (linear_attn.ssm_dtype if linear_attn else None) or "float32"
    if name not in STATE_DTYPES:
        raise ModelConfigError(f"mamba_ssm_cache_dtype must be auto or one of {', '.join(STATE_DTYPES)}, got {name!r}")
    return STATE_DTYPES[name]
