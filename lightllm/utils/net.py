"""Addresses for the server's sockets: loopback TCP ports, and local IPC paths for the internal ones."""

from __future__ import annotations

import contextlib
import socket
import tempfile
from pathlib import Path

LOOPBACK = "127.0.0.1"


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports that were free a moment ago (all held open until all are chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def free_port(host: str = LOOPBACK) -> int:
    return free_ports(1, host)[0]


def tcp_address(port: int, host: str = LOOPBACK) -> str:
    return f"tcp://{host}:{port}"


def ipc_addresses(names: list[str]) -> tuple[str, list[str]]:
    """A fresh private directory and one ZeroMQ `ipc://` address in it per name.

    Unix sockets in a directory of our own cannot collide with another process's port the way
    a "free a moment ago" TCP port can (torch.distributed's gloo takes ephemeral ports too).
    """
    directory = tempfile.mkdtemp(prefix="lightllm-")
    return directory, [f"ipc://{Path(directory) / name}" for name in names]
