"""Tensor-parallel process group (gloo on CPU, NCCL on CUDA) and how its ranks find each other.

One machine: the ranks meet at tcp://127.0.0.1:<nccl_port>.
Several machines (--nnodes): node 0's router hosts a TCPStore at --dist_init_addr (listening on
that address only) for as long as it runs. In it (`Rendezvous`): a run id (fresh at every start of
node 0, not a secret) and the layout (tp, nnodes), written by node 0; each rank's rpyc address
`worker/<rank>`, written by the node that runs it; and, under the prefix `tp/`, the keys of
torch.distributed's own rendezvous of the process group. The keys name ranks, never machines, and
the ports are chosen at start: another engine needs only another --dist_init_addr. The store has no
authentication, so it holds nothing secret: the token that node 0's router presents to the other
nodes' workers is --node_token, given to every node by its operator.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from lightllm.utils.allreduce import AllReducePath, SymmetricAllReduce, setup_symmetric

logger = logging.getLogger(__name__)

RUN_KEY = "run_id"
LAYOUT_KEY = "layout"
TP_PREFIX = "tp"
LIVENESS_TIMEOUT = 3.0  # seconds the store may take to answer a node > 0 before node 0 counts as gone


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group; collectives are no-ops for one rank.
    `symmetric`: the symmetric-memory all-reduce for small messages on one machine (allreduce.py),
    None where every message goes through torch.distributed."""

    rank: int = 0
    world_size: int = 1
    symmetric: SymmetricAllReduce | None = field(default=None, compare=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks: x itself, reduced in place, or a new tensor."""
        if self.world_size == 1:
            return x
        path = AllReducePath.COLLECTIVE if self.symmetric is None else self.symmetric.path(x)
        if path is AllReducePath.ONE_SHOT:
            return self.symmetric.one_shot(x)
        if path is AllReducePath.TWO_SHOT:
            return self.symmetric.two_shot(x)
        dist.all_reduce(x)
        return x

    def reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(residual + all_reduce(x)), residual) from one kernel, residual updated in
        place (kernels/allreduce_norm.py); None where that kernel does not take these tensors
        (no symmetric memory, a message past the fused kernel's, no residual, ...): the caller
        then all-reduces and normalises apart."""
        if self.world_size == 1 or self.symmetric is None:
            return None
        return self.symmetric.add_rms_norm(x, residual, weight, eps)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (used once at start-up, so the sync is fine)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


_symmetric: SymmetricAllReduce | None = None  # set up once per process, with its group


def init_tp(rank: int, world_size: int, port: int, device: torch.device | str,
            dist_init_addr: str | None = None, fused_norms: bool = True) -> TPGroup:
    """Join the TP group (a no-op for world_size 1) and return this rank's TPGroup: on localhost
    at `port`, or through the store at `dist_init_addr` (HOST:PORT) when the group spans machines.
    On one machine's GPUs the group also gets its symmetric-memory all-reduce (allreduce.py), and
    with `fused_norms` the all-reduce fused with the next residual add and RMSNorm."""
    global _symmetric
    if not 0 <= rank < world_size:
        raise ValueError(f"tp rank {rank} is outside the group of {world_size}")
    device = torch.device(device)
    if world_size == 1:
        return TPGroup()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if dist_init_addr is None:
            where = {"init_method": f"tcp://127.0.0.1:{port}"}
        else:
            host, store_port = split_address(dist_init_addr)
            where = {"store": dist.PrefixStore(TP_PREFIX, dist.TCPStore(host, store_port, is_master=False))}
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                device_id=device if device.type == "cuda" else None, **where)
        logger.info("tp rank %d/%d joined (%s, %s)", rank, world_size, backend, dist_init_addr or f"port {port}")
        _symmetric = setup_symmetric(device, world_size, single_node=dist_init_addr is None, fused=fused_norms)
    return TPGroup(rank, world_size, _symmetric)


def split_address(address: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[IPv6]:PORT') -> (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host, int(port)


def route_address(address: str) -> str:
    """This machine's address on the route to `address` (HOST:PORT): what a peer there can reach.
    A UDP connect sends nothing; it only picks the interface."""
    host, port = split_address(address)
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


class JoinError(RuntimeError):
    """A node could not join the group; the message says which one and why, for the user."""


@dataclass(frozen=True)
class NodeLayout:
    """How the tensor-parallel ranks spread over machines: node n runs ranks n*k .. n*k+k-1,
    k = tp / nnodes. Fields are named after their flags."""

    tp: int
    nnodes: int
    node_rank: int
    dist_init_addr: str
    dist_timeout: float  # seconds every node has to join
    node_token: str = field(default="", repr=False, compare=False)  # a secret: never in a log line

    @classmethod
    def of(cls, config) -> NodeLayout:
        return cls(config.tp, config.nnodes, config.node_rank, config.dist_init_addr, config.dist_timeout,
                   config.node_token or "")

    @property
    def ranks_per_node(self) -> int:
        return self.tp // self.nnodes

    def ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


class Rendezvous:
    """The store at --dist_init_addr, as node 0 (`host`) or another node (`join`) sees it."""

    def __init__(self, store: dist.TCPStore, layout: NodeLayout, run_id: str):
        self.store, self.layout, self.run_id = store, layout, run_id
        self._deadline = time.monotonic() + layout.dist_timeout

    @classmethod
    def host(cls, layout: NodeLayout) -> Rendezvous:
        """Node 0: open the store on --dist_init_addr's address alone and write a fresh run id and the layout."""
        host, port = split_address(layout.dist_init_addr)
        try:
            # TCPStore itself would listen on every interface whatever the host: it gets our socket
            listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
            store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=layout.dist_timeout), master_listen_fd=listener.detach())
        except (OSError, dist.DistError) as exc:
            raise JoinError(f"cannot open the rendezvous at --dist_init_addr {layout.dist_init_addr}: "
                            f"{str(exc).splitlines()[0]}") from None
        run_id = secrets.token_hex(8)
        store.set(RUN_KEY, run_id)
        store.set(LAYOUT_KEY, _layout_value(layout))
        logger.info("rendezvous open at %s: waiting up to %g s for %d more nodes",
                    layout.dist_init_addr, layout.dist_timeout, layout.nnodes - 1)
        return cls(store, layout, run_id)

    @classmethod
    def join(cls, layout: NodeLayout) -> Rendezvous:
        """A node > 0: reach node 0's store (retrying until --dist_timeout) and check the layout."""
        host, port = split_address(layout.dist_init_addr)
        timeout = timedelta(seconds=layout.dist_timeout)
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
            store.wait([RUN_KEY], timeout)
            run_id, theirs = store.get(RUN_KEY).decode(), store.get(LAYOUT_KEY).decode()
        except dist.DistError:
            raise JoinError(f"node 0 did not answer at {layout.dist_init_addr} within "
                            f"{layout.dist_timeout:g} s (--dist_timeout)") from None
        if theirs != _layout_value(layout):
            tp, nnodes = theirs.split()
            raise JoinError(f"node 0 runs --tp {tp} --nnodes {nnodes}, this node was started with "
                            f"--tp {layout.tp} --nnodes {layout.nnodes}")
        return cls(store, layout, run_id)

    def publish_worker(self, rank: int, host: str, port: int) -> None:
        key, mine = f"worker/{rank}", f"{host}:{port}"
        if self.store.compare_set(key, "", mine).decode() != mine:
            raise JoinError(f"another node joined as --node_rank {self.layout.node_of(rank)} already")

    def worker_address(self, rank: int) -> tuple[str, int]:
        """The rpyc address of `rank` (on a node > 0), once its node has published it."""
        remaining = max(0.01, self._deadline - time.monotonic())
        try:
            self.store.wait([f"worker/{rank}"], timedelta(seconds=remaining))
        except dist.DistError:
            raise JoinError(f"node {self.layout.node_of(rank)} did not join within "
                            f"{self.layout.dist_timeout:g} s (--dist_timeout)") from None
        return split_address(self.store.get(f"worker/{rank}").decode())

    def node0_answers(self) -> bool:
        """Whether the store answers within LIVENESS_TIMEOUT with the run id this node joined
        under (a restarted node 0 writes a new one). The read runs in a thread of its own: a
        TCPStore read waits forever on a peer that stopped or vanished without closing."""
        answer = []
        reader = threading.Thread(target=self._read_run_id, args=(answer,), name="node0-poll", daemon=True)
        reader.start()
        reader.join(LIVENESS_TIMEOUT)
        return answer == [self.run_id]

    def _read_run_id(self, answer: list) -> None:
        try:
            answer.append(self.store.get(RUN_KEY).decode())
        except dist.DistError:
            pass  # node 0 closed the store


def _layout_value(layout: NodeLayout) -> str:
    return f"{layout.tp} {layout.nnodes}"
