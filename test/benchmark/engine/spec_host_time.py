"""The host's time in an engine step with drafts and in a plain one, part by part.

A step with drafts is synchronous (its tokens decide the next plan), so every bit of the host's
work around it (collect, settle, process, propose, plan, upload, launch) adds to the step's
period instead of hiding behind the device. This drives the engine core directly, in one thread
(the runner launches in the caller's thread, as on CUDA), on a model whose device work is small,
and splits each step's period into the model's forward and sampler (the device's work, run
inline on the CPU) and the rest (the host's). Times are the thread's CPU time
(`time.thread_time`, torch on one thread by default), which other processes on a shared machine
barely move; the wall time of the step is shown beside it:

    python test/benchmark/engine/spec_host_time.py --device cpu --out-md spec_host.md
    python test/benchmark/engine/spec_host_time.py --device cpu --scenarios 64x4 --method suffix
    python test/benchmark/engine/spec_host_time.py --model DIR --load-format dummy_echo --dtype bfloat16 \
        --device cuda --clock wall --running-max-req-size 512

(dummy_echo: with plain dummy weights the greedy output changes with a verify step's shapes and
the oracle's drafts stop matching; docs/benchmarks.md, "Speculative decoding").

Without --model a tiny Llama (hidden 64, 2 layers, vocabulary 512, random fp32 weights) is
written to a temporary directory. For each scenario BATCHxK (default 1x8 and 64x4) it prefills
BATCH requests, runs them plainly to get the target's greedy continuation (the oracle of the
benchmarks' controlled draft, test/benchmark/lib/controlled_draft.py, at --alpha), then times
--steps engine steps of the same requests without speculation and with it, the controller's
step costs pinned flat so that every request gets its K drafts a step (its probes of plain
steps still run: they are counted apart). `--method ngram` or `suffix` drafts with that host
source instead, from the model's own outputs (its proposals cost what they cost). `--wire`
passes plans and results through the form they cross to the model workers in (plan.py's to/from
wire; rpyc's transport is left out).

Reported per step kind: the period (one `EngineCore.step` to the next; wall and --clock),
forward + sampler, host = period - forward - sampler, tokens emitted, host per token; the parts
(means of their inclusive time per step: nested parts are inside their parent); and a cProfile
of as many more steps with the forward and sampler left out (the host's own time, the top
--top functions; SORT=cumulative in the environment orders them by their inclusive time).

On CUDA use `--clock wall` (a thread waiting for the device may spin, which CPU time counts):
the forward and sampler times are then their launches (asynchronous), and a step with drafts
waits for its device work inside `runner._settle`; its host time is the period less that wait.
"""

from __future__ import annotations

import argparse
import os
import cProfile
import io
import json
import logging
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.lib.controlled_draft import write_oracle  # noqa: E402

from lightllm.engine import model_runner as model_runner_module  # noqa: E402
from lightllm.engine.config import EngineConfig  # noqa: E402
from lightllm.engine.core import EngineCore  # noqa: E402
from lightllm.engine.model_runner import ModelRunner  # noqa: E402
from lightllm.engine.plan import (StepPlan, StepResult, plan_from_wire, plan_to_wire, result_from_wire,  # noqa: E402
                                  result_to_wire)
from lightllm.engine.request import GenerateReq, SamplingParams  # noqa: E402
from lightllm.engine.scheduler import Scheduler  # noqa: E402
from lightllm.engine.spec.config import SpeculativeConfig  # noqa: E402
from lightllm.engine.spec.controller import Speculator  # noqa: E402

logger = logging.getLogger("spec_host_time")

DRAFT = "benchmark.lib.controlled_draft:ControlledDraft"
DEVICE_PARTS = ("forward", "sampler")
CLOCK = [time.thread_time]  # --clock


class StepParts:
    """Wall time per named part, summed within the current step; `end_step` files the step."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict] = []

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)
        current = self.current

        def timed(*args, **kwargs):
            start = CLOCK[0]()
            try:
                return inner(*args, **kwargs)
            finally:
                current[label] += CLOCK[0]() - start

        setattr(owner, name, timed)

    def end_step(self, wall: float, cpu: float, tokens: int, drafted: bool) -> None:
        self.steps.append({"wall": wall, "period": cpu, "tokens": tokens, "drafted": drafted, **self.current})
        self.current.clear()


def tiny_llama(out: Path, vocab: int = 512) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def new_runner(args, model: Path, batch: int, context: int) -> ModelRunner:
    config = EngineConfig(model_dir=str(model), max_total_token_num=batch * context + 1024, max_req_total_len=context,
                          running_max_req_size=max(batch, args.running_max_req_size or 0), data_type=args.dtype,
                          load_format=args.load_format,
                          disable_cuda_graph=args.no_cuda_graph)
    runner = ModelRunner(config, device=args.device, check_budget=False)
    if runner._device_thread is not None:  # launch in this thread, as on CUDA: one profile sees it all
        runner._device_thread.shutdown()
        runner._device_thread = None
    return runner


class WireRunner:
    """The runner behind the plan's and the results' wire form, as the server's workers are
    reached (rpyc's own transport of the tuples is not included)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def step(self, plan: StepPlan) -> list[StepResult]:
        return self.from_worker(self.runner.step(self.to_worker(plan)))

    @staticmethod
    def to_worker(plan: StepPlan) -> StepPlan:
        return plan_from_wire(plan_to_wire(plan))

    @staticmethod
    def from_worker(results: list[StepResult]) -> list[StepResult]:
        return [result_from_wire(result_to_wire(r)) for r in results]


def new_core(runner: ModelRunner, speculator: Speculator | None, wire: bool = False) -> EngineCore:
    scheduler = Scheduler(runner.max_total_token_num, 4096, runner.req_table.max_reqs, prefix_cache=False,
                          speculator=speculator)
    workers = WireRunner(runner) if wire else runner
    return EngineCore(scheduler, workers, eos_token_ids=[], vocab_size=runner.config.vocab_size)


def requests(batch: int, prompt_len: int, new_tokens: int, vocab: int) -> list[GenerateReq]:
    rng = random.Random(0)
    return [GenerateReq(i, [rng.randrange(vocab) for _ in range(prompt_len)],
                        SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)) for i in range(batch)]


def greedy_outputs(runner: ModelRunner, reqs: list[GenerateReq]) -> dict[int, list[int]]:
    core = new_core(runner, None)
    for msg in reqs:
        core.add(msg)
    outputs = defaultdict(list)
    for out in core.drain():
        outputs[out.req_id].append(out.token_id)
    return outputs


def pin_step_costs(spec: Speculator, sizes, seconds: float = 0.01) -> None:
    """Every step of `sizes` tokens, with drafts or without, costs `seconds`, and no step's own
    period is measured after: drafts pay whenever they are accepted, however a loaded machine
    times one step against another."""
    for drafted in (False, True):
        for tokens in sizes:
            spec.measured(drafted, tokens, seconds)
    spec.measured = lambda *args: None


def pinned_speculator(runner: ModelRunner, oracle: Path, alpha: float, k: int, batch: int,
                      method: str = "controlled") -> Speculator:
    """The controlled draft at `alpha` (or a host source, `method` ngram or suffix), every step's
    cost the same: drafts always pay."""
    if method == "controlled":
        config = SpeculativeConfig(DRAFT, num_speculative_tokens=k, options={"oracle": str(oracle), "alpha": alpha})
    else:
        config = SpeculativeConfig(method, num_speculative_tokens=k)
    spec = Speculator(config, runner.config.vocab_size, batch * (k + 1))
    pin_step_costs(spec, (1, batch, batch * (k + 1)))
    spec.guard = None  # steps with drafts throughout: no epochs held off
    return spec


def instrument(core: EngineCore, runner: ModelRunner) -> StepParts:
    parts = StepParts()
    scheduler = core.scheduler
    parts.wrap(runner.model, "forward", "forward")
    parts.wrap(model_runner_module, "sample", "sampler")
    for name in ("_launch", "_settle", "_upload_step", "apply", "_check", "_start_requests", "_sample",
                 "_forward", "_graph_forward", "_mixed_forward"):
        parts.wrap(runner, name, f"runner.{name}")
    for name in ("alloc", "free"):
        parts.wrap(runner.token_table, name, f"token_table.{name}")
    for name in ("schedule", "process", "wants_drafts", "_plan_drafts", "_drafts_fit", "_settle_drafts",
                 "_charged"):
        parts.wrap(scheduler, name, f"scheduler.{name}")
    parts.wrap(core, "_measure_and_collect", "core._measure_and_collect")
    if isinstance(core._workers, WireRunner):
        parts.wrap(core._workers, "to_worker", "wire.plan")
        parts.wrap(core._workers, "from_worker", "wire.results")
    spec = scheduler.speculator
    if spec is not None:
        parts.wrap(spec.source, "propose", "draft.propose")
        parts.wrap(spec, "shadow_drafts", "speculator.shadow_drafts")
        parts.wrap(spec, "allocate", "speculator.allocate")
    return parts


def run_steps(core: EngineCore, parts: StepParts | None, steps: int, device: torch.device) -> None:
    spec = core.scheduler.speculator
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), CLOCK[0]()
        outs = core.step()
        cpu, wall = CLOCK[0]() - start_cpu, time.perf_counter() - start
        if parts is not None:
            parts.end_step(wall, cpu, len(outs), spec is not None and spec.speculating)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(runner: ModelRunner, reqs: list[GenerateReq], speculator: Speculator | None, args) -> tuple[StepParts, str]:
    """Warm the requests up to decoding, time --steps steps, then profile as many more."""
    core = new_core(runner, speculator, args.wire)
    for msg in reqs:
        core.add(msg)
    run_steps(core, None, args.warmup, runner.device)
    parts = instrument(core, runner)
    run_steps(core, parts, args.steps, runner.device)
    profile = cProfile.Profile()
    unpause = [pause_profile(profile, runner.model, "forward"), pause_profile(profile, model_runner_module, "sample")]
    profile.enable()
    run_steps(core, None, args.profile_steps, runner.device)
    profile.disable()
    for restore in unpause:
        restore()
    for msg in reqs:
        core.abort(msg.req_id)
    core.drain()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(os.environ.get("SORT", "tottime")).print_stats(args.top)
    return parts, text.getvalue()


def pause_profile(profile: cProfile.Profile, owner, name: str):
    """The device's work (forward, sampler) out of the profile: it shows the host's alone.
    Returns what puts the attribute back."""
    inner = getattr(owner, name)

    def paused(*args, **kwargs):
        profile.disable()
        try:
            return inner(*args, **kwargs)
        finally:
            profile.enable()

    setattr(owner, name, paused)
    return lambda: setattr(owner, name, inner)


def summary(steps: list[dict]) -> dict[str, float]:
    """Means of the period and its parts (ms of --clock: the host's time is their difference), and tokens per step."""
    out = {"steps": len(steps)}
    names = sorted({k for s in steps for k in s} - {"wall", "period", "tokens", "drafted"})
    for name in ["wall", "period", *names]:
        out[name] = 1000 * statistics.mean(s.get(name, 0.0) for s in steps)
    out["host"] = out["period"] - sum(out.get(p, 0.0) for p in DEVICE_PARTS)
    out["tokens"] = statistics.mean(s["tokens"] for s in steps)
    return out


def scenario(args, model: Path, batch: int, k: int) -> list[str]:
    context = args.prompt_len + args.new_tokens + k + 8
    runner = new_runner(args, model, batch, context)
    reqs = requests(batch, args.prompt_len, args.new_tokens, runner.config.vocab_size)
    outputs = greedy_outputs(runner, reqs)
    with tempfile.TemporaryDirectory() as tmp:
        oracle = Path(tmp) / "oracle.jsonl"
        write_oracle(oracle, [(msg.prompt_ids, outputs[msg.req_id]) for msg in reqs])
        runs = {"plain": measure(runner, reqs, None, args),
                f"spec k={k}": measure(runner, reqs, pinned_speculator(runner, oracle, args.alpha, k, batch,
                                                                         args.method), args)}
    rows = step_kinds(runs)
    source = f"alpha {args.alpha}" if args.method == "controlled" else args.method
    lines = [f"### Batch {batch}, up to {k} drafts, {source}", "", *tables(rows, args.clock)]
    for label, (_, profile) in runs.items():
        lines += ["", f"cProfile, {args.profile_steps} steps, {label} (own time):", "", "```",
                  *profile.strip().splitlines()[:args.top + 12], "```"]
    lines.append("")
    if args.out_json:
        with open(args.out_json, "a") as out:
            out.write(json.dumps({"batch": batch, "k": k, "method": args.method, "alpha": args.alpha,
                                  "rows": rows}) + "\n")
    return lines


def step_kinds(runs: dict) -> dict[str, dict]:
    """The summary of each run's plain steps and steps with drafts (those it has)."""
    rows = {}
    for label, (parts, _) in runs.items():
        for drafted in (False, True):
            steps = [s for s in parts.steps if s["drafted"] == drafted]
            if steps:
                rows[f"{label}, {'steps with drafts' if drafted else 'plain steps'}"] = summary(steps)
    return rows


def tables(rows: dict[str, dict], clock: str) -> list[str]:
    names = sorted({n for r in rows.values() for n in r} - {"steps", "wall", "period", "host", "tokens", *DEVICE_PARTS})
    lines = ["| steps | n | wall ms | period ms | forward ms | sampler ms | host ms | tokens/step | host ms/token |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['steps']} | {r['wall']:.3f} | {r['period']:.3f} | {r.get('forward', 0):.3f} | "
                     f"{r.get('sampler', 0):.3f} | {r['host']:.3f} | {r['tokens']:.2f} | "
                     f"{r['host'] / max(r['tokens'], 1e-9):.3f} |")
    lines += ["", f"Parts, mean ms a step ({clock} time, inclusive):", "", "| part | " + " | ".join(rows) + " |",
              "| --- |" + " ---: |" * len(rows)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{r.get(name, 0.0):.3f}" for r in rows.values()) + " |")
    return lines


def scenarios(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, default=None, help="a model directory (default: a tiny Llama in a temporary one)")
    add("--load-format", default="auto")
    add("--dtype", default="float32")
    add("--device", default=None)
    add("--scenarios", type=scenarios, default=[(1, 8), (64, 4)], help="BATCHxK,...: requests and most drafts each")
    add("--method", choices=("controlled", "ngram", "suffix"), default="controlled",
        help="the draft source: the controlled draft at --alpha, or a host source on the model's own outputs")
    add("--alpha", type=float, default=0.8)
    add("--prompt-len", type=int, default=32)
    add("--new-tokens", type=int, default=1024, help="each request's output (enough for the steps timed)")
    add("--warmup", type=int, default=30)
    add("--steps", type=int, default=150)
    add("--profile-steps", type=int, default=50)
    add("--top", type=int, default=25)
    add("--wire", action="store_true", help="plans and results through their wire form, as the workers get them")
    add("--clock", choices=("cpu", "wall"), default="cpu", help="the parts' clock: the thread's CPU time or wall time")
    add("--threads", type=int, default=1, help="torch's CPU threads")
    add("--no-cuda-graph", action="store_true")
    add("--running-max-req-size", type=int, default=None,
        help="request rows, and so the decode graphs' buckets (default: the batch); on a GPU the server's 512, "
             "so that verify steps replay from graphs as they do there")
    add("--out-md", type=Path, default=None)
    add("--out-json", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    CLOCK[0] = time.thread_time if args.clock == "cpu" else time.perf_counter
    try:
        lines = report(args)
    finally:
        torch.set_num_threads(threads)
    if args.out_md:
        args.out_md.write_text("\n".join(lines) + "\n")
    return 0


def report(args) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_llama(Path(tmp) / "tiny")
        lines = [f"## Host time of steps with drafts: {model.name}, {args.dtype}, "
                 f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}", ""]
        for batch, k in args.scenarios:
            part = scenario(args, model, batch, k)
            print("\n".join(part), flush=True)
            lines += part
    return lines


if __name__ == "__main__":
    sys.exit(main())
