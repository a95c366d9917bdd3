"""This tree's fused MoE kernels against another commit's, in one process, alternating.

    git archive OLD_COMMIT kernels | tar -x -C /tmp/old      # that commit's kernels/ at /tmp/old/kernels
    python test/benchmark/kernels/moe_ab.py --old /tmp/old/kernels [--shape qwen3-30b-a3b]
        [--cases bf16:4096,fp8:16384] [--rounds 3] [--smoke]

One MoE layer of the shape (moe_bench.py's shapes, tp 1), by default bf16 at 64, 256, 4096 and
16384 tokens and fp8 experts at 4096 and 16384, the same weights and routing for both trees (a tree
whose kernels predate `interleave_gate_up` takes the gate rows, then the up rows). Each size is
first checked: both trees' Triton paths against their own reference, the references against each
other. Then, in
`--rounds` rounds, each a CUDA graph of 20 calls (static_benchmark.graph_call_us): the whole layer,
the gate/up and the down kernel alone (on this tree's alignment and intermediate; the old tree's
kernels too where both trees choose the same row block) and the alignment. Prints the medians and
the GEMMs' share of bf16 peak (989 TFLOP/s: H100 or H200 SXM): at 9807f0b the grouped GEMMs took 50.3-50.4% at 16384 tokens (H200, 2026-12-01).
Two leases of a GPU differ by a few percent, so the trees are compared in the same process.
`--smoke`: tiny shapes on the CPU under TRITON_INTERPRET=1, timing nothing, to check the script.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.kernels.moe_bench import SHAPES  # noqa: E402
from benchmark.engine.static_benchmark import graph_call_us  # noqa: E402

from lightllm.kernels.fp8_linear import quantize_fp8_rows_triton  # noqa: E402

new = importlib.import_module("lightllm.kernels.fused_moe")  # the package's fused_moe function shadows the module
logger = logging.getLogger("moe_ab")
PEAK = 989e12
CASES = "bf16:64,bf16:256,bf16:4096,bf16:16384,fp8:4096,fp8:16384"
SMOKE_CASES = "bf16:3,bf16:300,fp8:300"


def parse_cases(text: str) -> list[tuple[bool, int]]:
    """'bf16:4096,fp8:16384' -> [(fp8, tokens), ...]"""
    cases = []
    for item in text.split(","):
        kind, _, tokens = item.partition(":")
        if kind not in ("bf16", "fp8") or not tokens.isdigit():
            raise argparse.ArgumentTypeError(f"a case is bf16:TOKENS or fp8:TOKENS, not {item!r}")
        cases.append((kind == "fp8", int(tokens)))
    return cases


def load_old(kernels_dir: Path):
    """The other tree's kernels package, imported as `old_kernels` (its modules import each other
    relatively), and its fused_moe module."""
    spec = importlib.util.spec_from_file_location("old_kernels", kernels_dir / "__init__.py",
                                                  submodule_search_locations=[str(kernels_dir)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["old_kernels"] = package
    spec.loader.exec_module(package)
    return importlib.import_module("old_kernels.fused_moe")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="another commit's kernels/ directory")
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--cases", type=parse_cases, default=None, help=f"default {CASES} ({SMOKE_CASES} with --smoke)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), untimed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.smoke and not torch.cuda.is_available():
        logger.error("moe_ab needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
        return 2
    old = load_old(args.old)
    timer = (lambda f: (f(), 1.0)[1]) if args.smoke else graph_call_us
    device = "cpu" if args.smoke else "cuda"
    hidden, inter, experts, top_k = (64, 32, 8, 2) if args.smoke else SHAPES[args.shape]
    torch.manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden ** -0.5).bfloat16()
    w_new = new.interleave_gate_up(gate_up[:, :inter], gate_up[:, inter:])
    w_old = old.interleave_gate_up(gate_up[:, :inter], gate_up[:, inter:]) if hasattr(old, "interleave_gate_up") \
        else gate_up
    w_down = (torch.randn(experts, hidden, inter, device=device) * inter ** -0.5).bfloat16()
    q_old = (*old.quantize_experts_fp8(w_old), *old.quantize_experts_fp8(w_down))
    q_new = (*new.quantize_experts_fp8(w_new), *new.quantize_experts_fp8(w_down))
    print(f"{torch.cuda.get_device_name() if not args.smoke else 'cpu (smoke)'}, torch {torch.__version__}; old "
          f"kernels {args.old}; hidden {hidden}, {experts} experts of {inter}, top {top_k}; medians of "
          f"{args.rounds} rounds, us")
    print("| experts | tokens | layer old | layer new | new / old | gate/up old | gate/up new | down old | down new "
          "| align | GEMMs old, % bf16 peak | GEMMs new | layer new |")
    print("|" + " --- |" * 13)
    for fp8, tokens in args.cases or parse_cases(SMOKE_CASES if args.smoke else CASES):
        x = torch.randn(tokens, hidden, device=device).bfloat16()
        weights, ids = new.route_topk(torch.randn(tokens, experts, device=device), top_k, renormalize=True)
        if fp8:  # (w_gate_up, w_down, routing, scales): fused_moe's argument order
            (g_old, gs_old, d_old, ds_old), (g_new, gs_new, d_new, ds_new) = q_old, q_new
        else:
            (g_old, gs_old, d_old, ds_old), (g_new, gs_new, d_new, ds_new) = (w_old, None, w_down, None), \
                (w_new, None, w_down, None)
        scales_old, scales_new = ((gs_old, ds_old), (gs_new, ds_new)) if fp8 else ((), ())
        args_old, args_new = (g_old, d_old, weights, ids, *scales_old), (g_new, d_new, weights, ids, *scales_new)
        ref_old, ref_new = old.fused_moe_ref(x, *args_old), new.fused_moe_ref(x, *args_new)
        errs = (rel(old.fused_moe_triton(x, *args_old), ref_old), rel(new.fused_moe_triton(x, *args_new), ref_new),
                rel(ref_new, ref_old))
        if not (errs[0] < 6e-2 and errs[1] < 6e-2 and errs[2] < 1e-6):
            raise AssertionError(f"tokens {tokens} fp8 {fp8}: old and new against their references, the references "
                                 f"apart: {errs}")
        plans_old, plans_new = old.moe_plans(tokens * top_k, experts, fp8), new.moe_plans(tokens * top_k, experts, fp8)
        block_m = plans_new[0].block_m
        sorted_pairs, block_experts = new.align_by_expert_triton(ids, experts, block_m)
        a, a_scale = quantize_fp8_rows_triton(x) if fp8 else (x, None)
        h = new.moe_gate_up_triton(a, a_scale, g_new, gs_new, sorted_pairs, block_experts, top_k, x.dtype,
                                   plans_new[0])
        h_in, h_scale = quantize_fp8_rows_triton(h) if fp8 else (h, None)
        pair_weights = weights.float().contiguous().view(-1)
        runs = {"layer old": lambda: old.fused_moe_triton(x, *args_old),
                "layer new": lambda: new.fused_moe_triton(x, *args_new),
                "gate/up new": lambda: new.moe_gate_up_triton(a, a_scale, g_new, gs_new, sorted_pairs, block_experts,
                                                              top_k, x.dtype, plans_new[0]),
                "down new": lambda: new.moe_down_triton(h_in, h_scale, d_new, ds_new, sorted_pairs, block_experts,
                                                        pair_weights, x.dtype, plans_new[1]),
                "align": lambda: new.align_by_expert_triton(ids, experts, block_m)}
        if plans_old[0].block_m == block_m:  # the old kernels on the same alignment
            runs["gate/up old"] = lambda: old.moe_gate_up_triton(a, a_scale, g_old, gs_old, sorted_pairs, block_experts,
                                                                 top_k, x.dtype, plans_old[0])
            runs["down old"] = lambda: old.moe_down_triton(h_in, h_scale, d_old, ds_old, sorted_pairs, block_experts,
                                                           pair_weights, x.dtype, plans_old[1])
        times = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                times[name].append(timer(run))
        med = {name: statistics.median(t) for name, t in times.items()}
        nan = float("nan")
        flops = 6 * tokens * top_k * hidden * inter

        def share(us: float) -> float:
            return 100 * flops / (us * 1e-6) / PEAK

        gemms_old = med.get("gate/up old", nan) + med.get("down old", nan)
        gemms_new = med["gate/up new"] + med["down new"]
        cells = [med["layer old"], med["layer new"], med["layer new"] / med["layer old"], med.get("gate/up old", nan),
                 med["gate/up new"], med.get("down old", nan), med["down new"], med["align"], share(gemms_old),
                 share(gemms_new), share(med["layer new"])]
        print(f"| {'fp8' if fp8 else 'bf16'} | {tokens} | "
              + " | ".join(f"{v:.3f}" if i == 2 else f"{v:.1f}" for i, v in enumerate(cells)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
