"""The fused MoE kernel against its floors: memory at decode batches, bf16 peak at prefill.

    python test/benchmark/kernels/moe_bench.py [--shape qwen3-30b-a3b] [--tp 1] [--decode 1,64,256]
        [--prefill 4096] [--fp8 | --mxfp4] [--plan BM,BN,BK,WARPS,STAGES[,GROUP_M] ...] [--groups 0,1,8]
        [--tune [--tune-rows 64,128|auto] [--tune-cols 64,128,256] [--tune-ks 64,128] [--tune-groups 0,8]
        [--tune-tma 0,1] [--tune-warps-stages 4x2,8x3] [--tune-kernels gate/up,down]] [--out-md moe.md]

One MoE layer of the shape (router choices drawn at random: softmax of normal logits, top k, as
a balanced router spreads tokens), bf16 weights (--fp8: e4m3 experts with row scales, as
`--quantization fp8` serves them, against the same floors at one byte a weight; --mxfp4: packed
e2m1 experts with a scale per 32 values, as gpt-oss's checkpoints hold them, 17/32 of a byte a weight).
For each size,
first the check: the Triton path (kernels/fused_moe.py's fused_moe_triton) against the torch
reference on the same inputs, relative error of the whole output (the run stops above 2e-2, 6e-2
with fp8 experts). Then, each in a CUDA graph of 20 calls (static_benchmark.graph_call_us, as a
decode step runs):
- fused: the whole Triton path (alignment by expert, gate/up kernel, down kernel, sum over k);
- align: the alignment alone (one launch; the rest of `fused` is the two GEMM kernels and the sum);
- grouped_mm: the same layer through torch._grouped_mm (CUTLASS grouped GEMMs over the experts'
  offsets, bf16 only), a library's answer to the same ragged groups;
- cuBLAS: a dense bf16 GEMM of the same FLOPs ([pairs, H] x [H, 3I]), what tensor cores give in practice.
Floors: memory = bytes of the experts the step touches (gate/up and down of every expert chosen
at least once) over the device's copy bandwidth (read + write, as static_benchmark measures);
compute = FLOPs (6 H I a pair) over --peak-tflops (dense bf16: 989 on an H100 or H200 SXM).
Decode rows are judged by "% mem floor" (the issue's goal: 70% at batch 64-256), prefill rows by
"% bf16 peak" (goal: 50%). --plan times other block plans beside moe_plans' choice, --groups its
choice in other program orders (MoEPlan.group_m: how many row blocks run across all their column
tiles before the next; 0 = each column tile over every row block); --tune
times each kernel alone over a grid of plans at each size and row block, prints the five fastest
of each and the best pair's total. CUDA only.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.engine.static_benchmark import copy_bandwidth, graph_call_us  # noqa: E402

from lightllm.kernels.fused_moe import (MoEPlan, align_by_expert_triton, fused_moe_ref, fused_moe_triton,  # noqa: E402
                                        moe_down_triton, moe_gate_up_triton, moe_plans, quantize_experts_fp8,
                                        route_topk)
from lightllm.kernels.fp8_linear import quantize_fp8_rows_triton  # noqa: E402

logger = logging.getLogger("moe_bench")

SHAPES = {  # name -> (hidden, experts' intermediate, experts, top k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "gpt-oss-20b": (2880, 2880, 32, 4),
    "gpt-oss-120b": (2880, 2880, 128, 4),
}
# bf16: the paths round at the same points, in another summation order. fp8: also a pair's row
# of the SiLU-and-mul output is quantised from each path's own bf16 rounding, and a row whose
# largest entry moves by one bf16 step lands on another e4m3 grid (tests/test_fused_moe.py).
MAX_REL_ERR = {False: 2e-2, True: 6e-2}
COLUMNS = ["case", "tokens", "plan", "experts hit", "expert MB", "mem floor us", "fused us", "% mem floor",
           "align us", "TFLOP/s", "% bf16 peak", "grouped_mm us", "cuBLAS us", "rel err"]


class Layer:
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, device: str = "cuda", fp8: bool = False,
                 mxfp4: bool = False):
        w_gate_up = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden ** -0.5).bfloat16()
        w_down = (torch.randn(experts, hidden, inter, device=device) * inter ** -0.5).bfloat16()
        self.weight_bytes = 1 if fp8 else 17 / 32 if mxfp4 else 2  # MXFP4: half a byte a value and a byte per 32
        if mxfp4:  # every packed pair of values; scales 2^-8..2^-5 (weights of about 2^-6 .. 2^-3)
            self.weights = tuple(torch.randint(low, high, shape, dtype=torch.uint8, device=device) for low, high, shape in
                                 ((0, 256, (experts, 2 * inter, hidden // 2)), (0, 256, (experts, hidden, inter // 2)),
                                  (119, 123, (experts, 2 * inter, hidden // 32)),
                                  (119, 123, (experts, hidden, inter // 32))))
        elif fp8:
            w_gate_up, gate_up_scale = quantize_experts_fp8(w_gate_up)
            w_down, down_scale = quantize_experts_fp8(w_down)
            self.weights = (w_gate_up, w_down, gate_up_scale, down_scale)
        else:
            self.weights = (w_gate_up, w_down)
        self.max_rel_err, self.fp8, self.mxfp4 = MAX_REL_ERR[fp8], fp8, mxfp4
        self.hidden, self.inter, self.experts, self.top_k, self.device = hidden, inter, experts, top_k, device

    def inputs(self, tokens: int):
        x = torch.randn(tokens, self.hidden, device=self.device).bfloat16()
        weights, ids = route_topk(torch.randn(tokens, self.experts, device=self.device), self.top_k, renormalize=True)
        return x, weights, ids

    def expert_bytes(self, ids: torch.Tensor) -> tuple[int, int]:
        """(experts chosen at least once, their bytes)"""
        hit = torch.unique(ids).numel()
        return hit, int(hit * 3 * self.hidden * self.inter * self.weight_bytes)


def relative_error(layer: Layer, x, weights, ids, plans) -> float:
    w_gate_up, w_down, *scales = layer.weights
    ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids, *scales).float()
    got = fused_moe_triton(x, w_gate_up, w_down, weights, ids, *scales, plan=plans[0], down_plan=plans[1]).float()
    return ((got - ref).norm() / ref.norm()).item()


def grouped_mm_moe(x, w_gate_up, w_down, weights, ids):
    """The same layer through torch._grouped_mm (PyTorch's CUTLASS grouped GEMM, bf16 on sm90):
    the pairs' rows of x copied in expert order, both projections as grouped GEMMs over the
    experts' offsets, the weighted rows added back by token. A library yardstick for the Triton
    kernels on the same ragged groups, not a path the server takes."""
    top_k, inter = ids.shape[1], w_down.shape[2]
    flat = ids.flatten()
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(1, w_gate_up.shape[0] + 1, device=x.device, dtype=flat.dtype)
    offsets = torch.searchsorted(sorted_ids, experts).to(torch.int32)  # each expert's end (no host sync)
    rows = x[order // top_k]
    gate_up = torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offsets)
    hidden = (torch.nn.functional.silu(gate_up[:, 0::2].float()) * gate_up[:, 1::2].float()).to(x.dtype)
    y = torch._grouped_mm(hidden, w_down.transpose(1, 2), offs=offsets).float() * weights.flatten()[order, None]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, order // top_k, y).to(x.dtype)


def one_row(layer: Layer, case: str, tokens: int, plans: tuple[MoEPlan, MoEPlan] | None, bandwidth: float,
            peak: float) -> dict:
    x, weights, ids = layer.inputs(tokens)
    chosen = plans or moe_plans(tokens * layer.top_k, layer.experts, layer.fp8, layer.mxfp4)
    err = relative_error(layer, x, weights, ids, chosen)
    if not err <= layer.max_rel_err:
        raise AssertionError(f"{case} tokens {tokens} plans {chosen}: relative error {err:.3g} against the reference")
    hit, nbytes = layer.expert_bytes(ids)
    pairs = tokens * layer.top_k
    flops = 6 * pairs * layer.hidden * layer.inter
    w_gate_up, w_down, *scales = layer.weights
    fused = graph_call_us(lambda: fused_moe_triton(x, w_gate_up, w_down, weights, ids, *scales, plan=chosen[0],
                                                   down_plan=chosen[1]))
    align = graph_call_us(lambda: align_by_expert_triton(ids, layer.experts, chosen[0].block_m))
    grouped = float("nan")
    if not scales and hasattr(torch, "_grouped_mm"):
        grouped_err = ((grouped_mm_moe(x, w_gate_up, w_down, weights, ids).float()
                        - fused_moe_ref(x, w_gate_up, w_down, weights, ids).float()).norm()
                       / fused_moe_ref(x, w_gate_up, w_down, weights, ids).float().norm()).item()
        if grouped_err <= layer.max_rel_err:
            grouped = graph_call_us(lambda: grouped_mm_moe(x, w_gate_up, w_down, weights, ids))
        else:
            logger.warning("torch._grouped_mm: relative error %.3g, not timed", grouped_err)
    a = torch.randn(pairs, layer.hidden, device=layer.device).bfloat16()
    b = torch.randn(layer.hidden, 3 * layer.inter, device=layer.device).bfloat16()
    floor = nbytes / bandwidth * 1e6
    plan_text = ",".join(map(str, chosen[0])) + ("" if chosen[1] == chosen[0] else " / " + ",".join(map(str, chosen[1])))
    return {"case": case, "tokens": tokens, "plan": plan_text, "experts hit": hit,
            "expert MB": nbytes / 1e6, "mem floor us": floor, "fused us": fused, "% mem floor": 100 * floor / fused,
            "align us": align, "TFLOP/s": flops / fused / 1e6, "% bf16 peak": 100 * flops / fused / 1e6 / peak,
            "grouped_mm us": grouped, "cuBLAS us": graph_call_us(lambda: a @ b), "rel err": err}


# Each kernel is tuned alone over this grid, for each row block (which the alignment fixes and
# the two kernels share): 2 x 3 x 2 x 7 = 84 plans a kernel and size, each compiled, checked
# against the default plan's output and timed; times as many again for each program order
# (--tune-groups: MoEPlan.group_m) and fewer with --tune-rows. Two stages leave room for two
# programs of the large tiles on an SM (one's epilogue beside the other's loop).
TUNE_GRID = dict(block_m=(64, 128), block_n=(64, 128, 256), block_k=(64, 128),
                 warps_stages=((4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4), (8, 5)), group_m=(0,), tma=(False,))


def _close(got: torch.Tensor, want: torch.Tensor, limit: float) -> bool:
    return bool(((got.float() - want.float()).norm() / want.float().norm()).item() <= limit)


def tune(layer: Layer, tokens: int, grid: dict = TUNE_GRID,
         kernels: tuple[str, ...] = ("gate/up", "down")) -> list[str]:
    """Per row block: each kernel's fastest plans of TUNE_GRID alone, and the best pair's total
    (alignment + both kernels + the sum over k, one graph) checked against the reference."""
    x, weights, ids = layer.inputs(tokens)
    w_gate_up, w_down, *scales = layer.weights
    fp8 = layer.fp8
    w_scales = scales or (None, None)  # fp8's row scales or MXFP4's
    default = moe_plans(tokens * layer.top_k, layer.experts, layer.fp8, layer.mxfp4)
    lines, best = [f"tokens {tokens} (default {tuple(default[0])} / {tuple(default[1])})"], []
    for bm in grid["block_m"]:
        sorted_pairs, block_experts = align_by_expert_triton(ids, layer.experts, bm)
        a, a_scale = quantize_fp8_rows_triton(x) if fp8 else (x, None)
        base = MoEPlan(bm, 64, 64, 4, 3)
        gate_up_want = moe_gate_up_triton(a, a_scale, w_gate_up, w_scales[0], sorted_pairs,
                                          block_experts, layer.top_k, x.dtype, base)
        h, h_scale = quantize_fp8_rows_triton(gate_up_want) if fp8 else (gate_up_want, None)
        pair_weights = weights.float().contiguous().view(-1)
        down_want = moe_down_triton(h, h_scale, w_down, w_scales[1], sorted_pairs, block_experts,
                                    pair_weights, x.dtype, base)
        runs = {
            "gate/up": (lambda plan: moe_gate_up_triton(a, a_scale, w_gate_up, w_scales[0],
                                                        sorted_pairs, block_experts, layer.top_k, x.dtype, plan),
                        gate_up_want),
            "down": (lambda plan: moe_down_triton(h, h_scale, w_down, w_scales[1], sorted_pairs,
                                                  block_experts, pair_weights, x.dtype, plan), down_want)}
        fastest = {}
        for kernel, (run, want) in runs.items():
            if kernel not in kernels:  # untuned: moe_plans' choice, on this row block
                fastest[kernel] = default[kernel == "down"]._replace(block_m=bm)
                continue
            results = []
            plans = dict.fromkeys(  # the down kernel's tiles are per-thread loads whatever the grid's tma
                MoEPlan(bm, bn, bk, warps, stages, group_m, tma and kernel == "gate/up")
                for bn, bk, (warps, stages), group_m, tma in itertools.product(*list(grid.values())[1:]))
            for plan in plans:
                try:
                    assert _close(run(plan), want, 1e-2), "differs from the default plan's output"
                    results.append((graph_call_us(lambda plan=plan: run(plan)), plan))
                except Exception as e:  # a plan Triton cannot compile (shared memory) or that fails the check
                    logger.info("%s tokens %d %s: %s", kernel, tokens, plan,
                                str(e).splitlines()[0][:120] if str(e) else type(e).__name__)
            if not results:
                raise RuntimeError(f"{kernel} tokens {tokens} rows {bm}: no plan of the grid compiled and passed")
            results.sort(key=lambda r: r[0])
            fastest[kernel] = results[0][1]
            lines.append(f"  {kernel}, rows {bm}: " + "; ".join(f"{t:.1f} us {tuple(p)}" for t, p in results[:5]))
        pair = (fastest["gate/up"], fastest["down"])
        err = relative_error(layer, x, weights, ids, pair)
        total = graph_call_us(lambda: fused_moe_triton(x, w_gate_up, w_down, weights, ids, *scales, plan=pair[0],
                                                       down_plan=pair[1]))
        best.append((total, pair))
        lines.append(f"  rows {bm}, both kernels' best: {total:.1f} us (rel err {err:.4f})")
    total, pair = min(best, key=lambda b: b[0])
    lines.append(f"  best: {total:.1f} us, gate/up {tuple(pair[0])}, down {tuple(pair[1])}")
    return lines


def format_table(rows: list[dict]) -> str:
    def cell(v):
        return f"{v:.4f}" if isinstance(v, float) and v < 1 else f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows])


def parse_plan(text: str) -> tuple[MoEPlan, MoEPlan]:
    gate_up, _, down = text.partition("/")
    plan = MoEPlan(*map(int, gate_up.split(",")))
    return plan, MoEPlan(*map(int, down.split(","))) if down else plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, default=1, help="the experts' intermediate size is split by this")
    parser.add_argument("--decode", default="1,64,256", help="decode batch sizes (tokens)")
    parser.add_argument("--prefill", default="4096", help="prefill sizes (tokens)")
    parser.add_argument("--plan", action="append", type=parse_plan, default=[],
                        help="also time this plan: BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages[,group_m[,tma]][/the "
                        "down kernel's, same BLOCK_M] (repeatable)")
    parser.add_argument("--groups", default=None,
                        help="time the chosen plans in each of these program orders (MoEPlan.group_m, e.g. 0,1,8) "
                        "instead of their own")
    parser.add_argument("--fp8", action="store_true", help="fp8 experts (--quantization fp8)")
    parser.add_argument("--mxfp4", action="store_true", help="MXFP4 experts (gpt-oss's checkpoints)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--tune-groups", default="0", help="--tune's program orders (MoEPlan.group_m), e.g. 0,1,8")
    parser.add_argument("--tune-rows", default="64,128", help="--tune's row blocks; auto: each size's moe_plans row block")
    parser.add_argument("--tune-cols", default="64,128,256", help="--tune's column blocks")
    parser.add_argument("--tune-ks", default="64,128", help="--tune's K blocks")
    parser.add_argument("--tune-warps-stages", default=None,
                        help="--tune's (warps, stages) pairs, e.g. 4x2,4x3,8x3 (default: TUNE_GRID's seven)")
    parser.add_argument("--tune-tma", default="0", help="--tune's gate/up weight tiles: 0 loads, 1 TMA, 0,1 both")
    parser.add_argument("--tune-kernels", default="gate/up,down", help="--tune's kernels, of gate/up and down")
    parser.add_argument("--out-md", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.error("moe_bench needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    hidden, inter, experts, top_k = SHAPES[args.shape]
    layer = Layer(hidden, inter // args.tp, experts, top_k, fp8=args.fp8, mxfp4=args.mxfp4)
    bandwidth = copy_bandwidth(torch.device("cuda"), 1 << 30)
    sizes = [("decode", int(t)) for t in args.decode.split(",") if t] + [("prefill", int(t))
                                                                        for t in args.prefill.split(",") if t]
    rows, tuned = [], []
    for (case, tokens), plan in itertools.product(sizes, [None, *args.plan]):
        if plan is None and args.groups is not None:  # moe_plans' choice, in each order
            chosen = moe_plans(tokens * top_k, experts, args.fp8, args.mxfp4)
            for group_m in map(int, args.groups.split(",")):
                rows.append(one_row(layer, case, tokens, tuple(p._replace(group_m=group_m) for p in chosen),
                                    bandwidth, args.peak_tflops))
            continue
        rows.append(one_row(layer, case, tokens, plan, bandwidth, args.peak_tflops))
        logger.info("%s %d: %.1f us, %.0f%% of the memory floor", case, tokens, rows[-1]["fused us"],
                    rows[-1]["% mem floor"])
    if args.tune:
        grid = dict(TUNE_GRID, block_n=tuple(int(v) for v in args.tune_cols.split(",")),
                    block_k=tuple(int(v) for v in args.tune_ks.split(",")),
                    group_m=tuple(int(v) for v in args.tune_groups.split(",")),
                    tma=tuple(bool(int(v)) for v in args.tune_tma.split(",")))
        if args.tune_warps_stages:
            grid["warps_stages"] = tuple(tuple(map(int, ws.split("x"))) for ws in args.tune_warps_stages.split(","))
        kernels = tuple(args.tune_kernels.split(","))
        for _, tokens in sizes:
            rows_of = (moe_plans(tokens * top_k, experts, args.fp8, args.mxfp4)[0].block_m,) \
                if args.tune_rows == "auto" else tuple(int(v) for v in args.tune_rows.split(","))
            lines = tune(layer, tokens, dict(grid, block_m=rows_of), kernels)
            print("\n".join(lines), flush=True)  # as each size ends: a long tune cut short keeps what it found
            tuned += lines
    dtype = "fp8" if args.fp8 else "MXFP4" if args.mxfp4 else "bf16"
    text = "\n".join([f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shape} tp {args.tp} (hidden "
                      f"{hidden}, {experts} {dtype} experts of {inter // args.tp}, top {top_k}); copy bandwidth "
                      f"{bandwidth / 1e9:.0f} GB/s; times in us (CUDA graph of 20 calls)", format_table(rows)])
    print(text)  # the tune's lines were printed as each size ended
    if args.out_md:
        Path(args.out_md).write_text("\n".join([text, *tuned]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
