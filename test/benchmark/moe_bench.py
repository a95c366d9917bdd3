"""The fused MoE kernel against its floors: memory at decode batches, bf16 peak at prefill.

    python test/benchmark/moe_bench.py [--shape qwen3-30b-a3b] [--tp 1] [--decode 1,64,256]
        [--prefill 4096] [--fp8] [--plan BM,BN,BK,WARPS,STAGES ...] [--tune] [--out-md moe.md]

One MoE layer of the shape (router choices drawn at random: softmax of normal logits, top k, as
a balanced router spreads tokens), bf16 weights (--fp8: e4m3 experts with row scales, as
`--quantization fp8` serves them, against the same floors at one byte a weight). For each size,
first the check: the Triton path (kernels/fused_moe.py's fused_moe_triton) against the torch
reference on the same inputs, relative error of the whole output (the run stops above 2e-2, 6e-2
with fp8 experts). Then, each in a CUDA graph of 20 calls (static_benchmark.graph_call_us, as a
decode step runs):
- fused: the whole Triton path (alignment by expert, gate/up kernel, down kernel, sum over k);
- align: the alignment alone (one launch; the rest of `fused` is the two GEMM kernels and the sum);
- cuBLAS: a dense bf16 GEMM of the same FLOPs ([pairs, H] x [H, 3I]), what tensor cores give in practice.
Floors: memory = bytes of the experts the step touches (gate/up and down of every expert chosen
at least once) over the device's copy bandwidth (read + write, as static_benchmark measures);
compute = FLOPs (6 H I a pair) over --peak-tflops (dense bf16: 989 on an H100 or H200 SXM).
Decode rows are judged by "% mem floor" (the issue's goal: 70% at batch 64-256), prefill rows by
"% bf16 peak" (goal: 50%). --plan times other block plans beside moe_plan's choice; --tune
sweeps a grid of plans at each size and prints the five fastest. CUDA only.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules
from static_benchmark import copy_bandwidth, graph_call_us  # noqa: E402

from lightllm_kernels.fused_moe import (MoEPlan, align_by_expert_triton, fused_moe_ref, fused_moe_triton,  # noqa: E402
                                        moe_plan, quantize_experts_fp8, route_topk)

logger = logging.getLogger("moe_bench")

SHAPES = {  # name -> (hidden, experts' intermediate, experts, top k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
# bf16: the paths round at the same points, in another summation order. fp8: also a pair's row
# of the SiLU-and-mul output is quantised from each path's own bf16 rounding, and a row whose
# largest entry moves by one bf16 step lands on another e4m3 grid (tests/test_fused_moe.py).
MAX_REL_ERR = {False: 2e-2, True: 6e-2}
COLUMNS = ["case", "tokens", "plan", "experts hit", "expert MB", "mem floor us", "fused us", "% mem floor",
           "align us", "TFLOP/s", "% bf16 peak", "cuBLAS us", "rel err"]


class Layer:
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, device: str = "cuda", fp8: bool = False):
        w_gate_up = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden ** -0.5).bfloat16()
        w_down = (torch.randn(experts, hidden, inter, device=device) * inter ** -0.5).bfloat16()
        if fp8:
            w_gate_up, gate_up_scale = quantize_experts_fp8(w_gate_up)
            w_down, down_scale = quantize_experts_fp8(w_down)
            self.weights = (w_gate_up, w_down, gate_up_scale, down_scale)
        else:
            self.weights = (w_gate_up, w_down)
        self.w_down, self.max_rel_err = w_down, MAX_REL_ERR[fp8]
        self.hidden, self.inter, self.experts, self.top_k, self.device = hidden, inter, experts, top_k, device

    def inputs(self, tokens: int):
        x = torch.randn(tokens, self.hidden, device=self.device).bfloat16()
        weights, ids = route_topk(torch.randn(tokens, self.experts, device=self.device), self.top_k, renormalize=True)
        return x, weights, ids

    def expert_bytes(self, ids: torch.Tensor) -> tuple[int, int]:
        """(experts chosen at least once, their bytes)"""
        hit = torch.unique(ids).numel()
        return hit, hit * 3 * self.hidden * self.inter * self.w_down.element_size()


def relative_error(layer: Layer, x, weights, ids, plan) -> float:
    w_gate_up, w_down, *scales = layer.weights
    ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids, *scales).float()
    got = fused_moe_triton(x, w_gate_up, w_down, weights, ids, *scales, plan=plan).float()
    return ((got - ref).norm() / ref.norm()).item()


def one_row(layer: Layer, case: str, tokens: int, plan: MoEPlan | None, bandwidth: float, peak: float) -> dict:
    x, weights, ids = layer.inputs(tokens)
    chosen = plan or moe_plan(tokens * layer.top_k, layer.experts)
    err = relative_error(layer, x, weights, ids, chosen)
    if not err <= layer.max_rel_err:
        raise AssertionError(f"{case} tokens {tokens} plan {chosen}: relative error {err:.3g} against the reference")
    hit, nbytes = layer.expert_bytes(ids)
    pairs = tokens * layer.top_k
    flops = 6 * pairs * layer.hidden * layer.inter
    w_gate_up, w_down, *scales = layer.weights
    fused = graph_call_us(lambda: fused_moe_triton(x, w_gate_up, w_down, weights, ids, *scales, plan=chosen))
    align = graph_call_us(lambda: align_by_expert_triton(ids, layer.experts, chosen.block_m))
    a = torch.randn(pairs, layer.hidden, device=layer.device).bfloat16()
    b = torch.randn(layer.hidden, 3 * layer.inter, device=layer.device).bfloat16()
    floor = nbytes / bandwidth * 1e6
    return {"case": case, "tokens": tokens, "plan": ",".join(map(str, chosen)), "experts hit": hit,
            "expert MB": nbytes / 1e6, "mem floor us": floor, "fused us": fused, "% mem floor": 100 * floor / fused,
            "align us": align, "TFLOP/s": flops / fused / 1e6, "% bf16 peak": 100 * flops / fused / 1e6 / peak,
            "cuBLAS us": graph_call_us(lambda: a @ b), "rel err": err}


# 48 plans a size, each compiled, checked and timed: --tune with only the sizes to tune
TUNE_GRID = dict(block_m=(16, 32, 64, 128), block_n=(32, 64, 128), block_k=(64, 128), warps_stages=((4, 3), (8, 3)))


def tune(layer: Layer, tokens: int) -> str:
    """The five fastest plans of TUNE_GRID at this size (each checked against the reference)."""
    x, weights, ids = layer.inputs(tokens)
    w_gate_up, w_down, *scales = layer.weights
    results = []
    for bm, bn, bk, (warps, stages) in itertools.product(*TUNE_GRID.values()):
        plan = MoEPlan(bm, bn, bk, warps, stages)
        try:
            assert relative_error(layer, x, weights, ids, plan) <= layer.max_rel_err
            run = lambda: fused_moe_triton(x, w_gate_up, w_down, weights, ids, *scales, plan=plan)  # noqa: E731
            results.append((graph_call_us(run), plan))
        except Exception as e:  # a plan Triton cannot compile (shared memory) or that fails the check
            logger.info("tokens %d %s: %s", tokens, plan, str(e).splitlines()[0][:120] if str(e) else type(e).__name__)
    results.sort(key=lambda r: r[0])
    default = moe_plan(tokens * layer.top_k, layer.experts)
    return f"tokens {tokens} (default {default}): " + "; ".join(f"{t:.1f} us {tuple(p)}" for t, p in results[:5])


def format_table(rows: list[dict]) -> str:
    def cell(v):
        return f"{v:.4f}" if isinstance(v, float) and v < 1 else f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows])


def parse_plan(text: str) -> MoEPlan:
    return MoEPlan(*map(int, text.split(",")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, default=1, help="the experts' intermediate size is split by this")
    parser.add_argument("--decode", default="1,64,256", help="decode batch sizes (tokens)")
    parser.add_argument("--prefill", default="4096", help="prefill sizes (tokens)")
    parser.add_argument("--plan", action="append", type=parse_plan, default=[],
                        help="also time this plan: BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages (repeatable)")
    parser.add_argument("--fp8", action="store_true", help="fp8 experts (--quantization fp8)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--out-md", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.error("moe_bench needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    hidden, inter, experts, top_k = SHAPES[args.shape]
    layer = Layer(hidden, inter // args.tp, experts, top_k, fp8=args.fp8)
    bandwidth = copy_bandwidth(torch.device("cuda"), 1 << 30)
    sizes = [("decode", int(t)) for t in args.decode.split(",") if t] + [("prefill", int(t))
                                                                        for t in args.prefill.split(",") if t]
    rows, tuned = [], []
    for (case, tokens), plan in itertools.product(sizes, [None, *args.plan]):
        rows.append(one_row(layer, case, tokens, plan, bandwidth, args.peak_tflops))
        logger.info("%s %d: %.1f us, %.0f%% of the memory floor", case, tokens, rows[-1]["fused us"],
                    rows[-1]["% mem floor"])
    if args.tune:
        tuned = [tune(layer, tokens) for _, tokens in sizes]
    dtype = "fp8" if args.fp8 else "bf16"
    text = "\n".join([f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shape} tp {args.tp} (hidden "
                      f"{hidden}, {experts} {dtype} experts of {inter // args.tp}, top {top_k}); copy bandwidth "
                      f"{bandwidth / 1e9:.0f} GB/s; times in us (CUDA graph of 20 calls)", format_table(rows), *tuned])
    print(text)
    if args.out_md:
        Path(args.out_md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
