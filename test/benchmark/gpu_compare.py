"""LightLLM server vs transformers' continuous batching: the same requests on the same GPU.

    python -m lightllm.tools.bench_model --out bench-8b          # once, where there is network
    python test/benchmark/gpu_compare.py --model bench-8b \\
        --dataset ShareGPT_V3_unfiltered_cleaned_split.json --out-dir results/

Phase 1 starts the server (`--load_format dummy`: random bf16 weights of the model's shape),
waits for /health, warms it up, and runs the ShareGPT benchmark over /generate_stream with all
requests sent at once. Phase 2 stops the server and gives the same requests (same prompt token
ids, same output lengths, EOS disabled, greedy) to transformers' continuous batching on a
randomly initialised bf16 model of the same config. Each phase has a time limit; requests
unfinished at the limit count as failed. The server is killed on every exit path.

Timing: the server's figures are taken by an HTTP client (they include HTTP, tokenization,
detokenization and server-sent events); transformers' figures come from its own per-token
timestamps, measured from the moment each request was added. Both runs start all requests at
once, so TTFT includes queueing.

Output: a markdown table (ratio = LightLLM / transformers), compare.json and compare.png.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules

from server_process import ServerProcess  # noqa: E402
from serving_client import run_requests_in_processes, warm_up  # noqa: E402
from serving_metrics import RequestResult, fail_if_short, format_summary, summarize  # noqa: E402
from sharegpt import SampledRequest, load_sharegpt_requests, read_requests, save_requests  # noqa: E402

from lightllm.utils.process import die_with_parent  # noqa: E402

logger = logging.getLogger("gpu_compare")


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
    """The whole run's time limit: no phase may run past it (the device allows 10 minutes)."""

    RESERVE_S = 20.0  # for stopping the server, the report and the plot

    def __init__(self, total_s: float):
        self.end = time.monotonic() + total_s

    def limit(self, phase_s: float) -> float:
        return max(1.0, min(phase_s, self.end - time.monotonic() - self.RESERVE_S))


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that `finally` blocks (which stop the server) run."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


# ---- requests ----


def load_requests(args) -> list[SampledRequest]:
    if args.requests:
        requests = read_requests(args.requests)[: args.num_prompts]
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        requests = load_sharegpt_requests(tokenizer, args.num_prompts, args.seed, args.dataset)
    save_requests(args.out_dir / "requests.json", requests)
    return requests


# ---- phase 1: the server ----


def start_server(args, port: int) -> ServerProcess:
    server_args = ["--model_dir", str(args.model), "--tp", str(args.tp), "--host", "127.0.0.1", "--load_format", "dummy",
                   "--data_type", "bfloat16"]
    if args.max_total_token_num:
        server_args += ["--max_total_token_num", str(args.max_total_token_num)]
    # Its own session, so that it and its children stop as one group (the GPU memory of its model
    # worker is free before transformers starts); and SIGTERM to it if this script dies without
    # running its `finally` (its children die with it in turn).
    return ServerProcess(server_args + shlex.split(args.server_args), args.out_dir / "server.log", port,
                         own_session=True, preexec_fn=functools.partial(_die_with_parent, os.getpid()))


def _die_with_parent(parent: int) -> None:
    """SIGTERM, on which the server drains; an older tree under test (h100_serving.sh's old
    variant) has a die_with_parent that takes no signal and sends SIGTERM anyway."""
    try:
        die_with_parent(parent, signal.SIGTERM)
    except TypeError:
        die_with_parent(parent)


def run_server_phase(args, requests: list[SampledRequest], budget: Budget) -> dict:
    server = start_server(args, args.port)
    url = server.url
    try:
        limit = budget.limit(args.start_timeout)
        with time_limit(limit, "server start"):
            took = server.wait_healthy(limit)
        logger.info("server healthy after %.1f s", took)
        with time_limit(budget.limit(args.warmup_timeout), "server warm-up"):
            asyncio.run(warm_up(url, requests[: args.warmup_requests]))
        # A per-request timeout of the phase limit, less the time over which requests arrive
        # (none at rate inf: every request is sent at t=0), ends the phase.
        limit = budget.limit(args.bench_timeout)
        spread = len(requests) / args.request_rate if math.isfinite(args.request_rate) else 0.0
        results, duration, client_cpu = run_requests_in_processes(
            url, requests, stream=True, processes=args.client_procs, request_rate=args.request_rate, seed=args.seed,
            timeout_s=max(1.0, limit - spread))
        # Near 100% a process: the client, not the server, may be what the figures measure (--client-procs).
        logger.info("client: %d process(es), %.0f CPU s over %.1f s (%.0f%% of one core a process)", args.client_procs,
                    client_cpu, duration, 100 * client_cpu / max(duration, 1e-9) / args.client_procs)
    finally:
        logger.info("stopping the server (process group %d)", server.proc.pid)
        server.stop(timeout=30)
    return summarize(results, duration)


# ---- phase 2: transformers continuous batching ----


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
    # No prefix sharing: the LightLLM server has no prefix cache, so neither side reuses prompts.
    options = {"allow_block_sharing": False}
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


def run_hf_phase(args, requests: list[SampledRequest], budget: Budget) -> dict:
    with time_limit(budget.limit(args.hf_setup_timeout), "transformers set-up"):
        model = build_hf_model(args)
        manager = start_hf_manager(model, args.hf_cuda_graph)
    try:
        limit = budget.limit(args.warmup_timeout)
        with time_limit(limit + 5, "transformers warm-up"):
            warm = [SampledRequest(r.prompt, r.prompt_ids, min(r.output_len, 16)) for r in requests[: args.warmup_requests]]
            warm_results, _ = hf_generate(manager, warm, limit, "warmup")
        failed = [r.error for r in warm_results if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} transformers warm-up requests failed, first: {failed[0]}")
        results, duration = hf_generate(manager, requests, budget.limit(args.bench_timeout), "bench")
    finally:
        manager.stop(block=True, timeout=30, hard_stop=True)
    return summarize(results, duration)


# ---- report ----

ROWS = (  # (key, label, higher is better)
    ("completed", "Successful requests", True),
    ("failed", "Failed requests", False),
    ("duration", "Benchmark duration (s)", False),
    ("request_throughput", "Request throughput (req/s)", True),
    ("output_throughput", "Output token throughput (tok/s)", True),
    ("total_token_throughput", "Total token throughput (tok/s)", True),
) + tuple(
    (f"{stat}_{key}_ms", f"{stat.capitalize() if stat != 'p99' else 'P99'} {name} (ms)", False)
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
    for stat in ("mean", "median", "p99")
)


def markdown_table(ours: dict, theirs: dict) -> str:
    lines = ["| metric | LightLLM | transformers CB | ratio |", "| --- | ---: | ---: | ---: |"]
    for key, label, _ in ROWS:
        a, b = ours.get(key), theirs.get(key)
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        lines.append(f"| {label} | {fmt(a)} | {fmt(b)} | {ratio} |")
    return "\n".join(lines)


def fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def plot(ours: dict, theirs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars(left, ["output_throughput", "total_token_throughput"], ["output tok/s", "total tok/s"], ours, theirs)
    left.set_title("Throughput (higher is better)")
    latency_keys = ["median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms"]
    bars(right, latency_keys, [k.removesuffix("_ms").replace("_", "\n") for k in latency_keys], ours, theirs)
    right.set_yscale("log")
    right.set_title("Latency in ms (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bars(ax, keys: list[str], labels: list[str], ours: dict, theirs: dict) -> None:
    width = 0.38
    for offset, (name, figures) in zip((-width / 2, width / 2), (("LightLLM", ours), ("transformers CB", theirs))):
        values = [figures.get(k) or 0.0 for k in keys]
        ax.bar([i + offset for i in range(len(keys))], values, width, label=name)
    ax.set_xticks(range(len(keys)), labels)
    ax.legend()


def report(args, ours: dict, theirs: dict, requests: list[SampledRequest]) -> None:
    print(format_summary(ours, "LightLLM server"), flush=True)
    print(format_summary(theirs, "transformers continuous batching"), flush=True)
    table = markdown_table(ours, theirs)
    arrival = "all sent at once" if math.isinf(args.request_rate) else f"server: {args.request_rate:g} req/s (Poisson)"
    print(f"\n{len(requests)} ShareGPT requests, {arrival}; ratio = LightLLM / transformers\n\n{table}\n")
    (args.out_dir / "compare.md").write_text(table + "\n")
    data = {"num_prompts": len(requests), "request_rate": str(args.request_rate), "model": str(args.model),
            "lightllm": ours, "transformers": theirs}
    (args.out_dir / "compare.json").write_text(json.dumps(data, indent=2))
    plot(ours, theirs, args.out_dir / "compare.png")
    logger.info("wrote compare.md, compare.json and compare.png to %s", args.out_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, required=True, help="model directory (bench-8b: config + tokenizer, no weights)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", type=Path, help="ShareGPT JSON file")
    source.add_argument("--requests", type=Path, help="requests saved by sharegpt.save_requests (skips sampling)")
    add("--num-prompts", type=int, default=1000)
    add("--seed", type=int, default=0)
    add("--out-dir", type=Path, required=True)
    add("--port", type=int, default=None, help="server port (default: a free one)")
    add("--max-total-token-num", type=int, default=None, help="server KV budget (default: sized by the server)")
    add("--tp", type=int, default=1, help="the server's tensor-parallel degree (GPUs)")
    add("--server-args", default="", help="extra server flags, one string")
    add("--request-rate", type=float, default=math.inf,
        help="server phase: requests per second, Poisson arrivals (seeded by --seed); inf: all at once")
    add("--client-procs", type=int, default=1,
        help="server phase: client processes sharing the requests (more when one process is busy all the run: see its log line)")
    add("--device", default="cuda", help="device of the transformers model")
    add("--warmup-requests", type=int, default=32, help="short requests sent before each measured run")
    add("--start-timeout", type=float, default=150, help="seconds for the server to become healthy")
    add("--warmup-timeout", type=float, default=60, help="seconds for each warm-up")
    add("--bench-timeout", type=float, default=180, help="seconds for each measured run")
    add("--hf-setup-timeout", type=float, default=120, help="seconds to build transformers' model and manager")
    add("--total-timeout", type=float, default=570, help="seconds for the whole run; phases are cut to fit")
    add("--skip-transformers", action="store_true", help="run only the server phase")
    add("--skip-server", action="store_true", help="run only the transformers phase")
    add("--hf-cuda-graph", action="store_true", help="ask transformers for CUDA graphs (use_cuda_graph=True)")
    return parser


def guarded(name: str, phase, args, requests: list[SampledRequest], budget: Budget) -> dict:
    """Run a phase; one that breaks still yields figures: every request failed, with the reason."""
    try:
        return phase(args, requests, budget)
    except Exception as exc:  # the report must come out whatever went wrong inside a phase
        logger.exception("the %s phase failed", name)
        error = f"{name} phase: {type(exc).__name__}: {exc}"
        return summarize([RequestResult(r.prompt_len, r.output_len, error=error) for r in requests], 1.0)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    exit_on_sigterm()
    args = build_parser().parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.total_timeout)
    requests = load_requests(args)
    ours = summarize([], 1.0) if args.skip_server else guarded("server", run_server_phase, args, requests, budget)
    print(format_summary(ours, "LightLLM server"), flush=True)
    theirs = summarize([], 1.0) if args.skip_transformers else guarded("transformers", run_hf_phase, args, requests, budget)
    report(args, ours, theirs, requests)
    return 0 if ours["failed"] == 0 and theirs["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
