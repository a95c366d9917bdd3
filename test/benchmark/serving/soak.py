"""A bounded soak test: mixed valid, invalid, aborted and streamed requests for N minutes.

    python test/benchmark/serving/soak.py --minutes 10                  # starts a server on the default model
    python test/benchmark/serving/soak.py --minutes 10 --url http://127.0.0.1:8000   # a running server

Clients loop until the time is up, each picking a request at random (seeded): whole and streamed
generations on /generate, /generate_stream and the OpenAI routes; invalid bodies that must get a
4xx; and aborts (the client disconnects mid-stream, or gives up on a whole answer). It reports
requests by outcome, latency percentiles, and the server's memory (RSS of all its processes) and
KV tokens in use, idle, after a warm-up and at the end. It fails (exit status 1) on any unexpected
answer (a 5xx, a hang, a valid request refused, an invalid one accepted), on KV tokens still held
when idle, on memory that grew by more than --max_rss_growth, and on a normal stream whose longest
gap between tokens exceeds --max_gap_ratio times the median gap of all normal streams (a stall of
the engine: one hostile request must delay only itself). Not part of CI.

--hostile (on by default; --no-hostile for the normal mix alone) adds hostile.py's mix beside the
normal one: tool calls, forced calls, structured output, large schemas and $ref chains (200 or
400), slow clients on raw sockets (408 or a closed socket) and clients that hang up mid-body or
mid-stream. It is on by default because the failures this soak exists to catch (memory held by
one request, an engine stalled by one grammar, sockets never timed out) need that traffic. A server
this script starts gets --request_receive_timeout 5 unless --server_args names it, so that slow
clients finish in seconds. The report adds one table of RSS per process (HTTP, router,
detokenizer, model workers) idle, after warm-up and at the end, the normal streams' gaps between
tokens, and every non-2xx by route and status, expected apart from unexpected.

--priorities gives the OpenAI routes' requests a random `priority` (the server then needs
--schedule_policy priority in --server_args): running requests are preempted for more urgent
ones and resume later, and the report counts the preemptions. A preempted stream pauses by
design, so such a soak wants a looser --max_gap_ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from benchmark.lib.server_process import ServerProcess, free_port, metric_samples, start_server  # noqa: E402
from benchmark.serving import hostile  # noqa: E402

logger = logging.getLogger("soak")

ABORTED_TOKENS = 1000  # an aborted request would run this long: the client always leaves first
WORDS = "the a river model token quiet orange seven build light cache north value stream window".split()
REQUEST_TIMEOUT_S = 300.0
# below the server's --keep_alive_timeout (5 s): a client that idled through a slow-client request
# would otherwise reuse a connection the server is closing (a reset, not the server's answer)
CLIENT_KEEPALIVE_S = 2.0
GAPS: contextvars.ContextVar[list] = contextvars.ContextVar("gaps")  # seconds between a normal stream's events


@dataclass
class Outcomes:
    counts: Counter = field(default_factory=Counter)  # (kind, outcome)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    unexpected: list[str] = field(default_factory=list)  # the first few, for the report
    statuses: Counter = field(default_factory=Counter)  # (route, status, expected) of every non-2xx answer
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive events of normal streams

    def add(self, kind: str, outcome: str, seconds: float, detail: str = "", seen=(), gaps=()) -> None:
        self.counts[kind, outcome] += 1
        self.gaps.extend(gaps)
        for route, status in seen:
            if not str(status).startswith("2"):
                self.statuses[route, str(status), outcome != "unexpected"] += 1
        if outcome == "ok":
            self.latencies[kind].append(seconds)
        if outcome == "unexpected" and len(self.unexpected) < 20:
            self.unexpected.append(f"{kind}: {detail}")


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))


def sampling_extras(rng: random.Random) -> dict:
    """vLLM's sampling extensions, each in about one request of six: the runner's sparse inputs
    (allowed tokens, bad words of one and of two tokens, whose requests wait for their tokens) beside
    plain requests in the same steps."""
    extras = {}
    if rng.random() < 0.17:
        extras["allowed_token_ids"] = rng.sample(range(100, 2000), rng.randint(1, 8))
    if rng.random() < 0.17:
        extras["bad_words"] = rng.sample(WORDS, 2) + ["quiet river"]
    return extras


def generate_params(rng: random.Random) -> dict:
    sampled = rng.random() < 0.5
    params = {"max_new_tokens": rng.randint(1, 24), "do_sample": sampled, "temperature": 0.8,
              "seed": rng.randint(0, 99), **sampling_extras(rng)}
    if rng.random() < 0.17:
        params["truncate"] = rng.randint(1, 8)
    adapter = pick_adapter(rng)
    return params if adapter is None else {**params, "adapter_id": adapter}


ADAPTERS: dict[str, str] = {}  # --loras: name -> directory of the adapters the server serves


def pick_adapter(rng: random.Random) -> str | None:
    """With --loras, one of the adapters for half of the requests; None: the base model."""
    return rng.choice(sorted(ADAPTERS)) if ADAPTERS and rng.random() < 0.5 else None


PRIORITIES = [False]  # --priorities: the OpenAI routes' requests carry a random priority


def with_model(body: dict, rng: random.Random) -> dict:
    """The body with an adapter's name as its model (--loras) and a priority (--priorities)."""
    adapter = pick_adapter(rng)
    if PRIORITIES[0]:
        body = {**body, "priority": rng.randint(-2, 2)}
    return body if adapter is None else {**body, "model": adapter}


# ---- the requests: each returns (outcome, detail) ----


async def whole(session, url, rng) -> tuple[str, str]:
    async with session.post(f"{url}/generate", json={"inputs": prompt(rng), "parameters": generate_params(rng)}) as reply:
        body = await reply.json(content_type=None)
        return ("ok", "") if reply.status == 200 and body.get("finish_reason") else ("unexpected", f"{reply.status} {body}")


async def streamed(session, url, rng) -> tuple[str, str]:
    body = {"inputs": prompt(rng), "parameters": generate_params(rng)}
    async with session.post(f"{url}/generate_stream", json=body) as reply:
        if reply.status != 200:
            return "unexpected", f"{reply.status} {await reply.text()}"
        last, times = None, []
        async for line in reply.content:
            if line.startswith(b"data:"):
                times.append(time.monotonic())
                last = json.loads(line[len(b"data:"):])
        GAPS.get().extend(b - a for a, b in zip(times, times[1:]))
        ok = last is not None and last["finished"] and last["finish_reason"] in ("length", "eos", "stop")
        return ("ok", "") if ok else ("unexpected", f"last event {last}")


async def chat_streamed(session, url, rng) -> tuple[str, str]:
    body = with_model({"messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": rng.randint(1, 24),
                       "stream": True}, rng)
    async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
        if reply.status != 200:
            return "unexpected", f"{reply.status} {await reply.text()}"
        lines, times = [], []
        async for line in reply.content:
            if line.startswith(b"data:"):
                lines.append(line)
                times.append(time.monotonic())
        GAPS.get().extend(b - a for a, b in zip(times[:-1], times[1:-1]))  # [DONE] is no token
        ok = lines and lines[-1].strip() == b"data: [DONE]" and b'"error"' not in b"".join(lines)
        return ("ok", "") if ok else ("unexpected", f"stream ended with {lines[-1:]}")


async def completion(session, url, rng) -> tuple[str, str]:
    body = with_model({"prompt": prompt(rng), "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 1.0]),
                       **sampling_extras(rng)}, rng)
    if rng.random() < 0.17:  # vLLM's other extensions: a tenant's cache, a cut prompt, logprobs by token id
        body.update(cache_salt=rng.choice(["tenant-a", "tenant-b"]), truncate_prompt_tokens=rng.choice([-1, 4]),
                    logprobs=2, return_tokens_as_token_ids=True, prompt_logprobs=1)
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        data = await reply.json(content_type=None)
        return ("ok", "") if reply.status == 200 and data.get("choices") else ("unexpected", f"{reply.status} {data}")


INVALID_BODIES = [
    ("/generate", b"{not json", "application/json"),
    ("/generate", json.dumps({"inputs": "x", "parameters": {"max_new_tokens": -1}}).encode(), "application/json"),
    ("/generate", json.dumps({"inputs": "x", "parameters": {"top_p": 2}}).encode(), "application/json"),
    ("/generate", b'{"inputs": "\\ud800"}', "application/json"),
    ("/generate", json.dumps({"inputs": "x"}).encode(), "text/plain"),
    ("/generate", json.dumps({"inputs": "word " * 5000}).encode(), "application/json"),
    ("/generate_stream", json.dumps({"parameters": {}}).encode(), "application/json"),
    ("/v1/completions", json.dumps({"max_tokens": 4}).encode(), "application/json"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}).encode(),
     "application/json"),
    ("/v1/chat/completions", json.dumps({"messages": "hello"}).encode(), "application/json"),
    ("/v1/completions", json.dumps({"prompt": "x", "allowed_token_ids": []}).encode(), "application/json"),
    ("/v1/completions", json.dumps({"prompt": "x", "truncate_prompt_tokens": 0}).encode(), "application/json"),
    ("/generate", json.dumps({"inputs": "x", "parameters": {"bad_words": [""]}}).encode(), "application/json"),
]


async def invalid(session, url, rng) -> tuple[str, str]:
    path, data, content_type = rng.choice(INVALID_BODIES)
    async with session.post(f"{url}{path}", data=data, headers={"Content-Type": content_type}) as reply:
        body = await reply.text()
        is_json = reply.content_type == "application/json"
        ok = 400 <= reply.status < 500 and is_json
        return ("rejected", "") if ok else ("unexpected", f"{path} {data[:60]!r}: {reply.status} {body[:200]}")


async def aborted_stream(session, url, rng) -> tuple[str, str]:
    body = {"inputs": prompt(rng), "parameters": {"max_new_tokens": ABORTED_TOKENS, "ignore_eos": True}}
    return await hostile.leave_mid_stream(session, url, "/generate_stream", body, rng)


async def aborted_whole(session, url, rng) -> tuple[str, str]:
    body = {"inputs": prompt(rng), "parameters": {"max_new_tokens": ABORTED_TOKENS, "ignore_eos": True}}
    try:
        async with asyncio.timeout(rng.uniform(0.05, 0.5)):
            async with session.post(f"{url}/generate", json=body) as reply:
                return "unexpected", f"answered before the client gave up: {reply.status}"
    except TimeoutError:
        return "aborted", ""


async def lora_round_trip(session, url, rng) -> tuple[str, str]:
    """Load one of the adapters' directories under a name of its own, generate with it, unload it:
    each step must answer 200, and the name must be gone after (404)."""
    name = f"soak-{rng.getrandbits(48):x}"
    path = ADAPTERS[rng.choice(sorted(ADAPTERS))]
    steps = [("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, 200),
             ("/v1/completions", {"model": name, "prompt": prompt(rng), "max_tokens": rng.randint(1, 8)}, 200),
             ("/v1/unload_lora_adapter", {"lora_name": name}, 200),
             ("/v1/completions", {"model": name, "prompt": "x", "max_tokens": 1}, 404)]
    for route, body, status in steps:
        async with session.post(f"{url}{route}", json=body) as reply:
            text = await reply.text()
            if reply.status != status:
                return "unexpected", f"{route} {name}: {reply.status} (wanted {status}) {text[:200]}"
    return "ok", ""


MIX = {  # kind: (request, weight)
    "generate": (whole, 4),
    "generate_stream": (streamed, 4),
    "chat_stream": (chat_streamed, 2),
    "completion": (completion, 2),
    "invalid": (invalid, 4),
    "abort_stream": (aborted_stream, 2),
    "abort_whole": (aborted_whole, 1),
}


def on_raw_socket(request, receive_timeout_s: float):
    """A raw-socket request with the signature of the others (it needs no session)."""
    async def run(session, url, rng):
        return await request(url, rng, receive_timeout_s)
    return run


def request_mix(with_hostile: bool, receive_timeout_s: float) -> dict:
    """kind: (request(session, url, rng), weight); hostile kinds only with --hostile, the adapters'
    round trip only with --loras."""
    mix = dict(MIX)
    if ADAPTERS:
        mix["lora_round_trip"] = (lora_round_trip, 1)
    if not with_hostile:
        return mix
    sockets = {kind: (on_raw_socket(request, receive_timeout_s), weight)
               for kind, (request, weight) in hostile.SOCKET_MIX.items()}
    return {**mix, **hostile.HTTP_MIX, **sockets}


def write_adapters(count: int, out: Path, model_dir: str | None) -> list[str]:
    """--loras: `count` random rank-8 adapters for the server's model (the default one when
    --model_dir is not given) in `out`; the server flags that serve them with half as many slots."""
    import torch

    from lightllm.models import read_config
    from lightllm.models.lora import module_shapes
    from lightllm.tools.bench_lora import write_adapter
    from lightllm.tools.default_model import ensure_default_model

    model = Path(model_dir) if model_dir else ensure_default_model()
    cfg = read_config(model)
    for i in range(count):
        ADAPTERS[f"soak-lora-{i}"] = str(write_adapter(out / f"lora-{i}", module_shapes(cfg), 8,
                                                       torch.float32, seed=i))
    return ["--lora_modules", *(f"{name}={path}" for name, path in ADAPTERS.items()),
            "--max_loras", str(max(1, count // 2)), "--max_lora_rank", "8"]


async def client(url: str, seed: int, deadline: float, outcomes: Outcomes, mix: dict) -> None:
    rng = random.Random(seed)
    kinds = list(mix)
    weights = [mix[kind][1] for kind in kinds]
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     trace_configs=[hostile.trace_config()]) as session:
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            start, seen, gaps = time.monotonic(), [], []
            hostile.SEEN.set(seen)
            GAPS.set(gaps)
            try:
                outcome, detail = await mix[kind][0](session, url, rng)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as exc:
                outcome, detail = "unexpected", repr(exc)
            outcomes.add(kind, outcome, time.monotonic() - start, detail, seen, gaps)


# ---- the server's state ----


def server_processes(pid: int) -> list[psutil.Process]:
    main = psutil.Process(pid)
    return [main, *main.children(recursive=True)]


def rss_mib(pid: int) -> float:
    return sum(p.memory_info().rss for p in server_processes(pid)) / 2**20


def rss_by_role(pid: int) -> dict[str, float]:
    """MiB per process of the server: HTTP (the main process), router, model workers, detokenizer
    (the first child without children of its own), helpers (the later ones, started when first
    needed: the grammar compiler, the big bodies' JSON parsers)."""
    main = psutil.Process(pid)
    roles = Counter({"http": main.memory_info().rss})
    others = []
    for child in main.children():
        if "resource_tracker" in " ".join(child.cmdline()):
            continue
        workers = child.children()
        if workers:
            roles["router"] += child.memory_info().rss
            roles["workers"] += sum(worker.memory_info().rss for worker in workers)
        else:
            others.append((child.create_time(), child.memory_info().rss))
    for i, (_, rss) in enumerate(sorted(others)):
        roles["detokenizer" if i == 0 else "helpers"] += rss
    return {role: round(rss / 2**20) for role, rss in roles.items()}


def listening_pid(port: int) -> int:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise SystemExit(f"no process of ours listens on port {port}: pass --pid")


async def metrics(session, url) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as reply:
        return metric_samples(await reply.text())


async def wait_idle(url: str, timeout_s: float = 120.0) -> dict[str, float]:
    """Wait until nothing runs or waits and every KV token is free; the last /metrics sample."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            sample = await metrics(session, url)
            idle = sample["lightllm:num_requests_running"] == 0 and sample["lightllm:num_requests_waiting"] == 0
            if (idle and sample["lightllm:kv_cache_used_tokens"] == 0) or time.monotonic() > deadline:
                return sample
            await asyncio.sleep(0.5)  # polling interval


async def health_prober(url: str, deadline: float, times: list[float]) -> None:
    """GET /health every second during the soak: it must answer 200, and at once."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while time.monotonic() < deadline:
            start = time.monotonic()
            async with session.get(f"{url}/health") as reply:
                times.append(time.monotonic() - start if reply.status == 200 else float("inf"))
            await asyncio.sleep(1.0)


async def progress(deadline: float, seconds: float, outcomes: Outcomes) -> None:
    with tqdm(total=int(seconds), unit="s", desc="soak") as bar:
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            bar.n = min(int(seconds), int(seconds - (deadline - time.monotonic())))
            by_outcome = Counter()
            for (_, outcome), count in outcomes.counts.items():
                by_outcome[outcome] += count
            bar.set_postfix(dict(by_outcome))


async def memory_sampler(pid: int, deadline: float, samples: list[float]) -> None:
    """The server's RSS once a minute during the soak (busy, so higher than idle)."""
    while time.monotonic() < deadline:
        await asyncio.sleep(min(60.0, max(0.0, deadline - time.monotonic())))
        samples.append(rss_mib(pid))


async def soak(url: str, pid: int, seconds: float, concurrency: int, seed: int, outcomes: Outcomes,
               health_times: list[float], rss_samples: list[float], mix: dict) -> None:
    deadline = time.monotonic() + seconds
    tasks = [client(url, seed * 1000 + i, deadline, outcomes, mix) for i in range(concurrency)]
    await asyncio.gather(*tasks, health_prober(url, deadline, health_times), progress(deadline, seconds, outcomes),
                         memory_sampler(pid, deadline, rss_samples))


# ---- the report ----


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


ROLES = ("http", "router", "detokenizer", "helpers", "workers")


def memory_table(states: dict[str, dict]) -> list[str]:
    """RSS per process and KV tokens in use, one column per idle sample (idle, after warm-up, end)."""
    lines = ["| idle sample | " + " | ".join(states) + " |", "|---" * (len(states) + 1) + "|"]
    for role in ROLES:
        cells = " | ".join(str(state["by_role"].get(role, 0)) for state in states.values())
        lines.append(f"| RSS {role}, MiB | {cells} |")
    lines.append("| RSS all, MiB | " + " | ".join(f"{state['rss_mib']:.0f}" for state in states.values()) + " |")
    lines.append("| KV tokens in use | " + " | ".join(f"{state['kv']:.0f}" for state in states.values()) + " |")
    return lines


def status_table(statuses: Counter) -> list[str]:
    """Every non-2xx answer by route and status, expected ones (4xx the request asked for) first."""
    if not statuses:
        return ["Non-2xx answers: none"]
    lines = ["| non-2xx | route | status | count |", "|---|---|---|---|"]
    for (route, status, expected), count in sorted(statuses.items(), key=lambda item: (not item[0][2], item[0][:2])):
        lines.append(f"| {'expected' if expected else 'UNEXPECTED'} | {route} | {status} | {count} |")
    return lines


def gap_check(gaps: list[float], max_ratio: float) -> tuple[str, bool]:
    """The normal streams' longest gap between tokens against max_ratio x their median gap."""
    if not gaps:
        return "Normal streams' gaps between tokens: none measured", True
    median, longest = statistics.median(gaps), max(gaps)
    ok = longest <= max_ratio * median
    return (f"Normal streams' gaps between tokens: median {median * 1000:.1f} ms, longest {longest * 1000:.0f} ms "
            f"({longest / median:.0f}x the median; bound {max_ratio:g}x: {'ok' if ok else 'EXCEEDED'}), "
            f"{len(gaps)} gaps"), ok


def report(args, mix: dict, outcomes: Outcomes, states: dict[str, dict], health_times: list[float],
           rss_samples: list[float], elapsed: float) -> tuple[str, bool]:
    mode = "normal + hostile mix" if args.hostile else "normal mix"
    lines = [f"Soak: {elapsed / 60:.1f} min, {mode}, {args.concurrency} clients, seed {args.seed}, server {args.url}", ""]
    lines += ["| request | ok | rejected (4xx) | aborted | unexpected | p50 s | p99 s |", "|---|---|---|---|---|---|---|"]
    total = Counter()
    for kind in mix:
        row = {outcome: outcomes.counts[kind, outcome] for outcome in ("ok", "rejected", "aborted", "unexpected")}
        total.update(row)
        done = outcomes.latencies[kind]
        p50, p99 = (f"{percentile(done, 0.5):.3f}", f"{percentile(done, 0.99):.3f}") if done else ("-", "-")
        lines.append(f"| {kind} | {row['ok']} | {row['rejected']} | {row['aborted']} | {row['unexpected']} | {p50} | {p99} |")
    all_ok = [s for kind in mix for s in outcomes.latencies[kind]]
    lines.append(f"| all | {total['ok']} | {total['rejected']} | {total['aborted']} | {total['unexpected']} "
                 f"| {percentile(all_ok, 0.5):.3f} | {percentile(all_ok, 0.99):.3f} |")
    start, end = states["after warm-up"], states["end"]
    growth = end["rss_mib"] / start["rss_mib"] - 1.0
    gap_line, gaps_ok = gap_check(outcomes.gaps, args.max_gap_ratio)
    lines += ["", *memory_table(states), "", *status_table(outcomes.statuses), "", gap_line,
              f"Requests: {sum(total.values())} ({sum(total.values()) / elapsed:.1f}/s); "
              f"/health: {len(health_times)} probes, p99 {percentile(health_times, 0.99) * 1000:.0f} ms, "
              f"max {max(health_times, default=0) * 1000:.0f} ms",
              f"RSS growth, warm-up to end: {growth:+.1%} (bound {args.max_rss_growth:+.0%}); "
              f"while busy, once a minute, MiB: {', '.join(f'{mib:.0f}' for mib in rss_samples)}",
              f"KV tokens in use when idle at the end: {end['kv']:.0f} of {end['kv_total']:.0f}; "
              f"requests running/waiting: {end['running']:.0f}/{end['waiting']:.0f}; "
              f"preemptions (--schedule_policy priority): {end['preemptions']:.0f}"]
    if outcomes.unexpected:
        lines += ["", "Unexpected answers (first 20):", *[f"- {line}" for line in outcomes.unexpected]]
    healthy_probes = all(t < 1.0 for t in health_times)
    passed = (total["unexpected"] == 0 and end["kv"] == 0 and growth <= args.max_rss_growth and healthy_probes
              and gaps_ok)
    lines += ["", "PASS" if passed else "FAIL"]
    return "\n".join(lines), passed


async def idle_state(url: str, pid: int) -> dict:
    sample = await wait_idle(url)
    return {"rss_mib": rss_mib(pid), "by_role": rss_by_role(pid), "kv": sample["lightllm:kv_cache_used_tokens"], "kv_total": sample["lightllm:kv_cache_capacity_tokens"],
            "running": sample["lightllm:num_requests_running"], "waiting": sample["lightllm:num_requests_waiting"],
            "preemptions": sample.get("lightllm:num_preemptions_total", 0)}


def run(args) -> bool:
    pid = args.pid or listening_pid(int(args.url.rsplit(":", 1)[1].split("/")[0]))
    mix = request_mix(args.hostile, args.request_receive_timeout)
    states = {"idle": asyncio.run(idle_state(args.url, pid))}
    asyncio.run(soak(args.url, pid, args.warmup_s, args.concurrency, args.seed + 1, Outcomes(), [], [], mix))
    states["after warm-up"] = asyncio.run(idle_state(args.url, pid))
    logger.info("after warm-up: %s", states["after warm-up"])
    outcomes, health_times, rss_samples = Outcomes(), [], []
    began = time.monotonic()
    asyncio.run(soak(args.url, pid, args.minutes * 60, args.concurrency, args.seed, outcomes, health_times, rss_samples,
                     mix))
    elapsed = time.monotonic() - began
    states["end"] = asyncio.run(idle_state(args.url, pid))
    text, passed = report(args, mix, outcomes, states, health_times, rss_samples, elapsed)
    print(text)
    if args.report:
        Path(args.report).write_text(text + "\n")
    return passed


def stop_server(server: ServerProcess) -> bool:
    """SIGTERM; True if it exited 0 and left no socket directory."""
    from lightllm.utils.net import socket_dirs

    code = server.stop(timeout=120)
    left = socket_dirs(server.proc.pid)
    logger.info("server exited with %d; socket directories left: %s", code, left)
    return code == 0 and not left


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--url", help="a running server; absent: start one on the default model")
    parser.add_argument("--pid", type=int, help="the server's main process (found from the URL's port when absent)")
    parser.add_argument("--server_args", default="", help="flags for the server this script starts")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending one request after another")
    parser.add_argument("--warmup_s", type=float, default=30.0, help="seconds of the same mix before the start sample")
    parser.add_argument("--max_rss_growth", type=float, default=0.10, help="largest accepted RSS growth, as a fraction")
    parser.add_argument("--max_gap_ratio", type=float, default=100.0,
                        help="fail when a normal stream's longest gap between tokens exceeds this x their median gap")
    parser.add_argument("--hostile", action=argparse.BooleanOptionalAction, default=True,
                        help="add the hostile mix (hostile.py) beside the normal one")
    parser.add_argument("--request_receive_timeout", type=float, default=5.0,
                        help="seconds: given to a server this script starts; with --url, the server's own value")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--priorities", action="store_true",
                        help="the OpenAI routes' requests carry a random priority in [-2, 2] (a server with "
                             "--schedule_policy priority preempts running requests for more urgent ones)")
    parser.add_argument("--loras", type=int, default=0,
                        help="serve this many random adapters (a server this script starts) and send requests to them")
    parser.add_argument("--report", help="also write the report to this file")
    args = parser.parse_args()
    PRIORITIES[0] = args.priorities
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.url:
        if args.loras:
            parser.error("--loras needs a server this script starts (no --url)")
        return 0 if run(args) else 1
    port = free_port()
    server_args = args.server_args.split()  # a JSON value without spaces stays whole
    with tempfile.TemporaryDirectory(prefix="soak-loras-") as adapters:
        if args.loras:
            model_dir = server_args[server_args.index("--model_dir") + 1] if "--model_dir" in server_args else None
            server_args += write_adapters(args.loras, Path(adapters), model_dir)
        if "--request_receive_timeout" not in server_args:
            server_args += ["--request_receive_timeout", str(args.request_receive_timeout)]
        server = start_server(server_args, Path(tempfile.gettempdir()) / f"soak-server-{port}.log",
                              timeout=600, port=port)
        args.url = server.url
        try:
            args.pid = server.proc.pid
            passed = run(args)
        finally:
            clean_stop = stop_server(server)
    print(f"server stopped with SIGTERM: {'exit 0, no socket directory left' if clean_stop else 'NOT clean'}")
    return 0 if passed and clean_stop else 1


if __name__ == "__main__":
    sys.exit(main())
