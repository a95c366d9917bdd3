"""Costly grammar requests against a server, beside a normal stream: what each costs the others.

    python test/benchmark/serving/hostile_requests.py                       # starts a server on the default model
    python test/benchmark/serving/hostile_requests.py --tree /tmp/old       # ... of another checkout's tree
    python test/benchmark/serving/hostile_requests.py --url http://127.0.0.1:8000 --pid PID

Cases, after controls (a plain 2-token /generate: what the probes alone cost the stream; the same
chat and Anthropic requests without their grammar or tools: what a request of that shape costs,
its prompt's prefill above all, which on a CPU takes several decode steps' time): a --refs_within
chain of `$ref`s that fits the size bound on grammars, a forced tool call (`tool_choice:
"required"`, Anthropic's {"type": "any"}) over --tools functions, --distinct chains that compile
(what the caches keep), and a JSON schema that is a chain of --refs `$ref`s, sent twice (the
second finds whatever the first left compiled). Each case runs while a normal stream generates:
it reports the answer's status and time, the peak and after-case
RSS of each server process, the stream's longest gap between tokens against its median, and the
slowest 2-token /generate sent during the case against the idle one, both also against the
control of the case's shape (what the grammar or the tools add). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from benchmark.lib.server_process import free_port, start_server  # noqa: E402

logger = logging.getLogger("hostile_requests")


def tools(count: int) -> list[dict]:
    """Small functions (about 120 bytes each), so that 1000 of them fit the prompt's character bound."""
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": parameters}} for i in range(count)]


def ref_chain(refs: int) -> dict:
    """A schema of `refs` $refs, each to the next, the last to a string (about 35 bytes a $ref)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(refs)}
    defs[f"d{refs}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


IDLE_S = 2.0  # after a case, before its RSS "after": a CPU worker gives its free heap back when idle
PLAIN_CHAT, PLAIN_MESSAGES = "control: the chat alone", "control: the messages alone"


def cases(args) -> list[tuple[str, str, dict, str | None]]:
    """(name, path, body (a list: sent one after another), the name of the control of its shape) of
    each case, in order."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    chain = {"type": "json_schema", "json_schema": {"name": "chain", "schema": ref_chain(args.refs)}}
    chat_chain = {"messages": question, "max_tokens": 16, "response_format": chain}
    within = {"messages": question, "max_tokens": 16, "response_format": {
        "type": "json_schema", "json_schema": {"name": "chain", "schema": ref_chain(args.refs_within)}}}
    return [
        ("control: a 2-token /generate", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}, None),
        (PLAIN_CHAT, "/v1/chat/completions", {"messages": question, "max_tokens": 16}, None),
        (PLAIN_MESSAGES, "/v1/messages", {"model": args.model, "messages": question, "max_tokens": 16}, None),
        (f"{args.refs_within}-$ref chain", "/v1/chat/completions", within, PLAIN_CHAT),
        (f"chat, {args.tools} tools, required", "/v1/chat/completions",
         {"messages": question, "tools": tools(args.tools), "tool_choice": "required", "max_tokens": 16}, PLAIN_CHAT),
        (f"messages, {args.tools} tools, any", "/v1/messages",
         {"model": args.model, "messages": question, "max_tokens": 16, "tool_choice": {"type": "any"},
          "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                    for t in tools(args.tools)]}, PLAIN_MESSAGES),
        (f"{args.distinct} distinct {args.refs_distinct}-$ref chains", "/v1/chat/completions",
         [{**within, "response_format": {"type": "json_schema", "json_schema": {
             "name": "chain", "schema": ref_chain(args.refs_distinct - i)}}} for i in range(args.distinct)], PLAIN_CHAT),
        (f"{args.refs}-$ref chain, first", "/v1/chat/completions", chat_chain, PLAIN_CHAT),
        (f"{args.refs}-$ref chain, again", "/v1/chat/completions", chat_chain, PLAIN_CHAT),
    ]


class Roles:
    """The server's processes by role: main (HTTP), router, workers, detokenizer (the first other
    child), helpers (later ones: the grammar compiler, the big bodies' JSON parsers);
    multiprocessing's resource tracker aside."""

    def __init__(self, pid: int):
        self.pid = pid

    def rss_mb(self) -> dict[str, float]:
        main = psutil.Process(self.pid)
        rss = {"main": main.memory_info().rss}
        others = []
        for child in main.children():
            try:
                grandchildren = child.children()
                if grandchildren:
                    rss["router"] = rss.get("router", 0) + child.memory_info().rss
                    rss["workers"] = rss.get("workers", 0) + sum(p.memory_info().rss for p in grandchildren)
                elif "resource_tracker" not in " ".join(child.cmdline()):
                    others.append((child.create_time(), child.pid, child.memory_info().rss))
            except psutil.Error:  # a child that came and went
                continue
        for i, (_, _, child_rss) in enumerate(sorted(others)):
            role = "detokenizer" if i == 0 else "helpers"
            rss[role] = rss.get(role, 0) + child_rss
        return {role: value / 1e6 for role, value in rss.items()}


class Stream:
    """A normal /generate_stream, its tokens' arrival times."""

    def __init__(self, url: str):
        self.arrivals: list[float] = []
        body = {"inputs": "Tell me a long story.", "parameters": {"max_new_tokens": 2500, "ignore_eos": True}}
        self._response = requests.post(f"{url}/generate_stream", json=body, stream=True, timeout=600)
        self._response.raise_for_status()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self._response.iter_lines():
                if line.startswith(b"data:"):
                    self.arrivals.append(time.monotonic())
        except Exception:  # closed under it (requests' or urllib3's error, as the close lands)
            pass

    def gaps(self, start: float, end: float) -> list[float]:
        times = list(self.arrivals)
        return [b - a for a, b in zip(times, times[1:]) if start <= b <= end]

    def close(self) -> None:
        self._response.close()


def two_tokens(url: str) -> float:
    start = time.monotonic()
    reply = requests.post(f"{url}/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}, timeout=600)
    reply.raise_for_status()
    return time.monotonic() - start


def run_case(url: str, roles: Roles, path: str, body: dict, settle_s: float) -> dict:
    """Send the request beside a stream and 2-token probes; watch RSS until `settle_s` after its answer."""
    stream = Stream(url)
    while len(stream.arrivals) < 20:
        time.sleep(0.05)  # polling interval
    baseline = stream.gaps(0, time.monotonic())
    peak: dict[str, float] = {}
    probes: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for role, mb in roles.rss_mb().items():
                peak[role] = max(peak.get(role, 0), mb)
            time.sleep(0.2)  # sampling interval

    def probe() -> None:
        while not done.is_set():
            probes.append(two_tokens(url))

    threads = [threading.Thread(target=watch, daemon=True), threading.Thread(target=probe, daemon=True)]
    for thread in threads:
        thread.start()
    sent = time.monotonic()
    for one in body if isinstance(body, list) else [body]:  # a list: one after another
        reply = requests.post(f"{url}{path}", json=one, timeout=600)
    seconds = time.monotonic() - sent
    time.sleep(settle_s)  # the server's work after the answer (a compile left running) shows here
    done.set()
    for thread in threads:
        thread.join()
    during = stream.gaps(sent, time.monotonic())
    stream.close()
    time.sleep(IDLE_S)  # the server idle again: RSS "after" is what it keeps
    return {"status": reply.status_code, "seconds": seconds, "error": reply.text[:160] if reply.status_code >= 400 else "",
            "peak_mb": peak, "after_mb": roles.rss_mb(), "gap_max": max(during, default=0.0),
            "gap_median": statistics.median(baseline), "probe_max": max(probes, default=0.0)}


def against(value: float, control: dict | None, key: str) -> str:
    return f", {value / control[key]:.2f}x control" if control else ""


def report(idle_mb: dict, idle_probe: float, results: list[tuple[str, dict, str | None]]) -> str:
    """One row a case; gap and probe also as a multiple of the control of the case's shape."""
    roles = sorted({role for _, r, _ in results for role in r["peak_mb"]} | set(idle_mb))
    head = ("| case | status | time s | longest gap s (median) | 2-token /generate s (idle "
            f"{idle_probe:.2f}) | " + " | ".join(f"{r} MB peak / after" for r in roles) + " |")
    lines = [head, "|" + " --- |" * (5 + len(roles)),
             "| idle | | | | | " + " | ".join(f"{idle_mb.get(r, 0):.0f}" for r in roles) + " |"]
    by_name = {name: r for name, r, _ in results}
    for name, r, control_name in results:
        control = by_name.get(control_name)
        rss = " | ".join(f"{r['peak_mb'].get(role, 0):.0f} / {r['after_mb'].get(role, 0):.0f}" for role in roles)
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.1f} | {r['gap_max']:.2f} ({r['gap_median']:.3f}"
                     f"{against(r['gap_max'], control, 'gap_max')}) "
                     f"| {r['probe_max']:.2f}{against(r['probe_max'], control, 'probe_max')} | {rss} |")
    errors = [f"{name}: {r['error']}" for name, r, _ in results if r["error"]]
    return "\n".join(lines + [""] + errors)


def run(args) -> str:
    roles = Roles(args.pid)
    args.model = requests.get(f"{args.url}/v1/models", timeout=60).json()["data"][0]["id"]
    two_tokens(args.url)  # warm
    idle_probe = statistics.median(two_tokens(args.url) for _ in range(5))
    idle_mb = roles.rss_mb()
    chosen = [case for case in cases(args) if not args.only or args.only in case[0]]
    controls = {control for *_, control in chosen}
    results = []
    for name, path, body, control in cases(args):  # in order: a chosen case's control runs before it
        if (name, path, body, control) not in chosen and name not in controls:
            continue
        logger.info("case: %s (%d bytes)", name, len(json.dumps(body)))
        results.append((name, run_case(args.url, roles, path, body, args.settle_s), control))
        logger.info("%s", results[-1][1])
    return report(idle_mb, idle_probe, results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server; absent: start one on the default model")
    parser.add_argument("--pid", type=int, help="with --url: the server's main process")
    parser.add_argument("--tree", help="start the server from this checkout's tree (PYTHONPATH), not this one's")
    parser.add_argument("--model_dir", help="the server's model (default: the default model)")
    parser.add_argument("--server_args", default="", help="more flags for the server this script starts")
    parser.add_argument("--tools", type=int, default=1000)
    parser.add_argument("--refs", type=int, default=3000)
    parser.add_argument("--refs_within", type=int, default=1700, help="a chain within today's 64 KiB bound")
    parser.add_argument("--distinct", type=int, default=24, help="grammars of the distinct-chains case, each compiled and kept")
    parser.add_argument("--refs_distinct", type=int, default=700, help="$refs of its longest chain (one fewer each)")
    parser.add_argument("--only", help="run only the cases whose name holds this text (and their controls)")
    parser.add_argument("--settle_s", type=float, default=10.0, help="seconds watched after each answer")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.url:
        print(run(args))
        return 0
    if args.model_dir is None:
        from lightllm.tools.default_model import ensure_default_model

        args.model_dir = str(ensure_default_model())
    port = free_port()
    env = {**os.environ, "PYTHONPATH": args.tree} if args.tree else None
    server = start_server(["--model_dir", args.model_dir, *args.server_args.split()],
                          Path(tempfile.gettempdir()) / f"hostile-server-{port}.log", timeout=600, port=port,
                          cwd=args.tree, env=env)
    args.url, args.pid = server.url, server.proc.pid
    try:
        print(run(args))
    finally:
        server.stop(timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
