"""How many kernels one eager step launches, counted without a GPU: the GPU path's Triton kernels
(run by Triton's interpreter on the CPU) and torch's operators that launch device work (views and
allocations left out), for a step of `--decodes` decodes and one `--chunk`-token chunk.

    TRITON_INTERPRET=1 python test/benchmark/engine/count_launches.py --model DIR [--quantization fp8]

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

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.engine.static_benchmark import Bench  # noqa: E402

import lightllm.kernels  # noqa: E402
from lightllm.engine.config import EngineConfig  # noqa: E402
from lightllm.engine.model_runner import ModelRunner  # noqa: E402
from benchmark.lib.direct_step import run_step
from lightllm.models import layers  # noqa: E402
from lightllm.kernels import _triton  # noqa: E402

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
    saved = {name: getattr(layers, name) for name in dir(layers)
             if callable(getattr(layers, name)) and hasattr(lightllm.kernels, name.rstrip("_") + "_triton")}
    launch, apply = _triton._FastKernel._launch, runner._apply_and_launch

    def counted_apply(plan, *args):  # on the CPU the step runs on the runner's device thread
        with counter:
            return apply(plan, *args)

    try:
        for name in saved:
            setattr(layers, name, getattr(lightllm.kernels, name.rstrip("_") + "_triton"))
        _triton._FastKernel._launch = counter.triton(launch)
        runner._apply_and_launch = counted_apply
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(layers, name, fn)
        _triton._FastKernel._launch, runner._apply_and_launch = launch, apply


def count_step(runner: ModelRunner, decodes: int, chunk: int) -> collections.Counter:
    """Launches of one step of `decodes` running requests (16 tokens each) and a `chunk`-token prompt."""
    bench = Bench(runner, seed=0)
    running = bench.new_reqs(decodes, 16)
    run_step(runner, prompts=running)
    ids = [r[0] for r in running]
    prompt = bench.new_reqs(1, chunk)
    with counting(runner) as counter:
        run_step(runner, ids, prompt)
    runner.free(ids + [prompt[0][0]])
    return counter.counts


def make_runner(model: Path, load_format: str = "dummy", quantization: str | None = None) -> ModelRunner:
    config = EngineConfig(model_dir=str(model), max_total_token_num=4096, max_req_total_len=1024,
                          running_max_req_size=16, data_type="float32", load_format=load_format,
                          quantization=quantization)
    return ModelRunner(config, device="cpu", check_budget=False)


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
    parser.add_argument("--chunk", type=int, default=96, help="tokens; above 64 the fp8 GEMMs are cuBLAS's")
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
        runner = make_runner(model, "dummy" if args.layers is not None else args.load_format, args.quantization)
        counts = count_step(runner, args.decodes, args.chunk)
    num_layers = runner.config.num_layers
    print(f"Eager step of {args.decodes} decodes and a {args.chunk}-token chunk, {args.model.name}, "
          f"{num_layers} layers{', fp8 projections' if args.quantization else ''}:\n")
    print("\n".join(table(counts, num_layers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
