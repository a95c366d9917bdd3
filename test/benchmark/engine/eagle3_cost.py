"""What an EAGLE-3 head's drafts cost against one target step, at batch 1.

    python test/benchmark/engine/eagle3_cost.py --out-md eagle3_cost.md     # a GPU: bench-8b, bf16
    python test/benchmark/engine/eagle3_cost.py --tiny                      # the CPU: the plumbing

Target: bench-8b (Llama-3.1-8B's shape with the default tokenizer's 49152 tokens, dummy weights;
`--model DIR` for another config's shape). Head: the Llama-3.1-8B head's shape
(yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: the target's layer shape, a draft vocabulary of 32000),
dummy weights, sharing the target's embedding. One request with `--context` tokens cached in
both token tables (the K/V's values do not change the time).

Rows: the target's decode step (one token: forward, logits, greedy argmax), the same returning
the three aux layers' hidden states; `head x k`, k = 1..4 chained head steps: the first from the
target's features through fc, each next from the step before's hidden state and drafted token
(greedy, through d2t), each writing its own K/V; `cycle x k`, the drafting that follows a verify
step which kept k + 1 tokens: the head's extend over them through fc (logits of the last), then
k - 1 chained steps. Eager, and on CUDA each replayed from a CUDA graph of the whole row.
`per draft / target` is the row's time over k target steps of the same mode: the goal is at most
0.10. The drafts must agree across k and modes (a check of the chain, not a figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.engine.static_benchmark import capture, replay_us, sync  # noqa: E402
from benchmark.lib.one_request import decode_batch, extend_batch, slot_table  # noqa: E402

from lightllm.common.token_table import TokenTable  # noqa: E402
from lightllm.models import Eagle3Config, ForwardBatch, load_eagle3, load_model, read_config  # noqa: E402
from lightllm.tools.bench_model import SHAPES, family_config  # noqa: E402
from lightllm.utils.dist import TPGroup  # noqa: E402

logger = logging.getLogger("eagle3_cost")

DRAFT_VOCAB = 32000  # the published Llama-3.1-8B head's
BENCH_VOCAB = 49152  # bench-8b's (the default tokenizer's)
TINY = dict(SHAPES["tiny"], num_hidden_layers=8)  # aux layers (2, 4, 5); 2 layers have no three
GOAL = 0.10


def write_target_config(out: Path, tiny: bool) -> Path:
    """config.json of bench-8b's shape (or a tiny Llama's), without the tokenizer bench_model copies."""
    import transformers

    class_name, fields = family_config("8b")
    shape, vocab = (TINY, 1000) if tiny else (SHAPES["8b"], BENCH_VOCAB)
    getattr(transformers, class_name)(**shape, **fields, vocab_size=vocab).save_pretrained(out)
    return out


@dataclasses.dataclass
class Rig:
    """The target and the head on one device, their token tables, and the step's static inputs."""

    target: object
    head: object
    target_kv: TokenTable
    head_kv: TokenTable
    req_to_token: torch.Tensor
    token: torch.Tensor  # [1] the target's input token
    position: torch.Tensor  # [1] its position (= context)
    max_seqlen: int
    aux_layers: tuple[int, ...]


def build(args) -> Rig:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = read_config(args.model or write_target_config(Path(tmp), args.tiny))
    slots = args.context + args.max_k + 8
    tp = TPGroup()
    target = load_model(cfg, dtype=dtype, device=device, tp=tp, max_positions=slots, load_format="dummy")
    head_cfg = Eagle3Config(dataclasses.replace(cfg, num_layers=1, model_dir="dummy"),
                            min(DRAFT_VOCAB, cfg.vocab_size // 2 if args.tiny else cfg.vocab_size), cfg.hidden_size)
    head = load_eagle3(head_cfg, dtype=dtype, device=device, tp=tp, max_positions=slots, load_format="dummy",
                       target_embed=target.embed)
    target_kv = TokenTable(slots, cfg.num_layers, target.kv_heads, cfg.head_dim, dtype, device, target.kv_shapes)
    head_kv = TokenTable(slots, 1, head.kv_heads, cfg.head_dim, dtype, device)
    token = torch.randint(cfg.vocab_size, (1,), device=device)
    return Rig(target, head, target_kv, head_kv, slot_table(slots, device), token,
               torch.tensor([args.context], device=device), slots, head_cfg.aux_layers(cfg.num_layers))


def target_step(rig: Rig, aux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's decode step: its greedy token, and the aux features where asked for."""
    batch = decode_batch(rig.token, rig.position, rig.req_to_token, rig.max_seqlen, rig.aux_layers if aux else ())
    out = rig.target.forward(batch, rig.target_kv)
    logits, features = out if aux else (out, None)
    return logits.argmax(-1), features


def head_chain(rig: Rig, features: torch.Tensor, k: int) -> torch.Tensor:
    """k chained head steps after the target's token: [k] drafted target-vocabulary ids."""
    token, drafts = rig.token, []
    for j in range(k):
        batch = decode_batch(token, rig.position + j, rig.req_to_token, rig.max_seqlen)
        logits, features = rig.head.forward(batch, rig.head_kv, features)
        token = rig.head.target_ids(logits.argmax(-1))
        drafts.append(token)
    return torch.cat(drafts)


def cycle_inputs(rig: Rig, features: torch.Tensor, k: int) -> tuple[ForwardBatch, torch.Tensor]:
    """The extend batch of k + 1 kept tokens ending at the target's position (logits of the last)
    and their features, built once: a CUDA graph replays them."""
    batch = extend_batch(rig.token.expand(k + 1).contiguous(), int(rig.position) - k, rig.req_to_token,
                         rig.head.config.layer.head_dim)
    batch.logit_index = torch.tensor([k], device=rig.token.device)
    return batch, features.expand(k + 1, -1).contiguous()


def head_cycle(rig: Rig, batch: ForwardBatch, features: torch.Tensor, k: int) -> torch.Tensor:
    """The head's extend over a verify step's kept tokens, then k - 1 chained steps: [k] drafts."""
    logits, hidden = rig.head.forward(batch, rig.head_kv, features)
    token = rig.head.target_ids(logits.argmax(-1))
    drafts, features = [token], hidden[-1:]
    for j in range(1, k):
        logits, features = rig.head.forward(decode_batch(token, rig.position + j, rig.req_to_token, rig.max_seqlen),
                                            rig.head_kv, features)
        token = rig.head.target_ids(logits.argmax(-1))
        drafts.append(token)
    return torch.cat(drafts)


def eager_ms(fn, device: torch.device, iters: int) -> tuple[float, object]:
    """Median milliseconds of fn() between device synchronisations, and its last result."""
    out, times = fn(), []  # the first call compiles
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times), out


def graph_ms(fn, iters: int) -> tuple[float, object]:
    """Mean milliseconds of one replay of a CUDA graph of fn(), and the captured result."""
    graph, out = capture(fn)
    return replay_us(graph, iters) / 1000, out


def measure(rig: Rig, args) -> list[dict]:
    """One row per (mode, what): its time, and the head rows' drafted tokens."""
    device = torch.device(args.device)
    _, features = target_step(rig, aux=True)
    modes = ["eager"] + (["graph"] if device.type == "cuda" and not args.no_cuda_graph else [])
    rows = []
    for mode in modes:
        def time_of(fn):
            return eager_ms(fn, device, args.iters) if mode == "eager" else graph_ms(fn, args.iters)

        target_ms, _ = time_of(lambda: target_step(rig, aux=False))
        aux_ms, _ = time_of(lambda: target_step(rig, aux=True))
        rows.append(dict(mode=mode, what="target step", kind="target", k=0, ms=target_ms, target_ms=target_ms))
        rows.append(dict(mode=mode, what="target step + aux", kind="target", k=0, ms=aux_ms, target_ms=target_ms))
        for k in range(1, args.max_k + 1):
            ms, drafts = time_of(lambda k=k: head_chain(rig, features, k))
            rows.append(dict(mode=mode, what=f"head x {k}", kind="chain", k=k, ms=ms, target_ms=target_ms,
                             drafts=drafts.tolist()))
        for k in range(1, args.max_k + 1):
            batch, kept = cycle_inputs(rig, features, k)
            ms, drafts = time_of(lambda k=k, batch=batch, kept=kept: head_cycle(rig, batch, kept, k))
            rows.append(dict(mode=mode, what=f"cycle x {k}", kind="cycle", k=k, ms=ms, target_ms=target_ms,
                             drafts=drafts.tolist()))
    return rows


def draft_disagreements(rows: list[dict]) -> list[str]:
    """Where a chain's drafts are not the eager longest chain's first k, or a cycle's not the
    eager cycle's of its k (greedy steps over the same K/V are deterministic; a graph's kernels
    could still round apart at a near tie)."""
    chains = [r for r in rows if r["kind"] == "chain"]
    longest = max((r for r in chains if r["mode"] == "eager"), key=lambda r: r["k"])["drafts"]
    eager_cycles = {r["k"]: r["drafts"] for r in rows if r["kind"] == "cycle" and r["mode"] == "eager"}
    expected = [(r, longest[: r["k"]]) for r in chains] + [(r, eager_cycles[r["k"]]) for r in rows
                                                          if r["kind"] == "cycle"]
    return [f"{r['mode']} {r['what']} drafted {r['drafts']}, expected {want}" for r, want in expected
            if r["drafts"] != want or len(want) != r["k"]]


def table(rows: list[dict], title: str) -> list[str]:
    lines = [title, "", "| mode | row | ms | per draft ms | per draft / target step |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["k"]:
            per = r["ms"] / r["k"]
            lines.append(f"| {r['mode']} | {r['what']} | {r['ms']:.3f} | {per:.3f} | {per / r['target_ms']:.3f} |")
        else:
            lines.append(f"| {r['mode']} | {r['what']} | {r['ms']:.3f} | - | - |")
    disagreements = draft_disagreements(rows)
    for message in disagreements:
        logger.warning(message)
    return lines + ["", f"goal: per draft / target step <= {GOAL:.2f}; drafts agree across k and modes: "
                        f"{'no' if disagreements else 'yes'}"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, default=None, help="target model directory (its config; dummy weights); default bench-8b")
    add("--tiny", action="store_true", help="a tiny Llama target (8 layers of hidden 64): the CPU's plumbing check")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    add("--context", type=int, default=1024, help="tokens cached before the step")
    add("--max-k", type=int, default=4, help="longest chain of head steps")
    add("--iters", type=int, default=100)
    add("--no-cuda-graph", action="store_true")
    add("--out-md", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    with torch.inference_mode():
        rig = build(args)
        rows = measure(rig, args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    shape = "tiny" if args.tiny else (args.model.name if args.model else "bench-8b")
    lines = table(rows, f"## EAGLE-3 head against the target at batch 1: {shape}, {args.dtype}, {device}, "
                        f"context {args.context}, draft vocabulary {rig.head.config.draft_vocab_size}")
    print("\n".join(lines), flush=True)
    if args.out_md:
        args.out_md.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
