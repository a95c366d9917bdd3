"""A decode step's LoRA work in CUDA graphs: the fused kernel against the shrink and the expand.

    python test/benchmark/kernels/lora_bench.py [--rows 1,8,16,32,64,256] [--layers 32] [--fused 128,32:-:-:3,...]

bench-8b's projection groups (hidden 4096; q/k/v 6144 out, its A three parts of rank 16 stacked: 48
rows; o 4096; gate/up 2 x 14336 out, A 32 rows; down 14336 in), rank 16, 16 slots, bf16, each layer
its own weights. For each row count (row t under slot t mod 16, so every row has an adapter and the
step's rows spread over the slots), one CUDA graph per plan of what a step launches for LoRA in
`--layers` layers (the segments, made once a step, left out): the shrink and the expand (two
launches a group), the fused kernel (one a group) in each `--fused` launch plan (PROGRAMS or
PROGRAMS:BLOCK_K:BLOCK_N:STAGES:WARPS, "-" for the default: fused_tiles's target, the A tile's K
block, the N tile, the pipeline's stages, the warps; "128" is the default launch), and `lora_add_`
as served (the plan FUSED_MAX_ROWS picks). Every plan is first checked on one layer against the
torch reference (lora_add_ref): the largest difference of the added term, relative to its largest
value, in the last column (bf16: about 1e-2 at most; above 3e-2 the run fails). Prints one markdown
table of microseconds per step. CUDA only (says so and exits 0 elsewhere); about a minute on an
H200, most of it compiling.
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.engine.static_benchmark import capture, replay_us  # noqa: E402

from lightllm.kernels import lora  # noqa: E402

logger = logging.getLogger("lora_bench")

HIDDEN, INTER, RANK, SLOTS = 4096, 14336, 16, 16
GROUPS = {"qkv": (6144, HIDDEN, 3), "o": (HIDDEN, HIDDEN, 1), "gate_up": (2 * INTER, HIDDEN, 2),
          "down": (HIDDEN, INTER, 1)}  # name -> (N, K, parts of rank RANK)
WEIGHT_STD = 0.05  # x ~ N(0, 1): s ~ 3, the added term ~ 0.6, well above bf16's rounding of y


def shrink_then_expand(y, x, a, b, seg):
    return lora.lora_expand_triton(y, lora.lora_shrink_triton(x, a, seg), b, seg)


def fused_plan(spec: str):
    """PROGRAMS[:BLOCK_K[:BLOCK_N[:STAGES[:WARPS]]]] ("-": the default) -> the fused kernel so launched."""
    names = ("programs", "block_k", "block_n", "stages", "warps")
    fields = {name: int(f) for name, f in zip(names, spec.split(":")) if f != "-"}
    return functools.partial(lora.lora_shrink_expand_triton, **fields)


def make_layers(layers: int) -> list[dict]:
    """Each layer's a [S, parts * R, K] and b [S, N, parts * R] per group."""
    def weight(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * WEIGHT_STD

    return [{g: (weight(SLOTS, p * RANK, k), weight(SLOTS, n, p * RANK)) for g, (n, k, p) in GROUPS.items()}
            for _ in range(layers)]


def relative_error(plan, weights: dict, x: dict, seg) -> float:
    """The largest error of the plan's added term against the reference's, over its largest value."""
    worst = 0.0
    for g, (a, b) in weights.items():
        y = torch.randn(x[g].shape[0], b.shape[1], device="cuda", dtype=torch.bfloat16) * 0.1  # ulp << the term's
        expected = lora.lora_add_ref(y.clone(), x[g], a, b, seg).float() - y.float()
        got = plan(y.clone(), x[g], a, b, seg).float() - y.float()
        worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
    return worst


def step_us(plan, weights: list[dict], x: dict, seg, replays: int) -> float:
    """Microseconds of one replay of a graph of `plan` over every group of every layer."""
    ys = {g: torch.zeros(x[g].shape[0], GROUPS[g][0], device="cuda", dtype=torch.bfloat16) for g in GROUPS}

    def step():
        for layer in weights:
            for g, (a, b) in layer.items():
                plan(ys[g], x[g], a, b, seg)

    graph, _ = capture(step)
    return replay_us(graph, replays)


def one_row(rows: int, weights: list[dict], plans: dict, replays: int) -> dict:
    slots = torch.arange(rows, device="cuda") % SLOTS
    seg = lora.lora_segments(slots, SLOTS)
    x = {g: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for g, (_, k, _) in GROUPS.items()}
    row = {"rows": rows, "row blocks": lora.max_row_blocks(rows, SLOTS),
           "served": "fused" if rows <= lora.FUSED_MAX_ROWS else "shrink+expand"}
    errors = []
    for name, plan in plans.items():
        errors.append(relative_error(plan, weights[0], x, seg))
        row[name] = step_us(plan, weights, x, seg, replays)
    row["max rel err"] = max(errors)
    return row


def format_table(rows: list[dict], layers: int) -> str:
    columns = list(rows[0])
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__}, us per step of {layers} layers "
             f"(4 groups each), rank {RANK}, {SLOTS} slots, bf16", "",
             "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) and c != "max rel err"
                                        else f"{r[c]:.1e}" if isinstance(r[c], float) else str(r[c])
                                        for c in columns) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16,32,64,256", help="rows of the step (decodes)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--fused", default="128,32,256,128:256,128:-:128,128:-:-:3,128:-:-:-:8",
                        help="the fused kernel's launch plans to time, PROGRAMS[:BLOCK_K[:BLOCK_N[:STAGES[:WARPS]]]], "
                             "- for the default")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.warning("lora_bench times CUDA graphs: no CUDA GPU here, nothing timed")
        return 0
    torch.manual_seed(0)
    plans = {"shrink+expand": shrink_then_expand}
    for spec in args.fused.split(","):
        plans[f"fused {spec}"] = fused_plan(spec)
    plans["lora_add_"] = lora.lora_add_triton
    weights = make_layers(args.layers)
    rows = []
    for n in map(int, args.rows.split(",")):
        rows.append(one_row(n, weights, plans, args.replays))
        logger.info("rows %d: %s us, error %.1e", n, ", ".join(f"{k} {v:.1f}" for k, v in rows[-1].items()
                                                           if k in plans), rows[-1]["max rel err"])
    print(format_table(rows, args.layers))
    worst = max(r["max rel err"] for r in rows)
    if worst > 3e-2:
        logger.error("a plan differs from the reference by %.1e of the added term", worst)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
