"""A step's LoRA work at a model's shapes, against its memory floor and beside the base GEMMs.

    python test/benchmark/kernels/lora_bench.py [--shape bench-8b] [--tokens 1,16,256,2048]
        [--slots 16] [--rank 16] [--base-share 0.0588] [--variant NAME=VALUE,... ...] [--out-md lora.md]

For each step size: `tokens` rows spread round-robin over `slots` adapters, a `base-share` of them
on no adapter (the served burst's mix: request i on adapter i mod 17, the 17th share on the base
model), through every layer's four projection groups (q/k/v, o, gate/up, down) as LoraSlots runs
them (kernels/lora.py: one shrink and one expand a group), in one CUDA graph of the whole step's
LoRA work (static_benchmark.graph_call_us). Beside it:
- floor: the bytes the step must move (each used slot's A and B once, x read, y read and written)
  over the measured copy bandwidth;
- base: the same projections' base GEMMs (cuBLAS, bf16) in the same kind of graph, so that
  `LoRA / base` is the share the adapters add to those GEMMs;
- in turn, shrink beside, share beside: the base GEMMs with the LoRA work, each group's shrink and
  expand after its GEMM; or its shrink beside the GEMM on a second stream (models/lora.py's
  `shrink_beside`, as the model runs steps of up to BESIDE_ROWS rows and of LARGE_ROWS to
  LARGE_BESIDE_ROWS) and its expand after both; or
  its shrink and expand both beside the GEMM, into an fp32 share (`share_beside`, as the model runs
  steps of up to SHARE_ROWS rows) that the kernel after the GEMM adds in the model (that add is in
  that kernel's own launch and is not timed here). Each is timed at every size; "added" is what it
  adds to the base GEMMs' time.
`--variant NAME=VALUE[,...]` rebinds constants of kernels/lora.py (BLOCK_ROWS, BLOCK_K, BLOCK_N,
SPLIT_K, SHRINK_PROGRAMS, LARGE_ROWS, LARGE_BLOCK_ROWS, LARGE_BLOCK_N) for one more pass, to time
another launch plan of the same kernels beside the shipped one (repeat it for several). Each step
is first checked against the torch reference. CUDA only (the tiny shape is for a CPU check of the
script under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.engine.static_benchmark import copy_bandwidth, graph_call_us  # noqa: E402

from lightllm.kernels import lora as lora_kernels  # noqa: E402
from lightllm.models.lora import share_beside, shrink_beside  # noqa: E402

logger = logging.getLogger("lora_bench")

# name -> (layers, hidden, q heads x head dim, kv heads x head dim, intermediate)
SHAPES = {"bench-8b": (32, 4096, 4096, 1024, 14336), "qwen3-8b": (36, 4096, 4096, 1024, 12288),
          "tiny": (2, 64, 64, 32, 128)}
TUNABLE = ("BLOCK_ROWS", "BLOCK_K", "BLOCK_N", "SPLIT_K", "SHRINK_PROGRAMS", "LARGE_ROWS", "LARGE_BLOCK_ROWS",
           "LARGE_BLOCK_N")


def groups(shape: str) -> list[tuple[int, int, int]]:
    """(in, out, parts) of a layer's four projection groups."""
    _, hidden, q, kv, inter = SHAPES[shape]
    return [(hidden, q + 2 * kv, 3), (q, hidden, 1), (hidden, 2 * inter, 2), (inter, hidden, 1)]


def row_slots(tokens: int, slots: int, base_share: float, device) -> torch.Tensor:
    """Each row's slot: round-robin over the slots, every round(1 / base_share)-th row on none (-1)."""
    every = round(1 / base_share) if base_share > 0 else 0
    ids = [-1 if every and i % every == every - 1 else i % slots for i in range(tokens)]
    return torch.tensor(ids, dtype=torch.int64, device=device)


def parse_set(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in TUNABLE:
            raise argparse.ArgumentTypeError(f"{name}: not one of {', '.join(TUNABLE)}")
        out[name] = int(value)
    return out


class Step:
    """One step's tensors: per layer and group x, y, the slots' a and b (bf16), the base weight."""

    def __init__(self, shape: str, tokens: int, slots: int, rank: int, base_share: float, device):
        layers = SHAPES[shape][0]
        self.slots = row_slots(tokens, slots, base_share, device)
        self.num_slots = slots
        self.work = []
        for _ in range(layers):
            for k, n, parts in groups(shape):
                r = parts * rank
                self.work.append((torch.randn(tokens, k, device=device, dtype=torch.bfloat16),
                                  torch.zeros(tokens, n, device=device, dtype=torch.bfloat16),
                                  torch.randn(slots, r, k, device=device, dtype=torch.bfloat16) * k ** -0.5,
                                  torch.randn(slots, n, r, device=device, dtype=torch.bfloat16) * r ** -0.5,
                                  torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5))
        used = len(set(self.slots.tolist()) - {-1})
        rows = int((self.slots >= 0).sum())
        self.floor_bytes = sum(2 * (used * (a.shape[1] * a.shape[2] + b.shape[1] * b.shape[2])
                                    + rows * (x.shape[1] + 2 * y.shape[1])) for x, y, a, b, _ in self.work)

    def lora(self) -> None:
        seg = lora_kernels.lora_segments(self.slots, self.num_slots)
        for x, y, a, b, _ in self.work:
            lora_kernels.lora_expand_triton(y, lora_kernels.lora_shrink_triton(x, a, seg), b, seg)

    def base(self) -> None:
        for x, y, _, _, w in self.work:
            torch.matmul(x, w.T, out=y)

    def in_turn(self) -> None:
        seg = lora_kernels.lora_segments(self.slots, self.num_slots)
        for x, y, a, b, w in self.work:
            torch.matmul(x, w.T, out=y)
            lora_kernels.lora_expand_triton(y, lora_kernels.lora_shrink_triton(x, a, seg), b, seg)

    def beside(self, stream: torch.cuda.Stream, share: bool) -> None:
        seg = lora_kernels.lora_segments(self.slots, self.num_slots)
        for x, y, a, b, w in self.work:
            if share:  # for the kernel after the GEMM to add
                share_beside(x, a, b, seg, stream)
                torch.matmul(x, w.T, out=y)
                torch.cuda.current_stream().wait_stream(stream)
                continue
            s = shrink_beside(x, a, seg, stream)
            torch.matmul(x, w.T, out=y)
            torch.cuda.current_stream().wait_stream(stream)
            lora_kernels.lora_expand_triton(y, s, b, seg)

    def check(self, stream: torch.cuda.Stream) -> float:
        """Relative distance of the kernels' y from the torch reference's, over the first group, with
        the shrink in turn, beside on `stream`, and the share beside (as `beside` runs them): the largest."""
        x, y, a, b, _ = self.work[0]
        seg = lora_kernels.lora_segments(self.slots, self.num_slots)
        got = lora_kernels.lora_expand_triton(y.zero_(), lora_kernels.lora_shrink_triton(x, a, seg), b, seg).float()
        s = shrink_beside(x, a, seg, stream)
        torch.cuda.current_stream().wait_stream(stream)
        beside = lora_kernels.lora_expand_triton(y.zero_(), s, b, seg).float()
        share = share_beside(x, a, b, seg, stream)
        torch.cuda.current_stream().wait_stream(stream)
        s = lora_kernels.lora_shrink_ref(x, a, seg)
        want = lora_kernels.lora_expand_ref(torch.zeros_like(y), s, b, seg).float()
        return max(float((g - want).norm() / want.norm().clamp_min(1e-9)) for g in (got, beside, share))


def run(args, variant: dict[str, int], bandwidth: float) -> list[str]:
    saved = {name: getattr(lora_kernels, name) for name in variant}
    stream = torch.cuda.Stream()
    for name, value in variant.items():
        setattr(lora_kernels, name, value)
    try:
        rows = []
        for tokens in args.tokens:
            step = Step(args.shape, tokens, args.slots, args.rank, args.base_share, "cuda")
            err = step.check(stream)
            if err > 2e-2:
                raise RuntimeError(f"{variant or 'shipped'} at {tokens} tokens: off the reference by {err:.4f}")
            lora_us, base_us = graph_call_us(step.lora, calls=2), graph_call_us(step.base, calls=2)
            turn_us = graph_call_us(step.in_turn, calls=2)
            beside_us = graph_call_us(lambda: step.beside(stream, False), calls=2)
            share_us = graph_call_us(lambda: step.beside(stream, True), calls=2)
            floor_us = step.floor_bytes / bandwidth * 1e6
            name = ",".join(f"{k}={v}" for k, v in variant.items()) or "shipped"
            rows.append(f"| {name} | {tokens} | {lora_us:.1f} | {floor_us:.1f} | {100 * floor_us / lora_us:.1f} | "
                        f"{base_us:.1f} | {lora_us / base_us:.3f} | {turn_us - base_us:.1f} | "
                        f"{beside_us - base_us:.1f} | {share_us - base_us:.1f} | {err:.4f} |")
            del step
            torch.cuda.empty_cache()
        return rows
    finally:
        for name, value in saved.items():
            setattr(lora_kernels, name, value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="bench-8b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="1,16,256,2048", help="rows of a step")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--base-share", type=float, default=1 / 17, help="share of rows on no adapter")
    parser.add_argument("--variant", action="append", type=parse_set, default=[],
                        help="NAME=VALUE[,NAME=VALUE] of kernels/lora.py's constants, timed beside the shipped ones")
    parser.add_argument("--out-md", default=None)
    args = parser.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.info("lora_bench needs a CUDA GPU")
        return 0
    bandwidth = copy_bandwidth(torch.device("cuda"), 1 << 30)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shape}, {args.slots} slots of rank "
             f"{args.rank}, base share {args.base_share:.3f}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
             "a step's LoRA work (all layers, one CUDA graph), us",
             "| variant | tokens | LoRA us | floor us | % floor | base GEMMs us | LoRA / base | added in turn us | "
             "added, shrink beside us | added, share beside us | rel err |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for variant in [{}] + args.variant:
        lines += run(args, variant, bandwidth)
    text = "\n".join(lines)
    print(text)
    if args.out_md:
        Path(args.out_md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
