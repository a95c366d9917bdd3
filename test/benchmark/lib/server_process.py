"""A server in a subprocess: start it, wait until /health answers 200, read /metrics, stop it.

The one way the tests (tests/server_utils.py) and the benchmark scripts (soak, compare,
frontend_bench) run a server. It imports nothing of lightllm: compare.py starts servers of other
checkouts (an older commit's tree) with it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric_samples(text: str) -> dict[str, float]:
    """Every sample of a /metrics page by its name as written there, labels included:
    'lightllm:num_requests_running', 'lightllm:request_success_total{finished_reason="abort"}'."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sample.labels.items())
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, port: int | None = None, *, own_session: bool = False,
                 preexec_fn=None, cwd: str | None = None, entry: list[str] | None = None, env: dict | None = None):
        """`python -m lightllm.server.api_server --port PORT ARGS`, its output in `log_path`.
        `own_session`: a process group of its own, which stop() signals as a whole. `entry`: what
        runs instead of `-m lightllm.server.api_server` (a wrapper that ends in api_server's flags)."""
        self.port = port or free_port()
        scheme = "https" if "--ssl_certfile" in args else "http"  # a test trusts its certificate (REQUESTS_CA_BUNDLE)
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self._own_session = own_session
        cmd = [sys.executable, *(entry or ["-m", "lightllm.server.api_server"]), "--port", str(self.port), *args]
        logger.info("starting %s (log: %s)", " ".join(cmd), self.log_path)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=own_session,
                                     preexec_fn=preexec_fn, cwd=cwd, env=env)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 300.0) -> float:
        """Seconds until GET /health answered 200; RuntimeError if the server exits first."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-5000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=30).status_code == 200:
                    return time.monotonic() - start
            except (requests.ConnectionError, requests.Timeout):  # a connection waits while the model loads
                pass
            time.sleep(0.2)  # polling interval, not synchronisation
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log_text()[-5000:]}")

    def metrics(self) -> dict[str, float]:
        return metric_samples(requests.get(f"{self.url}/metrics", timeout=30).text)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (to its whole group when it has a session of its own): the server drains and
        ends its processes; SIGKILL after `timeout` seconds. Its exit status."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the server ignored SIGTERM for %.0f s; killing it", timeout)
            self._signal(signal.SIGKILL)
            code = self.proc.wait()
        if self._own_session:
            self._wait_group_gone(timeout)
        self._log.close()
        return code

    def _signal(self, signum: int) -> None:
        try:
            if self._own_session:
                os.killpg(self.proc.pid, signum)
            else:
                self.proc.send_signal(signum)
        except ProcessLookupError:
            pass

    def _wait_group_gone(self, timeout: float) -> None:
        """The rest of its group (model workers holding GPU memory) gone too; SIGKILL after `timeout`."""
        deadline = time.monotonic() + timeout
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)  # polling interval
        if self._group_alive():
            self._signal(signal.SIGKILL)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True


def start_server(args: list[str], log_path: Path, timeout: float = 300.0, server_class=ServerProcess,
                 **options) -> ServerProcess:
    """A ServerProcess (or `server_class`) once /health answers 200; stopped again if it never does."""
    server = server_class(args, log_path, **options)
    try:
        server.wait_healthy(timeout)
    except BaseException:
        server.stop()
        raise
    return server
