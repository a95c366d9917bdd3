"""How many kernels one eager step launches, counted without a GPU: the GPU path's Triton kernels
(run by Triton's interpreter on the CPU) and torch's operators that launch device work (views and
allocations left out), for a step of `--decodes` decodes and one `--chunk`-token chunk (none: 0),
every request under one random LoRA adapter of rank `--lora-rank` (0: none).

    TRITON_INTERPRET=1 python test/benchmark/engine/count_launches.py --model DIR [--quantization fp8]
        [--chunk 0 --lora-rank 16]

An eager step's host time is mostly its launches (H100, 2026-11-23, 78e0a1e; docs/benchmarks-history.md: about 36 us a Triton launch
and 41 us a torch._scaled_mm on the H100 hosts), so the count stands in for that time where no GPU
is at hand. Prints one markdown table: each kernel or operator, its launches per step and per layer.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.engine.static_benchmark import Bench  # noqa: E402

import lightllm.kernels  # noqa: E402
from lightllm.engine.config import EngineConfig  # noqa: E402
from lightllm.engine.model_runner import ModelRunner  # noqa: E402
from benchmark.lib.direct_step import run_step
from lightllm.models import layers, lora, read_config  # noqa: E402
from lightllm.kernels import _triton  # noqa: E402
from lightllm.tools.bench_lora import write_adapter  # noqa: E402

NO_LAUNCH = ("empty", "empty_like", "empty_strided", "lift_fresh", "_to_copy_meta")


class Counter(TorchDispatchMode):
    """Counts torch operators that launch work, and (through fast_launch) Triton kernels; what
    Triton's interpreter does inside a kernel is not counted."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in NO_LAUNCH:
            self.counts[f"torch {name}"] += 1
        return func(*args, **(kwargs or {}))

    def triton(self, launch):
        def counted(kernel, grid, args, kwargs):
            self.counts[f"triton {kernel.fn.__name__}"] += 1
            self.paused, was = True, self.paused
            try:
                return launch(kernel, grid, args, kwargs)
            finally:
                self.paused = was
        return counted


@contextlib.contextmanager
def counting(runner: ModelRunner):
    """Within: the layers call the Triton version of every kernel, as on a GPU (here under the
    interpreter), and the runner's steps are counted into the Counter yielded."""
    counter = Counter()
    saved = {(module, name): getattr(module, name) for module in (layers, lora) for name in dir(module)
             if callable(getattr(module, name)) and hasattr(lightllm.kernels, name.rstrip("_") + "_triton")}
    launch, apply = _triton._FastKernel._launch, runner._apply_and_launch

    def counted_apply(plan):  # on the CPU the step runs on the runner's device thread
        with counter:
            return apply(plan)

    try:
        for module, name in saved:
            setattr(module, name, getattr(lightllm.kernels, name.rstrip("_") + "_triton"))
        _triton._FastKernel._launch = counter.triton(launch)
        runner._apply_and_launch = counted_apply
        yield counter
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
        _triton._FastKernel._launch, runner._apply_and_launch = launch, apply


def count_step(runner: ModelRunner, decodes: int, chunk: int) -> collections.Counter:
    """Launches of one step of `decodes` running requests (16 tokens each) and a `chunk`-token prompt
    (none: 0), each under the runner's first LoRA adapter where it has one."""
    bench, adapter = Bench(runner, seed=0), 1 if runner.loras is not None else 0
    running = bench.new_reqs(decodes, 16)
    run_step(runner, prompts=running, lora=adapter)
    ids = [r[0] for r in running]
    prompt = bench.new_reqs(1, chunk) if chunk else []
    with counting(runner) as counter:
        run_step(runner, ids, prompt, lora=adapter)
    runner.free(ids + [r[0] for r in prompt])
    return counter.counts


def make_runner(model: Path, load_format: str = "dummy", quantization: str | None = None,
                lora_rank: int = 0) -> ModelRunner:
    """lora_rank > 0: with one random adapter of that rank on every projection it may adapt (id 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        loras = {}
        if lora_rank:
            path = write_adapter(Path(tmp) / "lora", lora.module_shapes(read_config(str(model))), lora_rank,
                                 torch.float32, seed=0)
            loras = dict(lora_modules=(f"lora={path}",), max_loras=1, max_lora_rank=lora_rank)
        config = EngineConfig(model_dir=str(model), max_total_token_num=4096, max_req_total_len=1024,
                              running_max_req_size=16, data_type="float32", load_format=load_format,
                              quantization=quantization, **loras)
        return ModelRunner(config, device="cpu", check_budget=False)  # the adapter is read in here


def table(counts: collections.Counter, num_layers: int) -> list[str]:
    lines = ["| launched | per step | per layer |", "| --- | ---: | ---: |"]
    for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"| {name} | {n} | {n / num_layers:.2f} |")
    triton = sum(n for name, n in counts.items() if name.startswith("triton"))
    total = sum(counts.values())
    lines.append(f"| **all Triton kernels** | {triton} | {triton / num_layers:.2f} |")
    lines.append(f"| **all** | {total} | {total / num_layers:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--quantization", choices=("fp8",), default=None)
    parser.add_argument("--decodes", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=96, help="tokens (0: none); above 64 the fp8 GEMMs are cuBLAS's")
    parser.add_argument("--lora-rank", type=int, default=0, help="every request under a random adapter of this rank")
    parser.add_argument("--layers", type=int, default=None,
                        help="count a model of this many layers (the model's config otherwise; dummy weights)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1: the Triton kernels run on the CPU under the interpreter")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.layers is not None:
            model = Path(shutil.copytree(args.model, Path(tmp) / args.model.name, ignore=shutil.ignore_patterns("*.safetensors")))
            config = json.loads((model / "config.json").read_text())
            (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": args.layers}))
        runner = make_runner(model, "dummy" if args.layers is not None else args.load_format, args.quantization,
                             args.lora_rank)
        counts = count_step(runner, args.decodes, args.chunk)
    num_layers = runner.config.num_layers
    chunk = f"a {args.chunk}-token chunk" if args.chunk else "no chunk"
    print(f"Eager step of {args.decodes} decodes and {chunk}, {args.model.name}, "
          f"{num_layers} layers{', fp8 projections' if args.quantization else ''}"
          f"{f', a rank-{args.lora_rank} LoRA adapter' if args.lora_rank else ''}:\n")
    print("\n".join(table(counts, num_layers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
