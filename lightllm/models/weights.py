"""Weight sources for the layers: a checkpoint directory, or random weights from the config.

Layers ask for a tensor by its checkpoint name, its full shape, and the slice this rank keeps
(`dim`, `start`, `length`); they get it on the device in the model dtype, or in the dtype they
name (packed MXFP4 experts: uint8). Safetensors slices
are read straight from the file, so a rank never materialises the other ranks' shards.
"""

from __future__ import annotations

import json
import logging
import zipfile
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

CHECKPOINT_LAYOUTS = ("model.safetensors", "model.safetensors.index.json", "*.safetensors",
                      "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model*.bin")


class WeightLoadError(RuntimeError):
    """A weight file is missing, unreadable, or does not match the config."""


def _index_files(model_dir: Path, index_name: str) -> list[Path]:
    index_path = model_dir / index_name
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
        raise WeightLoadError(f"{index_path} is not a valid checkpoint index: {e}") from None
    return [model_dir / name for name in sorted(set(weight_map.values()))]


def find_weight_files(model_dir: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (model_dir / index_name).exists():
            return _index_files(model_dir, index_name)
    for pattern in ("*.safetensors", "pytorch_model*.bin"):
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise WeightLoadError(f"no weights found in {model_dir}: expected one of "
                          f"{', '.join(CHECKPOINT_LAYOUTS)} (or use load_format='dummy')")


def _open(path: Path):
    """name -> lazily readable tensor handle for one file."""
    if not path.exists():
        raise WeightLoadError(f"weight file {path} is missing (named in the checkpoint index)")
    try:
        if path.suffix == ".safetensors":
            handle = safe_open(str(path), framework="pt")
            return {name: (handle, name) for name in handle.keys()}
        # mmap needs the zip format that torch.save has written since torch 1.6
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        return {name: (None, tensor) for name, tensor in state.items()}
    except Exception as e:  # safetensors and torch raise many types for a damaged file
        raise WeightLoadError(f"cannot read weight file {path}: {e}") from None


def _read_part(entry, dim: int, start: int, length: int) -> torch.Tensor:
    handle, ref = entry
    if handle is None:
        return ref.narrow(dim, start, length)
    view = handle.get_slice(ref)
    index = (slice(None),) * dim + (slice(start, start + length),)
    return view[index]


class CheckpointWeights:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device):
        self.model_dir = Path(model_dir)
        self.dtype, self.device = dtype, device
        self.entries = {}
        for path in find_weight_files(self.model_dir):
            self.entries.update(_open(path))
        logger.info("checkpoint %s: %d tensors", self.model_dir, len(self.entries))

    def has(self, name: str) -> bool:
        return name in self.entries

    def _shape(self, entry) -> list[int]:
        handle, ref = entry
        return list(ref.shape) if handle is None else handle.get_slice(ref).get_shape()

    def get(self, name: str, shape: tuple[int, ...], dim: int = 0, start: int = 0,
            length: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.entries:
            raise WeightLoadError(f"tensor {name!r} not found in the checkpoint in {self.model_dir}")
        entry = self.entries[name]
        found = self._shape(entry)
        if found != list(shape):
            raise WeightLoadError(f"tensor {name!r} has shape {found}, config.json implies {list(shape)}")
        length = shape[dim] - start if length is None else length
        part = _read_part(entry, dim, start, length)
        return part.to(device=self.device, dtype=dtype or self.dtype).contiguous()


class DummyWeights:
    """Random weights (normal, std 0.02; norm weights 1) made directly on the device.

    With `echo` (load_format "dummy_echo") the attention and MLP output projections are zero and
    the LM head is the embedding, so the model answers every token with itself by a margin of
    about 75 logits (|e|^2 / rms(e) against the others' ~N(0, |e|^2)): greedy output no longer
    depends on the kernels' rounding, which a benchmark that replays an earlier run's output as
    drafts needs. Every shape, kernel and byte moved is as with "dummy". An EAGLE-3 head's `fc`
    passes the first of its three features through ([I, 0, 0]), so that an echo head over an echo
    target (the same vocabulary) drafts the token it is given: every draft is accepted; so does an
    MTP layer's `mtp.fc`, passing the token's embedding through."""

    ZERO_IN_ECHO = ("o_proj.weight", "down_proj.weight", "out_proj.weight")  # out_proj: linear attention's
    FEATURE_THROUGH = ("fc.weight", "mtp.fc.weight")  # an EAGLE-3 head's fc, an MTP layer's
    ONES = ("norm.weight", "layer_scalar")  # scales (Gemma 4 multiplies each layer's output by its layer_scalar)
    # uint8 tensors (MXFP4 experts): any packed pair of values; scales of 2^-6..2^-3, weights of
    # about dense's size
    MXFP4_SCALES = (121, 125)

    def __init__(self, dtype: torch.dtype, device: torch.device, seed: int = 0, echo: bool = False):
        self.dtype, self.device, self.echo, self.seed = dtype, device, echo, seed
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def has(self, name: str) -> bool:
        """False: a tensor a checkpoint may leave out (an EAGLE-3 head's embedding, its vocabulary
        map) is taken as left out; `get` still makes any tensor asked for."""
        return False

    def get(self, name: str, shape: tuple[int, ...], dim: int = 0, start: int = 0,
            length: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        if dtype == torch.uint8:
            return self._packed(name, shape, dim, start, length)
        if self.echo:
            return self._echo(name, shape, dim, start, length)
        shape = list(shape)
        shape[dim] = shape[dim] - start if length is None else length
        if name.endswith(self.ONES):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        return out.normal_(0.0, 0.02, generator=self.generator)

    def _packed(self, name: str, shape: tuple[int, ...], dim: int, start: int, length: int | None) -> torch.Tensor:
        shape = list(shape)
        shape[dim] = shape[dim] - start if length is None else length
        low, high = self.MXFP4_SCALES if name.endswith("_scales") else (0, 256)
        return torch.randint(low, high, shape, dtype=torch.uint8, device=self.device, generator=self.generator)

    def _echo(self, name: str, shape: tuple[int, ...], dim: int, start: int, length: int | None) -> torch.Tensor:
        """The whole tensor from a generator seeded by its name (the LM head by the embedding's),
        then this rank's slice."""
        if name.endswith(self.ONES):
            full = torch.ones(shape, dtype=self.dtype, device=self.device)
        elif name.endswith(self.ZERO_IN_ECHO):
            full = torch.zeros(shape, dtype=self.dtype, device=self.device)
        elif name in self.FEATURE_THROUGH:  # [hidden, n x hidden]: the first feature (MTP: the embedding) through
            full = torch.zeros(shape, dtype=self.dtype, device=self.device)
            full[:, : shape[0]] = torch.eye(shape[0], dtype=self.dtype, device=self.device)
        else:
            key = "model.embed_tokens.weight" if name == "lm_head.weight" else name
            generator = torch.Generator(device=self.device).manual_seed(zlib.crc32(key.encode()))
            full = torch.empty(shape, dtype=self.dtype, device=self.device).normal_(0.0, 0.02, generator=generator)
        return full.narrow(dim, start, shape[dim] - start if length is None else length)
