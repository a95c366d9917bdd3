"""Start and stop a real server (all its processes) on a free loopback port, for tests.

Starting, polling /health and stopping are test/benchmark/lib/server_process.py's, shared with the
benchmark scripts; what tests add is looking inside (processes, log lines, requests)."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import threading
import time
from pathlib import Path

import psutil
import requests

from benchmark.lib import server_process
from benchmark.lib.server_process import ServerProcess

from lightllm.utils.net import socket_dirs


@contextlib.asynccontextmanager
async def wired_manager(config):
    """An HttpServerManager of `config` (addresses allocated here) started on its sockets, with
    the router's end (PULL: what the manager sends) and the detokenizer's end (PUSH: into the
    manager); yields (manager, router, to_http), then stops and closes all of them."""
    import zmq
    import zmq.asyncio

    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.httpserver.metrics import Metrics

    config = config.with_addresses()
    router = zmq.asyncio.Context.instance().socket(zmq.PULL)
    router.bind(config.router_addresses[0])
    to_http = zmq.asyncio.Context.instance().socket(zmq.PUSH)
    manager = HttpServerManager(config, Metrics([100]), heartbeats=[])
    await manager.start()
    to_http.connect(config.http_address)
    try:
        yield manager, router, to_http
    finally:
        await manager.stop()
        router.close(linger=0)
        to_http.close(linger=0)
        shutil.rmtree(config.socket_dir, ignore_errors=True)


class Server(ServerProcess):
    def __init__(self, args: list[str], log_path: Path, own_process_group: bool = False):
        """`own_process_group`: a session of its own, so that a test can signal the whole group."""
        super().__init__(args, log_path, own_session=own_process_group)

    def wait_for_log_line(self, text: str, timeout: float = 300.0) -> str:
        """The first line of the server's log that contains `text`, as soon as it is written."""
        def found() -> str | None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-5000:]}")
            return next((line for line in self.log_text().splitlines() if text in line), None)

        return self.wait_for(found, timeout, what=f"a log line with {text!r}")

    def processes(self) -> list[psutil.Process]:
        """The main process and every descendant (router, detokenizer, model workers, ...)."""
        main = psutil.Process(self.proc.pid)
        return [main, *main.children(recursive=True)]

    def model_workers(self) -> list[psutil.Process]:
        """Grandchildren: the router's children."""
        return [p for child in psutil.Process(self.proc.pid).children() for p in child.children()]

    def router(self) -> psutil.Process:
        """The main process's child that runs the model workers."""
        (router,) = {worker.parent() for worker in self.model_workers()}
        return router

    def socket_dirs(self) -> list[Path]:
        """The server's ZeroMQ socket directories in /tmp (one while it runs, none after)."""
        return socket_dirs(self.proc.pid)

    def wait_for_structured_output(self, processes: int = 2) -> None:
        """Until the HTTP process and the model runners have built their structured output, which
        they do in the background once the server serves (it holds each process's GIL a while)."""
        self.wait_for(lambda: self.log_text().count("structured output ready") >= processes, timeout=120,
                      what="structured output ready in the HTTP process and the model runners")

    def health(self, timeout: float = 30.0) -> int | None:
        """The status code of GET /health; None when nothing listens any more."""
        try:
            return requests.get(f"{self.url}/health", timeout=timeout).status_code
        except requests.ConnectionError:
            return None

    def stream(self, body: dict, path: str = "/generate_stream", timeout: float = 120.0) -> requests.Response:
        return requests.post(f"{self.url}{path}", data=json.dumps(body), stream=True, timeout=timeout)

    def post(self, path: str, body, timeout: float = 120.0) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return requests.post(f"{self.url}{path}", data=data, timeout=timeout)

    def generate(self, prompt: str, **params) -> dict:
        response = self.post("/generate", {"inputs": prompt, "parameters": params})
        assert response.status_code == 200, response.text
        return response.json()

    def wait_for(self, condition, timeout: float = 30.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(0.05)  # polling interval, not synchronisation
        raise TimeoutError(f"{what} did not hold within {timeout}s")

    def stop(self) -> int:
        """SIGTERM the main process; every process of the server must be gone afterwards."""
        try:
            family = self.processes()
        except psutil.NoSuchProcess:
            family = []
        code = super().stop()
        gone, alive = wait_exited(family, timeout=15)
        for proc in alive:
            proc.kill()
        assert not alive, f"processes outlived the server: {alive}"
        return code


def wait_exited(processes: list[psutil.Process], timeout: float) -> tuple[list, list]:
    """(exited, still running) as psutil.wait_procs, with a zombie counted as exited: it has ended
    and holds nothing but its process table entry. A server's child whose parent ended first (the
    multiprocessing resource tracker always: it ends once the last process holding its pipe has)
    is reaped by init, which here does so only every second or two; waiting for that reaping cost
    every server stop about 1.5 s."""
    deadline = time.monotonic() + timeout
    running = list(processes)
    while True:
        running = [proc for proc in running if still_running(proc)]
        if not running or time.monotonic() >= deadline:
            return [proc for proc in processes if proc not in running], running
        time.sleep(0.02)  # polling interval, not synchronisation


def still_running(proc: psutil.Process) -> bool:
    """Alive and not a zombie; a child of this process is reaped here (psutil's wait does it)."""
    try:
        proc.wait(timeout=0)
        return False
    except psutil.TimeoutExpired:
        pass
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sse_events(response: requests.Response):
    """The JSON events of a text/event-stream response, each as it arrives."""
    for line in response.iter_lines():
        if line.startswith(b"data:"):
            yield json.loads(line[len(b"data:"):])


class StreamArrivals:
    """A /generate_stream read on a thread of its own: `arrivals` holds each event's arrival time."""

    def __init__(self, server: Server, body: dict):
        self.arrivals: list[float] = []
        self._stream = server.stream(body)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):  # close() shuts the stream under it
            for _ in sse_events(self._stream):
                self.arrivals.append(time.monotonic())

    def close(self) -> None:
        self._stream.close()
        self._reader.join(30)

    def gaps(self) -> list[tuple[float, float]]:
        """(gap, arrival of its later event) between consecutive events."""
        return [(b - a, b) for a, b in zip(self.arrivals, self.arrivals[1:])]


def slow_schema(strings: int = 40) -> dict:
    """Patterned strings: 40 take several seconds to compile against a 49152-token vocabulary (one
    thread; 20 about 1 s, 80 about 17 s on a 2-core CPU). A random tag keeps it out of any cache."""
    tag = random.randrange(10**6)
    properties = {f"p{i}_{tag}": {"type": "string", "pattern": f"[a-z]{{1,{i + 3}}}x[0-9]{{2,7}}"}
                  for i in range(strings)}
    return {"type": "object", "properties": properties, "required": list(properties)}


def ref_chain(refs: int) -> dict:
    """A JSON schema of `refs` $refs, each to the next, as test/benchmark/serving/hostile_requests.py's:
    about 35 bytes a $ref; its compiled grammar grows as the square of `refs`."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(refs)}
    defs[f"d{refs}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def start_server(args: list[str], log_path: Path, own_process_group: bool = False) -> Server:
    return server_process.start_server(args, log_path, server_class=Server, own_process_group=own_process_group)


@contextlib.contextmanager
def preset_server(tmp_path_factory, preset: str, args: tuple[str, ...] = ()):
    """(model directory, server) of a bench_model preset (random weights) on a free port, with
    any further server `args`; the server must stop with status 0."""
    from lightllm.tools.bench_model import write_bench_model

    model_dir = write_bench_model(tmp_path_factory.mktemp(preset), preset)
    server = start_server(["--model_dir", str(model_dir), *args], tmp_path_factory.mktemp("server") / "server.log")
    yield model_dir, server
    assert server.stop() == 0


def openai_client(url: str, timeout: float = 120):
    """An OpenAI client for a test server, without retries (a 5xx must fail the test), whose idle
    connections expire before the server's keep-alive timeout (5 s) closes them: with both at 5 s
    a request sent on a connection the server was closing found it gone."""
    import openai
    from openai._base_client import DEFAULT_CONNECTION_LIMITS

    default = DEFAULT_CONNECTION_LIMITS
    limits = type(default)(max_connections=default.max_connections,
                           max_keepalive_connections=default.max_keepalive_connections, keepalive_expiry=2.0)
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout,
                         http_client=openai.DefaultHttpxClient(limits=limits))
