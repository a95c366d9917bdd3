"""Model workers: one process per tensor-parallel rank, each an rpyc service around its ModelRunner.

The engine core reaches each worker over a socketpair (no port to choose) and calls every rank
at once, then waits for all; rank 0's answer is used. One `step` call a step: it carries the
plan and brings back the previous step's tokens. rpyc would pass lists by reference, making
every element access a round trip, so plans and results cross as plain tuples (`plan.py`).

Over several machines (`NodeLayout`), node 0's router runs the ranks of node 0 that way and
reaches every other rank over TCP: that rank's node listens on a port it publishes in the
rendezvous (`lightllm/utils/dist.py`), and the worker serves only a connection whose first bytes
are the key of --node_token (`node_key`), which the operator gives every node; it loads a model once.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import rpyc
from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream
from rpyc.utils.authenticators import AuthenticationError

from lightllm.engine.core import WorkerDied
from lightllm.engine.plan import (DraftRequest, StepPlan, StepResult, drafts_from_wire, drafts_to_wire, plan_from_wire,
                                  plan_to_wire, result_from_wire, result_to_wire)
from lightllm.utils.process import (STOP_SIGNAL, freeze_startup_heap, init_child_process, start_signals_blocked,
                                    starting_child, stop_processes, use_one_heap)

if TYPE_CHECKING:
    from lightllm.engine.config import EngineConfig
    from lightllm.utils.dist import NodeLayout  # imports torch, which the router does without

logger = logging.getLogger(__name__)

RPYC_CONFIG = {"allow_pickle": False, "sync_request_timeout": None}
AUTH_TIMEOUT = 10.0  # seconds a connection to a worker has to send the token
CONNECT_TIMEOUT = 10.0  # seconds the router waits for a published worker to accept
# A remote worker whose machine vanishes (no FIN) is noticed by TCP keepalive: idle, interval, probes.
KEEPALIVE = (5, 2, 3)


def connect(sock: socket.socket, service=rpyc.VoidService) -> rpyc.Connection:
    """rpyc over `sock`, both ends of every router <-> worker connection. Its messages go
    uncompressed: rpyc zlib-compresses any over 3,000 bytes by default, which a step with drafts
    pays on its plan and its result (test/benchmark/engine/wire_cost.py, 2026-12-06, 2-core CPU:
    a round trip of 64 decodes with 4 drafts 0.46 ms compressed, 0.33 not; the H100 host's step
    trace put 0.88 ms of a drafted step's turnaround in the two trips), and which a socket pair or a
    datacenter link gains nothing from."""
    return rpyc.connect_channel(Channel(SocketStream(sock), compress=False), service=service, config=RPYC_CONFIG)


def to_wire(value):
    """Lists and dicts as (nested) tuples, which rpyc copies by value."""
    if isinstance(value, dict):
        return tuple((key, to_wire(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(to_wire(item) for item in value)
    return value


class ModelWorkerService(rpyc.Service):
    """Runs in the worker process; one instance per connection (there is one)."""

    runner = None
    ranks_on_node = 1  # worker processes on this machine, which share its cores

    def exposed_load(self, config_fields: tuple, tp_rank: int, local_rank: int) -> tuple:
        if self.runner is not None:  # whoever holds the connection cannot swap the model for another
            raise RuntimeError("this model worker has loaded its model already; it loads once")
        import torch

        from lightllm.engine.config import EngineConfig
        from lightllm.engine.model_runner import ModelRunner  # torch: worker only

        if not torch.cuda.is_available():
            # Leave a core to the router, detokenizer and HTTP processes, which work on every step:
            # an OpenMP thread descheduled by them stalls the whole step (measured: 64 tokens of
            # the default model in 74 s with 2 threads on 2 cores, 3.9 s with 1).
            cores = max(1, (os.cpu_count() or 1) - 1)
            torch.set_num_threads(max(1, cores // self.ranks_on_node))
        self.runner = ModelRunner(EngineConfig(**dict(config_fields)), tp_rank, local_rank=local_rank)
        self.runner.prepare_grammars().result()  # before the first request, structured or not
        freeze_startup_heap()
        return self.runner.max_total_token_num, to_wire(self.runner.info)

    def exposed_step(self, plan: tuple) -> tuple:
        return tuple(result_to_wire(r) for r in self.runner.step(plan_from_wire(plan)))

    def exposed_draft(self, asks: tuple) -> tuple:
        return to_wire(self.runner.draft(drafts_from_wire(asks)))

    def exposed_stats(self) -> tuple:
        return to_wire(self.runner.stats())

    def exposed_ping(self) -> None:
        """A no-op: measures the router <-> worker round trip."""


def run_model_worker(sock: socket.socket, parent_pid: int, log_level: str, ranks_on_node: int) -> None:
    """Entry of a worker process: serve the router until it hangs up."""
    _init_worker(parent_pid, log_level, ranks_on_node)
    logger.info("model worker started (pid %d)", os.getpid())
    _serve(sock)


def run_remote_model_worker(listener: socket.socket, token: bytes, parent_pid: int, log_level: str,
                            ranks_on_node: int) -> None:
    """Entry of a worker process on a node > 0: serve the first connection that brings the
    token, until it hangs up."""
    _init_worker(parent_pid, log_level, ranks_on_node)
    host, port = listener.getsockname()[:2]
    logger.info("model worker started (pid %d), waiting for node 0's router on %s:%d", os.getpid(), host, port)
    sock = accept_router(listener, token_authenticator(token))
    listener.close()
    _serve(sock)
    # At once, with nothing to tidy up (like a local worker's stop signal): the node process takes a
    # clean exit as the router's hang-up, and must see it before node 0's store goes too.
    logging.shutdown()
    os._exit(0)


def _init_worker(parent_pid: int, log_level: str, ranks_on_node: int) -> None:
    use_one_heap()  # first: before any thread of this process allocates
    init_child_process(parent_pid, log_level)
    # Nothing to tidy up here, and SystemExit inside rpyc's serve loop ends in a noisy traceback:
    # the signal's default action ends the process at once.
    signal.signal(STOP_SIGNAL, signal.SIG_DFL)
    ModelWorkerService.ranks_on_node = ranks_on_node


def _serve(sock: socket.socket) -> None:
    conn = connect(sock, ModelWorkerService)
    conn.serve_all()


def node_key(node_token: str) -> bytes:
    """What node 0's router sends a remote worker first: a digest of --node_token, so that every
    key has one length (the worker reads exactly that many bytes) and the token itself never
    crosses the network."""
    return hashlib.sha256(b"lightllm node token\0" + node_token.encode()).digest()


def token_authenticator(token: bytes, timeout: float = AUTH_TIMEOUT):
    """An rpyc authenticator: the connection's first len(token) bytes must be the token."""

    def authenticate(sock: socket.socket):
        sock.settimeout(timeout)
        received = b""
        try:
            while len(received) < len(token):
                chunk = sock.recv(len(token) - len(received))
                if not chunk:
                    break
                received += chunk
        except OSError as exc:
            raise AuthenticationError(f"no token within {timeout:g} s ({exc})") from None
        if not hmac.compare_digest(received, token):
            raise AuthenticationError("wrong token")
        sock.settimeout(None)
        return sock, None

    return authenticate


def accept_router(listener: socket.socket, authenticate) -> socket.socket:
    """The first connection to `listener` that `authenticate` accepts; the others are closed."""
    while True:
        sock, peer = listener.accept()
        try:
            sock, _ = authenticate(sock)
        except AuthenticationError as exc:
            logger.warning("refused a connection from %s: %s", peer[0], exc)
            sock.close()
            continue
        logger.info("node 0's router connected from %s", peer[0])
        return sock


@dataclass
class RemoteWorker:
    """The router's TCP connection to a rank on another node."""

    rank: int
    node: int
    address: str
    sock: socket.socket
    conn: rpyc.Connection | None = None

    def hung_up(self) -> bool:
        """Whether the connection is closed (checked without reading: a reply may be waiting)."""
        if self.conn is not None and self.conn.closed:
            return True
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True


def connect_remote_worker(rank: int, node: int, host: str, port: int, token: bytes) -> RemoteWorker:
    """Connect, send the token, then speak rpyc (OSError if the worker cannot be reached)."""
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    sock.sendall(token)
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    worker = RemoteWorker(rank, node, f"{host}:{port}", sock)
    worker.conn = connect(sock)
    return worker


class ModelWorkers:
    """The router's handle on every rank: on this machine, and on the others when given a layout."""

    METHODS = ("load", "step", "draft", "stats", "ping")

    def __init__(self, tp: int, log_level: str, layout: NodeLayout | None = None, replica: int = 0,
                 replicas: int = 1):
        """`layout`: given when the ranks span machines. `replica` of `replicas` (--dp) engines on
        this machine: its ranks take devices replica * tp on, and the machine's cores are shared
        by every replica's workers."""
        self.processes: list[multiprocessing.Process] = []
        # Called once a step's plan is on its way to every rank, before waiting for their answer:
        # the router's work that no plan depends on (its outputs, its stats) runs while the ranks
        # launch and run the step, not between a step's result and the next launch.
        self.while_waiting = None
        self._conns: list[rpyc.Connection] = []
        self._remote: list[RemoteWorker] = []
        self._rendezvous = None  # node 0 hosts it for as long as the workers run
        self._ranks_per_node = tp if layout is None else layout.ranks_per_node
        self._first_device = replica * self._ranks_per_node
        self._workers_on_node = self._ranks_per_node * replicas
        try:
            for rank in range(self._ranks_per_node):
                self._conns.append(self._spawn(rank, log_level))
            if layout is not None:
                self._connect_remote(layout)
            # Attribute look-ups on a remote object are round trips: do them once.
            self._methods = {
                name: [rpyc.async_(getattr(conn.root, name)) for conn in self._conns] for name in self.METHODS
            }
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, rank: int, log_level: str) -> rpyc.Connection:
        mine, theirs = socket.socketpair()
        process = multiprocessing.get_context("spawn").Process(
            target=run_model_worker,
            args=(theirs, os.getpid(), log_level, self._workers_on_node),
            name=f"model_worker_{rank}",
            daemon=True,
        )
        with start_signals_blocked(), starting_child():
            process.start()
        theirs.close()
        self.processes.append(process)
        return connect(mine)

    def _connect_remote(self, layout: NodeLayout) -> None:
        """Wait (up to --dist_timeout in all) for every other node's workers; connect in rank order."""
        from lightllm.utils.dist import JoinError, Rendezvous  # torch: only a multi-node router needs it

        self._rendezvous = Rendezvous.host(layout)
        token = node_key(layout.node_token)
        for rank in range(self._ranks_per_node, layout.tp):
            node = layout.node_of(rank)
            host, port = self._rendezvous.worker_address(rank)
            try:
                worker = connect_remote_worker(rank, node, host, port, token)
            except OSError as exc:
                raise JoinError(f"cannot reach model worker rank {rank} of node {node} at {host}:{port}: {exc}") from None
            self._remote.append(worker)
            try:
                worker.conn.root  # the first round trip: a worker that refused the token has hung up
            except EOFError:
                raise JoinError(f"model worker rank {rank} at {worker.address} refused node 0's token "
                                "(a different --node_token on that node?)") from None
            self._conns.append(worker.conn)
        logger.info("all %d nodes joined", layout.nnodes)

    def load(self, config: EngineConfig) -> tuple[int, dict]:
        fields = to_wire(dataclasses.asdict(config))
        pending = [call(fields, rank, self._first_device + rank % self._ranks_per_node)
                   for rank, call in enumerate(self._methods["load"])]
        max_total_token_num, info = self._gather(pending)
        return max_total_token_num, {key: list(v) if isinstance(v, tuple) else v for key, v in info}

    def step(self, plan: StepPlan) -> list[StepResult]:
        wire = plan_to_wire(plan)  # once, for every rank
        pending = [call(wire) for call in self._methods["step"]]
        if self.while_waiting is not None:
            self.while_waiting()
        return [result_from_wire(r) for r in self._gather(pending)]

    def draft(self, asks: list[DraftRequest]) -> list[tuple[tuple[int, ...], int]]:
        """The draft model's proposals (every rank runs it: each holds its shard of the draft's KV)."""
        return [(tuple(drafts), drafted) for drafts, drafted in self._call_all("draft", drafts_to_wire(asks))]

    def stats(self) -> dict:
        return dict(self._gather([self._methods["stats"][0]()]))  # read-only: rank 0 is enough

    def ping(self) -> None:
        self._call_all("ping")

    def _call_all(self, name: str, *args):
        return self._gather([call(*args) for call in self._methods[name]])

    def _gather(self, pending: list):
        """Wait for every rank (they run concurrently); raise the first error; return rank 0's value."""
        try:
            for result in pending:
                result.wait()
        except (EOFError, OSError) as exc:
            if any(conn.closed for conn in self._conns) or self.dead_worker_message():
                raise WorkerDied(self.dead_worker_message(timeout=2.0) or f"lost a model worker: {exc!r}") from exc
            raise
        values = [result.value for result in pending]
        return values[0]

    @property
    def sentinels(self) -> list[int]:
        """Readable once a worker is gone: local processes' sentinels and remote connections'
        sockets (between steps no reply is pending, so a readable one has hung up)."""
        return [process.sentinel for process in self.processes] + [r.sock.fileno() for r in self._remote]

    def dead_worker_message(self, timeout: float = 0.0) -> str | None:
        """Describe the first worker that has exited or hung up (waiting up to `timeout` for one)."""
        deadline = time.monotonic() + timeout
        while True:
            ended = multiprocessing.connection.wait([p.sentinel for p in self.processes], min(0.1, timeout))
            for rank, process in enumerate(self.processes):
                if process.sentinel in ended:
                    process.join(1.0)  # its sentinel closes a moment before it can be reaped
                    return f"model worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
            for worker in self._remote:
                if worker.hung_up():
                    return f"model worker rank {worker.rank} on node {worker.node} ({worker.address}) hung up"
            if time.monotonic() >= deadline:
                return None

    def shutdown(self) -> None:
        for conn in self._conns:
            conn.close()  # a worker's serve_all ends when its connection closes
        for worker in self._remote:
            worker.sock.close()  # not yet wrapped in a connection if the join failed
        stop_processes(self.processes)
