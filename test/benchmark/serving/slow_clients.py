"""Hostile and slow clients against a running server: bodies that take long to
parse or validate, requests that never finish arriving, clients that hang up, and what each writes
to the server's log. One row a case: HTTP status (or what the socket did), seconds, the size of the
answer, the HTTP process's RSS before and after, and /health's latency while the case ran (median
and worst, against its idle median).

    python test/benchmark/serving/slow_clients.py --url http://127.0.0.1:8000 --pid PID --log server.log

`--pid`: the server's main process (the HTTP process); `--log`: its log file, read for tracebacks,
access lines of /health and the tokenizer's length warning. Start the server with short
`--request_receive_timeout` and `--max_connections` to see those bounds quickly (an older tree has
neither flag: its sockets stay open until --wait runs out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import threading
import time
import urllib.parse

import psutil
import requests


class HealthProbe:
    """/health, every 50 ms on a thread, while a case runs: its latencies in seconds."""

    def __init__(self, url: str):
        self.url, self.times, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            with contextlib.suppress(requests.RequestException):
                requests.get(f"{self.url}/health", timeout=60)
            self.times.append(time.monotonic() - start)
            self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def raw_connection(url: str, timeout: float) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def answer_of(sock: socket.socket) -> str:
    """The status line's code, 'closed' (EOF without an answer) or 'no answer' (the read timed out)."""
    try:
        data = sock.recv(65536)
    except socket.timeout:
        return "no answer"
    except ConnectionResetError:
        return "reset"
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"


def post(url: str, path: str, body: bytes) -> tuple[str, int]:
    response = requests.post(f"{url}{path}", data=body, headers={"Content-Type": "application/json"}, timeout=600)
    return str(response.status_code), len(response.content)


def unknown_keys_body(keys: int) -> bytes:
    return json.dumps({"inputs": "hi", **{f"k{i}": 1 for i in range(keys)}}, separators=(",", ":")).encode()


def logit_bias_body(keys: int) -> bytes:
    return json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 2,
                                                      "logit_bias": {str(i): 1 for i in range(keys)}}},
                      separators=(",", ":")).encode()


def three_at_once(url: str, body: bytes) -> tuple[str, int]:
    """Three unknown-key bodies at once, and a 2-token /generate among them: its time."""
    threads = [threading.Thread(target=post, args=(url, "/generate", body)) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # let the three reach the server first
    start = time.monotonic()
    status, _ = post(url, "/generate", json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 2}}).encode())
    took = time.monotonic() - start
    for thread in threads:
        thread.join()
    return f"{status} ({took:.2f} s for /generate)", 0


def stalled(url: str, wait: float, head: bytes, body: bytes = b"", trickle: list[bytes] | None = None) -> tuple[str, int]:
    """Send `head` and `body`, then nothing (or one line of `trickle` a second): what the server does."""
    with raw_connection(url, wait) as sock:
        sock.sendall(head + body)
        if trickle:
            sock.settimeout(1.0)
            deadline = time.monotonic() + wait
            for line in trickle * int(wait):
                if time.monotonic() > deadline:
                    return "no answer", 0
                try:
                    if answer := sock.recv(65536):
                        return answer.split(b" ", 2)[1].decode(), 0
                    return "closed", 0
                except socket.timeout:
                    sock.sendall(line)
                except (ConnectionResetError, BrokenPipeError):
                    return "reset", 0
        return answer_of(sock), 0


def idle_keep_alive(url: str, wait: float) -> tuple[str, int]:
    """One request, then silence: when the server closes the connection."""
    with raw_connection(url, wait) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while not data.endswith(b"}"):  # the whole answer: headers, then {"status":"ok"}
            data += sock.recv(65536)
        start = time.monotonic()
        try:
            closed = sock.recv(65536) == b""
        except socket.timeout:
            return "open", 0
        return (f"closed after {time.monotonic() - start:.1f} s" if closed else "data"), 0


def connections(url: str, count: int) -> tuple[str, int]:
    """`count` idle connections, then one more that asks for /health: its answer."""
    held = [raw_connection(url, 10) for _ in range(count)]
    try:
        with raw_connection(url, 10) as sock:
            time.sleep(0.5)  # a bound on connections answers before the request is sent
            with contextlib.suppress(OSError):
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            return f"{count + 1}th: {answer_of(sock)}", 0
    finally:
        for sock in held:
            sock.close()


def hang_up_mid_body(url: str, times: int) -> tuple[str, int]:
    for _ in range(times):
        with raw_connection(url, 10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"inputs\": ")
            time.sleep(0.1)  # the server starts reading the body before the client goes
    time.sleep(1.0)  # the server notices and logs
    return "sent", 0


def health_probes(url: str, times: int) -> tuple[str, int]:
    for _ in range(times):
        requests.get(f"{url}/health", timeout=30)
    time.sleep(0.5)
    return "200", 0


def over_long_prompt(url: str) -> tuple[str, int]:
    """10,000 tokens: past the default model's model_max_length (8192), under the character bound."""
    return post(url, "/generate", json.dumps({"inputs": "word " * 10_000}).encode())


LOG_MARKS = {"tracebacks": "Traceback", "/health access lines": '"GET /health', "tokenizer warnings": "Token indices sequence length"}


def cases(args) -> list[tuple[str, callable]]:
    url, wait = args.url, args.wait
    unknown = unknown_keys_body(600_000)
    return [
        ("3. 600k unknown keys (7.2 MB)", lambda: post(url, "/generate", unknown)),
        ("3. three of them + 2-token /generate", lambda: three_at_once(url, unknown)),
        ("3. 700k logit_bias keys", lambda: post(url, "/generate", logit_bias_body(700_000))),
        ("4. Content-Length 1000, 10 bytes sent", lambda: stalled(
            url, wait, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
            b'{"inputs":')),
        ("4. chunk size 1000, 10 bytes sent", lambda: stalled(
            url, wait, b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n", b'{"inputs":')),
        ("4. headers a line a second", lambda: stalled(url, wait, b"POST /generate HTTP/1.1\r\n",
                                                       trickle=[b"X-Slow: 1\r\n"])),
        ("4. idle keep-alive", lambda: idle_keep_alive(url, wait)),
        (f"4. {args.connections} idle connections + 1", lambda: connections(url, args.connections)),
        ("5. 20 hang-ups mid-body", lambda: hang_up_mid_body(url, 20)),
        ("5. 20 /health probes", lambda: health_probes(url, 20)),
        ("5. over-long prompt (10,000 words)", lambda: over_long_prompt(url)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--pid", type=int, required=True, help="the server's main (HTTP) process")
    parser.add_argument("--log", required=True, help="the server's log file")
    parser.add_argument("--wait", type=float, default=45.0, help="seconds to wait for an answer to a stalled request")
    parser.add_argument("--connections", type=int, default=100, help="idle connections opened before one more")
    parser.add_argument("--only", default="", help="run only the cases whose name holds this text")
    args = parser.parse_args()
    idle = []
    for _ in range(20):
        start = time.monotonic()
        requests.get(f"{args.url}/health", timeout=30)
        idle.append(time.monotonic() - start)
    idle_ms = statistics.median(idle) * 1000
    print(f"/health idle: median {idle_ms:.1f} ms\n")
    print("| case | status | s | answer bytes | RSS MB before -> after | /health median / worst ms | log |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, run in (case for case in cases(args) if args.only in case[0]):
        log_before = open(args.log, errors="replace").read()
        rss_before = rss_mb(args.pid)
        start = time.monotonic()
        with HealthProbe(args.url) as probe:
            status, size = run()
        took = time.monotonic() - start
        added = open(args.log, errors="replace").read()[len(log_before):]
        marks = ", ".join(f"{added.count(mark)} {what}" for what, mark in LOG_MARKS.items() if added.count(mark))
        health = f"{statistics.median(probe.times) * 1000:.0f} / {max(probe.times) * 1000:.0f}" if probe.times else "-"
        print(f"| {name} | {status} | {took:.2f} | {size} | {rss_before:.0f} -> {rss_mb(args.pid):.0f} | {health} | "
              f"{marks or '-'} |", flush=True)


if __name__ == "__main__":
    main()
