"""A node other than 0 (`--node_rank` > 0): it runs only its model workers, which node 0's router
drives. Entered from api_server.main.

It joins node 0's rendezvous at --dist_init_addr, opens one listening port per local rank,
publishes each (`worker/<rank>`) and starts the workers, which serve the first connection that
brings the key of --node_token (the token itself never goes through the rendezvous). It then
waits, polling the rendezvous every POLL_INTERVAL seconds, and stops when node 0's router hangs up
(its workers exit), when the rendezvous stops answering or answers with another run id (node 0 is
gone or was restarted), when a worker dies, or on SIGTERM.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import socket

from lightllm.engine.workers import node_key, run_remote_model_worker
from lightllm.server.config import ServerConfig
from lightllm.utils.dist import JoinError, NodeLayout, Rendezvous, route_address
from lightllm.utils.process import start_signals_blocked, starting_child, stop_processes

logger = logging.getLogger("lightllm.server.node")

POLL_INTERVAL = 2.0  # seconds; node 0's loss is noticed within this + dist.LIVENESS_TIMEOUT + HANGUP_GRACE
HANGUP_GRACE = 3.0  # seconds a worker gets to see node 0's router hang up once node 0's store is gone


def serve_node(config: ServerConfig) -> int:
    """Run this node's workers until node 0 goes; the exit status (0: node 0 hung up)."""
    layout = NodeLayout.of(config)
    try:
        rendezvous = Rendezvous.join(layout)
        listeners = open_listeners(config, layout, rendezvous)
    except JoinError as exc:
        logger.error("%s; node %d stops", exc, layout.node_rank)
        return 1
    processes = []
    try:
        for rank, listener in zip(layout.ranks(layout.node_rank), listeners):
            start_worker(rank, listener, node_key(layout.node_token), config.log_level, layout.ranks_per_node, processes)
            listener.close()  # the worker has its own copy
        logger.info("node %d joined %s: ranks %s, waiting for node 0's router", layout.node_rank,
                    layout.dist_init_addr, list(layout.ranks(layout.node_rank)))
        return watch(processes, rendezvous)
    finally:
        stop_processes(processes)
        logger.info("node %d stopped", layout.node_rank)


def open_listeners(config: ServerConfig, layout: NodeLayout, rendezvous: Rendezvous) -> list[socket.socket]:
    """One listening socket per local rank on --worker_host, each published under its rank."""
    host = config.worker_host or route_address(layout.dist_init_addr)
    listeners = []
    for i, rank in enumerate(layout.ranks(layout.node_rank)):
        port = config.worker_port + i if config.worker_port else 0
        try:
            listener = socket.create_server((host, port), family=_family(host), backlog=4)
        except OSError as exc:
            raise JoinError(f"model worker rank {rank} cannot listen on {host}:{port} (--worker_host, "
                            f"--worker_port): {exc}") from None
        listeners.append(listener)
        rendezvous.publish_worker(rank, host, listener.getsockname()[1])
    return listeners


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def start_worker(rank: int, listener: socket.socket, key: bytes, log_level: str, ranks_on_node: int,
                 processes: list[multiprocessing.Process]) -> None:
    """Start it and add it to `processes` before a stop signal can end the start."""
    process = multiprocessing.get_context("spawn").Process(
        target=run_remote_model_worker,
        args=(listener, key, os.getpid(), log_level, ranks_on_node),
        name=f"model_worker_{rank}",
    )
    with start_signals_blocked(), starting_child():
        process.start()
        processes.append(process)


def watch(processes: list[multiprocessing.Process], rendezvous: Rendezvous) -> int:
    """Block until a worker exits or node 0 stops answering; the node's exit status."""
    by_sentinel = {process.sentinel: process for process in processes}
    while True:
        status = _worker_ended(by_sentinel, POLL_INTERVAL)
        if status is not None:
            return status
        if not rendezvous.node0_answers():
            # node 0 closes its store as it stops, at about the moment its router hangs up on our
            # workers: a worker that exits cleanly within the grace says node 0 stopped on purpose
            status = _worker_ended(by_sentinel, HANGUP_GRACE)
            if status is not None:
                return status
            logger.error("node 0 stopped answering at %s (gone or restarted); this node stops",
                         rendezvous.layout.dist_init_addr)
            return 1


def _worker_ended(by_sentinel: dict, timeout: float) -> int | None:
    """The node's exit status if a worker ends within `timeout`, else None."""
    ended = multiprocessing.connection.wait(list(by_sentinel), timeout)
    if not ended:
        return None
    process = by_sentinel[ended[0]]
    process.join(1.0)  # its sentinel closes a moment before it can be reaped
    if process.exitcode == 0:  # serve_all ended: node 0's router closed the connection
        logger.info("node 0's router hung up; this node stops")
        return 0
    logger.error("%s (pid %d) exited with code %s; this node stops", process.name, process.pid, process.exitcode)
    return 1
