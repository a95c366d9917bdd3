"""What a draft model's proposals cost against the target's steps, in one process.

    python test/benchmark/engine/draft_model_cost.py --model .gpu/bench-8b --draft .gpu/bench-1b \\
        --batches 1,64 --ks 1,4,8 --out-md draft_cost.md                      # a GPU, bf16, graphs
    python test/benchmark/engine/draft_model_cost.py --tiny                   # the CPU: the plumbing

Both models load with `dummy_echo` weights (each answers every token with itself), so every draft
is accepted and the cycle is the steady state of a draft that is always right: a proposal call
(the draft catches up on the k + 1 tokens the last verify step kept, then k - 1 single-token
steps; `ModelRunner.draft`, without the workers' rpyc seam) and a verify step of k drafts a
request, against a plain decode step of the same batch. Each time is the wall time to the
device's end (synchronised), the median of --iters. `tokens / ms` is the tokens a cycle emits
over its time, `x plain` that against the plain step's: the most speculation with this draft can
gain where every draft is accepted and the host's time between steps is left out.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from lightllm.engine.config import EngineConfig  # noqa: E402
from lightllm.engine.model_runner import ModelRunner  # noqa: E402
from lightllm.engine.plan import Chunk, DraftRequest, StepPlan  # noqa: E402
from lightllm.engine.request import SamplingParams  # noqa: E402

logger = logging.getLogger("draft_model_cost")


def tiny_models(out: Path) -> tuple[Path, Path]:
    from lightllm.tools.bench_model import write_bench_model

    target = write_bench_model(out / "target", "tiny", seed=0)
    return target, write_bench_model(out / "draft", "tiny", seed=1)


def new_runner(args, batch: int) -> ModelRunner:
    spec = json.dumps({"method": "draft_model", "model": str(args.draft), "num_speculative_tokens": max(args.ks)})
    length = args.context + args.iters * (max(args.ks) + 1) * 3 + 64
    config = EngineConfig(model_dir=str(args.model), max_total_token_num=batch * length + 1024,
                          max_req_total_len=length, running_max_req_size=batch, data_type=args.dtype,
                          load_format="dummy_echo", speculative_config=spec, disable_cuda_graph=args.no_cuda_graph)
    runner = ModelRunner(config, device=args.device, check_budget=False)
    if runner._device_thread is not None:  # launch in this thread: the timings are the calls'
        runner._device_thread.shutdown()
        runner._device_thread = None
    return runner


class Cycle:
    """`batch` requests of `context` tokens on a runner, and their tokens as the host keeps them."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, vocab: int):
        self.runner, self.steps = runner, iter(range(1, 1 << 30))
        gen = torch.Generator().manual_seed(0)
        self.tokens = {i: torch.randint(0, vocab, (context,), generator=gen).tolist() for i in range(batch)}
        chunks = [Chunk(i, list(t), 0, True, SamplingParams(max_new_tokens=1 << 20)) for i, t in self.tokens.items()]
        for result in runner.step(StepPlan(next(self.steps), [], chunks, sync=True)):
            self._keep(result)
        self.drafted = {i: 0 for i in self.tokens}
        self.propose(0)  # the draft catches up on the prompts

    def _keep(self, result) -> None:
        for token in result.tokens:
            self.tokens[token.req_id].append(token.token_id)

    def propose(self, k: int) -> dict[int, list[int]]:
        asks = [DraftRequest(i, self.drafted[i], tuple(t[self.drafted[i]: len(t) - (0 if k else 1)]), k)
                for i, t in self.tokens.items()]
        out = {}
        for ask, (drafts, drafted) in zip(asks, self.runner.draft(asks)):
            self.drafted[ask.req_id] = drafted
            out[ask.req_id] = list(drafts)
        return out

    def step(self, drafts: dict[int, list[int]]) -> int:
        (result,) = self.runner.step(StepPlan(next(self.steps), list(self.tokens), drafts=drafts, sync=True))
        self._keep(result)
        return len(result.tokens)


def timed(fn, device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000, value


def measure(args, batch: int) -> list[dict]:
    runner = new_runner(args, batch)
    cycle = Cycle(runner, batch, args.context, min(runner.config.vocab_size, runner.drafter.vocab))
    device = runner.device
    plain = []
    for _ in range(args.iters + 1):
        plain.append(timed(lambda: cycle.step({}), device)[0])
    rows = [dict(batch=batch, k=0, plain_ms=statistics.median(plain[1:]))]
    for k in args.ks:
        cycle.propose(k)  # the draft KV up to date before the timed cycles
        cycle.step({})
        propose_ms, verify_ms, emitted, accepted = [], [], [], []
        for _ in range(args.iters + 1):
            ms, drafts = timed(lambda: cycle.propose(k), device)
            propose_ms.append(ms)
            ms, tokens = timed(lambda: cycle.step(drafts), device)
            verify_ms.append(ms)
            emitted.append(tokens)
            accepted.append(sum(len(d) for d in drafts.values()))
        cycle_ms = statistics.median(propose_ms[1:]) + statistics.median(verify_ms[1:])
        tokens = statistics.median(emitted[1:])
        rows.append(dict(batch=batch, k=k, propose_ms=statistics.median(propose_ms[1:]),
                         verify_ms=statistics.median(verify_ms[1:]), tokens=tokens, drafts=statistics.median(accepted[1:]),
                         x_plain=(tokens / cycle_ms) / (batch / rows[0]["plain_ms"])))
    return rows


def measure_all(args) -> list[dict]:
    rows = []
    for batch in args.batches:
        rows += measure(args, batch)
        gc.collect()  # the batch's runner (and its graphs) go before the next one loads
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], args) -> list[str]:
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    lines = [f"## A draft model's cycle against plain decode steps: {args.model.name} drafted by {args.draft.name}, "
             f"{args.dtype}, {gpu}, context {args.context}, every draft accepted", "",
             "| batch | k | plain step ms | propose ms | verify ms | cycle ms | tokens a cycle | tokens / ms | x plain |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    plain = {}
    for r in rows:
        if r["k"] == 0:
            plain[r["batch"]] = r["plain_ms"]
            lines.append(f"| {r['batch']} | 0 | {r['plain_ms']:.3f} | - | - | {r['plain_ms']:.3f} | {r['batch']} | "
                         f"{r['batch'] / r['plain_ms']:.1f} | 1.00 |")
            continue
        cycle_ms = r["propose_ms"] + r["verify_ms"]
        lines.append(f"| {r['batch']} | {r['k']} | {plain[r['batch']]:.3f} | {r['propose_ms']:.3f} | "
                     f"{r['verify_ms']:.3f} | {cycle_ms:.3f} | {r['tokens']:g} | {r['tokens'] / cycle_ms:.1f} | "
                     f"{r['x_plain']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, default=None, help="target model directory (dummy_echo weights)")
    add("--draft", type=Path, default=None, help="draft model directory (dummy_echo weights)")
    add("--tiny", action="store_true", help="two tiny Llamas (the CPU's plumbing check)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    add("--batches", type=lambda t: [int(b) for b in t.split(",")], default=[1, 64])
    add("--ks", type=lambda t: [int(k) for k in t.split(",")], default=[1, 4, 8])
    add("--context", type=int, default=512, help="prompt tokens of each request")
    add("--iters", type=int, default=20)
    add("--no-cuda-graph", action="store_true")
    add("--out-md", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            args.model, args.draft = tiny_models(Path(tmp))
        if args.model is None or args.draft is None:
            parser.error("--model and --draft (or --tiny)")
        rows = measure_all(args)
        text = "\n".join(table(rows, args)) + "\n"
    print(text)
    if args.out_md is not None:
        args.out_md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
