"""Loopback addresses for the server's internal sockets."""

from __future__ import annotations

import contextlib
import socket

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
