"""Model config, weight loading, shared tensor-parallel layers and the Llama family."""

from __future__ import annotations

import logging
import time

import torch

from lightllm.utils.dist import TPGroup

from .config import (HYBRID_ARCHITECTURES, SUPPORTED_ARCHITECTURES, Eagle3Config, ModelConfig, ModelConfigError,
                     read_config, read_eagle3_config, resolve_dtype, resolve_kv_dtype, resolve_mxfp4_experts,
                     resolve_state_dtype)
from .layers import ForwardBatch
from .eagle3 import Eagle3Head, load_eagle3
from .gemma4 import Gemma4Model
from .llama import LlamaModel
from .qwen3_next import HybridModel
from .weights import CheckpointWeights, DummyWeights, WeightLoadError

logger = logging.getLogger(__name__)

MODEL_CLASSES = {arch: Gemma4Model if arch.startswith("Gemma4") else LlamaModel for arch in SUPPORTED_ARCHITECTURES}
MODEL_CLASSES.update({arch: HybridModel for arch in HYBRID_ARCHITECTURES})
LOAD_FORMATS = ("auto", "dummy", "dummy_echo")


def load_model(cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device, tp: TPGroup,
               max_positions: int, load_format: str = "auto") -> LlamaModel:
    """Build the model for this TP rank: weights from the checkpoint ("auto") or random ("dummy")."""
    if load_format not in LOAD_FORMATS:
        raise ModelConfigError(f"unsupported load_format {load_format!r}; supported: {', '.join(LOAD_FORMATS)}")
    start = time.perf_counter()
    weights = (DummyWeights(dtype, device, seed=tp.rank, echo=load_format == "dummy_echo")
               if load_format.startswith("dummy") else CheckpointWeights(cfg.model_dir, dtype, device))
    with torch.inference_mode():
        model = MODEL_CLASSES[cfg.architecture](cfg, weights, tp, max_positions, device)
    logger.info("loaded %s (%s weights, %s, tp %d/%d) in %.1f s", cfg.architecture, load_format, dtype,
                tp.rank, tp.world_size, time.perf_counter() - start)
    return model


__all__ = ["ModelConfig", "ModelConfigError", "WeightLoadError", "ForwardBatch", "LlamaModel",
           "read_config", "resolve_dtype", "resolve_kv_dtype", "resolve_mxfp4_experts", "resolve_state_dtype",
           "load_model", "SUPPORTED_ARCHITECTURES",
           "Eagle3Config", "Eagle3Head", "read_eagle3_config", "load_eagle3"]
