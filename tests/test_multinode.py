"""Tensor parallelism over two "nodes" on this machine: two launches of the api_server module
(node 0: HTTP, router, detokenizer and rank 0; node 1: rank 1 alone), gloo over loopback, the
tiny random model. The greedy tokens of --tp 2 --nnodes 2 are those of --tp 1; node 1 follows
node 0 out; a node that never comes ends the start-up of the one waiting for it; what a stranger
who reads the rendezvous store can do (nothing with the workers), and a worker loads once.
"""

import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from lightllm import LLM, SamplingParams
from lightllm.engine.workers import accept_router, connect_remote_worker, node_key, to_wire, token_authenticator
from lightllm.server.config import NODE_TOKEN_ENV, parse_config
from lightllm.server.node import POLL_INTERVAL, watch
from lightllm.tools.bench_model import write_bench_model
from lightllm.utils.dist import LAYOUT_KEY, LIVENESS_TIMEOUT, RUN_KEY, NodeLayout, Rendezvous
from lightllm.utils.net import free_port
from server_utils import Server, start_server, wait_exited
from seeds import fresh_rng  # noqa: E402
from helpers.models import RUNNER_SETTINGS, runner_config

WORDS = "the a model token cache batch river stone light 你好 café 🤖 runs quickly slowly over under".split()
MAX_NEW_TOKENS = 12
# A node > 0 must exit this soon after node 0 stops. It sees the hang-up at once (its log says so,
# which the test checks); the bound only guards against its staying up until --dist_timeout (120 s
# here) or for ever, so it is half that: far above the seconds it takes on a loaded machine.
FOLLOW_SECONDS = 60.0
NODE_TOKEN = "test-node-token-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny"))


def node_args(tiny_dir: str, node_rank: int, dist_init_addr: str, dist_timeout: float = 120) -> list[str]:
    return ["--model_dir", tiny_dir, "--tp", "2", "--nnodes", "2", "--node_rank", str(node_rank),
            "--dist_init_addr", dist_init_addr, "--dist_timeout", str(dist_timeout), "--node_token", NODE_TOKEN]


def greedy_tokens(server: Server, prompts: list[str]) -> list[list[int]]:
    """The token ids of each prompt's answer, sent together so that the steps batch them."""
    def run(prompt):
        answer = server.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, details=True)
        return [token["id"] for token in answer["details"]["tokens"]]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(run, prompts))


def tp1_greedy_tokens(tiny_dir: str, prompts: list[str]) -> list[list[int]]:
    """The same through the engine at --tp 1, in this process (the offline API runs the router's
    engine core and a ModelRunner; a third server would cost this 2-core machine ~15 s)."""
    with LLM(tiny_dir) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def family(server: Server) -> list[psutil.Process]:
    try:
        return server.processes()
    except psutil.NoSuchProcess:
        return []


def test_two_nodes_give_the_tokens_of_one_and_node1_follows_node0_out(tiny_dir, tmp_path):
    rng = fresh_rng()
    prompts = [" ".join(rng.choices(WORDS, k=rng.randrange(1, 30))) for _ in range(4)]
    dist_init_addr = f"127.0.0.1:{free_port()}"
    node1 = Server(node_args(tiny_dir, 1, dist_init_addr), tmp_path / "node1.log")
    node0 = None
    try:
        node0 = start_server(node_args(tiny_dir, 0, dist_init_addr), tmp_path / "node0.log")
        assert greedy_tokens(node0, prompts) == tp1_greedy_tokens(tiny_dir, prompts)
        node1_family = family(node1)  # its main process, the worker of rank 1, multiprocessing's helper
        assert len(node1_family) >= 2

        assert node0.stop() == 0
        stopped = time.monotonic()
        node1.proc.wait(timeout=FOLLOW_SECONDS)
        assert time.monotonic() - stopped < FOLLOW_SECONDS
        _, alive = wait_exited(node1_family, timeout=FOLLOW_SECONDS)
        assert not alive
        assert "node 0's router hung up" in node1.log_text()
    finally:
        if node0 is not None:
            node0.stop()
        node1.stop()


def wait_collecting_family(server: Server, timeout: float) -> list[psutil.Process]:
    """Wait for the server's main process to exit; every process seen in its family meanwhile."""
    seen = {}
    deadline = time.monotonic() + timeout
    while server.proc.poll() is None and time.monotonic() < deadline:
        seen.update((p.pid, p) for p in family(server))
        time.sleep(0.1)  # polling interval, not synchronisation
    return list(seen.values())


def test_a_missing_node_ends_start_up_with_a_clear_message(tiny_dir, tmp_path):
    """Node 0 waits for a node 1 that never comes; node 1 (another group) for a node 0 that never
    answers. Both stop with status 1 once --dist_timeout has passed, and leave no process."""
    lonely0 = Server(node_args(tiny_dir, 0, f"127.0.0.1:{free_port()}", dist_timeout=3), tmp_path / "node0.log")
    missing0 = f"127.0.0.1:{free_port()}"
    lonely1 = Server(node_args(tiny_dir, 1, missing0, dist_timeout=2), tmp_path / "node1.log")
    try:
        seen = wait_collecting_family(lonely0, timeout=60)
        assert lonely0.proc.wait(timeout=60) == 1
        assert lonely1.proc.wait(timeout=60) == 1
        assert "node 1 did not join within 3 s (--dist_timeout)" in lonely0.log_text()
        assert f"node 0 did not answer at {missing0} within 2 s (--dist_timeout)" in lonely1.log_text()
        assert len(seen) >= 3  # main, router, detokenizer (and rank 0's worker)
        _, alive = wait_exited(seen, timeout=10)
        assert not alive
    finally:
        lonely0.stop()
        lonely1.stop()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "3", "--nnodes", "2", "--dist_init_addr", "127.0.0.1:1"], "--tp 3 must be divisible by --nnodes 2"),
        (["--tp", "2", "--nnodes", "2"], "--dist_init_addr HOST:PORT is required with --nnodes > 1"),
        (["--tp", "2", "--nnodes", "2", "--dist_init_addr", "host"], "--dist_init_addr HOST:PORT is required"),
        (["--nnodes", "2", "--node_rank", "2", "--tp", "2"], "--node_rank must be at least 0 and below --nnodes"),
        (["--tp", "2", "--nnodes", "2", "--dist_init_addr", "127.0.0.1:1"], "--node_token (or $LIGHTLLM_NODE_TOKEN)"),
        (["--tp", "2", "--nnodes", "2", "--dist_init_addr", "127.0.0.1:1", "--node_token", "short"],
         "of at least 16 characters"),
    ],
)
def test_node_flags_that_cannot_work_fail_at_once(args, message):
    env = {k: v for k, v in os.environ.items() if k != NODE_TOKEN_ENV}
    result = subprocess.run([sys.executable, "-m", "lightllm.server.api_server", *args],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert message in result.stderr


def test_a_worker_serves_only_the_connection_that_brings_the_token():
    token = b"0123456789abcdef0123456789abcdef"
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted = []
        thread = threading.Thread(target=lambda: accepted.append(
            accept_router(listener, token_authenticator(token, timeout=1.0))))
        thread.start()
        address = listener.getsockname()
        strangers = [socket.create_connection(address) for _ in range(3)]
        strangers[0].sendall(b"x" * len(token))  # wrong
        strangers[1].sendall(token[:-1])  # too short: times out
        strangers[2].close()  # nothing at all
        for stranger in strangers[:2]:
            stranger.settimeout(5.0)
            assert stranger.recv(1) == b""  # closed by the worker
            stranger.close()
        router = socket.create_connection(address)
        router.sendall(token + b"rpyc")
        thread.join(10)
        assert not thread.is_alive() and len(accepted) == 1
        with accepted[0] as sock:
            assert sock.recv(4) == b"rpyc"  # the bytes after the token are left to rpyc
        router.close()


def host_rendezvous(layout: NodeLayout, opened) -> None:
    rendezvous = Rendezvous.host(layout)
    opened.set()
    rendezvous.store.wait(["never"], timedelta(seconds=120))  # serve until the test kills this process


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until every thread of `pid` is stopped: SIGSTOP takes each thread as it next enters the
    kernel, so one already running (the store's, answering) may still answer a request sent just
    after os.kill returns (seen under load: a thread still "R" and the store answering)."""
    deadline = time.monotonic() + timeout
    while True:
        states = [(task / "stat").read_text().rsplit(") ", 1)[1].split()[0]
                  for task in Path(f"/proc/{pid}/task").iterdir()]
        if all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped after {timeout} s: {states}"
        time.sleep(0.01)


def test_node0_counts_as_gone_when_its_store_stops_answering():
    """A node 0 that stops without closing anything (frozen here, as a vanished machine looks):
    the poll of a node > 0 says so within LIVENESS_TIMEOUT instead of waiting forever."""
    layout = NodeLayout(tp=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{free_port()}", dist_timeout=30)
    context = multiprocessing.get_context("spawn")
    opened = context.Event()
    node0 = context.Process(target=host_rendezvous, args=(layout, opened), daemon=True)
    node0.start()
    try:
        assert opened.wait(60)
        joined = Rendezvous.join(dataclasses.replace(layout, node_rank=1))
        assert joined.node0_answers()
        os.kill(node0.pid, signal.SIGSTOP)
        wait_stopped(node0.pid)
        start = time.monotonic()
        assert not joined.node0_answers()
        # A read of a frozen store waits for ever: that is what the bound guards against, not the
        # 3 s of LIVENESS_TIMEOUT to the second, hence 10x for a loaded machine.
        assert time.monotonic() - start < 10 * LIVENESS_TIMEOUT
    finally:
        node0.kill()
        node0.join()


class SilentRendezvous:
    """Node 0's store after node 0 has stopped: it never answers."""

    layout = NodeLayout(tp=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1", dist_timeout=30)

    def node0_answers(self) -> bool:
        return False


@pytest.mark.parametrize("exit_code, status, message", [
    (0, 0, "node 0's router hung up"),
    (3, 1, "exited with code 3"),
    (None, 1, "node 0 stopped answering"),
])
def test_a_worker_that_ends_just_after_node0s_store_closes_decides_why_the_node_stops(caplog, exit_code, status,
                                                                                      message):
    """Node 0 closes its store as it stops, at about the moment its router hangs up on our worker;
    on a slow machine the worker's exit can come after the store's silence is seen. A worker that
    ends within HANGUP_GRACE of that silence gives the reason; one that does not end, the silence."""
    context = multiprocessing.get_context("fork")  # the worker only sleeps: no second torch import
    started = context.Event()
    worker = context.Process(target=exit_after, args=(started, exit_code))
    worker.start()
    try:
        assert started.wait(60)
        start = time.monotonic()
        with caplog.at_level(logging.INFO, logger="lightllm.server.node"):
            assert watch([worker], SilentRendezvous()) == status
        assert message in caplog.text
        # Expected within POLL_INTERVAL + HANGUP_GRACE (5 s). The worker that never ends sleeps 60 s:
        # a watch that waited for it fails; half of that leaves a loaded machine 25 s of margin.
        assert time.monotonic() - start < 30
    finally:
        worker.kill()
        worker.join()


def exit_after(started, code: int | None) -> None:
    """A worker that exits with `code` past the first poll and within the grace (None: never)."""
    started.set()
    time.sleep(POLL_INTERVAL + 0.5 if code is not None else 60)
    sys.exit(code)


def test_the_node_token_can_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(NODE_TOKEN_ENV, NODE_TOKEN)
    config = parse_config(["--tp", "2", "--nnodes", "2", "--dist_init_addr", "127.0.0.1:1"])
    assert config.node_token == NODE_TOKEN and NODE_TOKEN not in repr(config)
    assert NODE_TOKEN not in repr(NodeLayout.of(config))


def listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def refused(host: str, port: int, key: bytes) -> bool:
    """Whether the worker at host:port hangs up on a connection that starts with `key`."""
    stranger = connect_remote_worker(1, 1, host, port, key)
    try:
        stranger.conn.root.ping()
    except EOFError:
        return True
    finally:
        stranger.conn.close()
    return False


def test_a_stranger_who_reads_the_store_cannot_drive_a_node_and_a_worker_loads_once(tiny_dir, tmp_path):
    """Node 0's rendezvous hosted here, a real node 1 joining it. The store listens only on the
    address --dist_init_addr names, and holds nothing that lets a connection past node 1's worker:
    keys made from everything in it are refused. The router's key (from --node_token, never in the
    store) is served; its worker loads a model once and refuses a second `load`."""
    port = free_port()
    layout = NodeLayout(tp=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{port}", dist_timeout=120,
                        node_token=NODE_TOKEN)
    rendezvous = Rendezvous.host(layout)
    assert listening_addresses(port) == {"127.0.0.1"}
    node1 = Server(node_args(tiny_dir, 1, layout.dist_init_addr), tmp_path / "node1.log")
    try:
        host, worker_port = rendezvous.worker_address(1)
        store_values = [rendezvous.store.get(key).decode() for key in (RUN_KEY, LAYOUT_KEY, "worker/1")]
        assert not any(NODE_TOKEN in value or node_key(NODE_TOKEN).hex() in value for value in store_values)
        for value in store_values:
            assert refused(host, worker_port, node_key(value))
            assert refused(host, worker_port, value.encode().ljust(32, b"\0")[:32])

        router = connect_remote_worker(1, 1, host, worker_port, node_key(NODE_TOKEN))
        load = router.conn.root.load
        fields = dataclasses.asdict(runner_config(tiny_dir))
        max_total_token_num, _ = load(to_wire(fields), 0, 0)
        assert max_total_token_num == RUNNER_SETTINGS["max_total_token_num"]
        with pytest.raises(Exception, match="loads once"):
            load(to_wire({**fields, "model_dir": str(tmp_path)}), 0, 0)
        router.conn.root.ping()  # the loaded worker still serves its router
        router.conn.close()
        assert node1.proc.wait(timeout=FOLLOW_SECONDS) == 0
        assert "node 0's router hung up" in node1.log_text()
    finally:
        node1.stop()
