"""Start and stop a real server (all its processes) on a free loopback port, for tests."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

from lightllm.utils.net import free_port, socket_dirs

logger = logging.getLogger(__name__)


class Server:
    def __init__(self, args: list[str], log_path: Path, own_process_group: bool = False):
        """`own_process_group`: a session of its own, so that a test can signal the whole group."""
        self.port = free_port()
        scheme = "https" if "--ssl_certfile" in args else "http"  # the test trusts the certificate (REQUESTS_CA_BUNDLE)
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "lightllm.server.api_server", "--port", str(self.port), *args]
        logger.info("starting %s (log: %s)", " ".join(cmd), log_path)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=own_process_group)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-5000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=30).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):  # a connection waits while the model loads
                pass
            time.sleep(0.2)  # polling interval, not synchronisation
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log_text()[-5000:]}")

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

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics, by name."""
        text = requests.get(f"{self.url}/metrics", timeout=30).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        gone, alive = psutil.wait_procs(family, timeout=15)
        for proc in alive:
            proc.kill()
        self._log.close()
        assert not alive, f"processes outlived the server: {alive}"
        return code


def sse_events(response: requests.Response):
    """The JSON events of a text/event-stream response, each as it arrives."""
    for line in response.iter_lines():
        if line.startswith(b"data:"):
            yield json.loads(line[len(b"data:"):])


def start_server(args: list[str], log_path: Path, own_process_group: bool = False) -> Server:
    server = Server(args, log_path, own_process_group)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server
