"""Addresses for the server's sockets: loopback TCP ports, and local IPC paths for the internal ones."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
SOCKET_DIR_PREFIX = "lightllm-"  # then the server's pid, a dash and mkdtemp's random letters


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


def ipc_addresses(names: list[str]) -> tuple[str, list[str]]:
    """A fresh private directory and one ZeroMQ `ipc://` address in it per name.

    Unix sockets in a directory of our own cannot collide with another process's port the way
    a "free a moment ago" TCP port can (torch.distributed's gloo takes ephemeral ports too).
    The server removes the directory when it exits; one killed outright cannot, so the next
    start removes the directories of servers that are gone first.
    """
    remove_stale_socket_dirs()
    directory = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
    return directory, [f"ipc://{Path(directory) / name}" for name in names]


def socket_dirs(pid: int | str = "*") -> list[Path]:
    """The socket directories of the server with this pid (of every server by default)."""
    return sorted(Path(tempfile.gettempdir()).glob(f"{SOCKET_DIR_PREFIX}{pid}-*"))


def remove_stale_socket_dirs() -> None:
    """Remove our socket directories whose server process no longer exists."""
    for path in socket_dirs():
        pid = path.name[len(SOCKET_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and path.is_dir() and path.stat().st_uid == os.getuid() and not _alive(int(pid)):
            logger.info("removing %s, left by server pid %s, which is gone", path, pid)
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
