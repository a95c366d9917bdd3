"""Start-up of the server's child processes: logging, signals, and dying with the parent."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import logging
import multiprocessing
import os
import signal
import time

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)
# How a parent stops its children, and what Linux sends a child whose parent died. Not SIGTERM or
# SIGINT: those reach the whole process group (`kill -TERM -- -PGID`, Ctrl-C, a container's stop),
# and only the main process may act on them, since it drains first and stops its children after.
STOP_SIGNAL = signal.SIGUSR1
GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What makes a process print every thread's Python stack to its stderr (the server's log), pass
# the signal on to its own children and go on: `kill -USR2 MAIN_PID` asks the whole server where
# it waits (docs/architecture.md). Not to the process group: multiprocessing's resource tracker is
# in it, and the signal's default action would end it.
STACKS_SIGNAL = signal.SIGUSR2
# What a child starts with blocked (start_signals_blocked) until init_child_process handles them.
START_BLOCKED = (*GROUP_SIGNALS, STACKS_SIGNAL)
LOG_FORMAT = "%(asctime)s %(levelname)s [%(processName)s] %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, force=True)


_starting = 0  # children being started now (starting_child)
_deferred = None  # the stop handler call that came while one was, to make once it ends


def deferred_while_starting(handler):
    """A stop signal's handler that waits for a child's start to end (starting_child). Python runs
    a handler between any two bytecodes, also inside `Process.start()` (even with the signal
    blocked, once it arrived just before): a handler that exits there leaves the child reading its
    start-up data from a closed pipe, and printing the EOFError."""
    def handle(signum, frame) -> None:
        global _deferred
        if _starting:
            _deferred = lambda: handler(signum, None)
            return
        handler(signum, frame)

    return handle


@contextlib.contextmanager
def starting_child():
    """Start a child inside this: a stop handler made by deferred_while_starting runs when the
    start ends, and stops the new child with the others."""
    global _starting, _deferred
    _starting += 1
    try:
        yield
    finally:
        _starting -= 1
        if _deferred is not None and not _starting:
            run, _deferred = _deferred, None
            run()


@deferred_while_starting
def _exit_on_stop(signum, frame) -> None:
    # Not SystemExit: raised while the garbage collector runs a __del__ (as it does during imports
    # and model loading) it is printed and dropped, and the process would go on. A child's own
    # children (a router's model workers) are stopped first; its sockets close with the process.
    stop_processes(multiprocessing.active_children())
    logging.shutdown()
    os._exit(0)


def die_with_parent(parent_pid: int, signum: int = STOP_SIGNAL) -> None:
    """Ask Linux to send `signum` when the parent goes, so that no child outlives the server."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        logger.warning("prctl(PR_SET_PDEATHSIG) unavailable: this process may outlive its parent")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def dump_stacks_on_signal() -> None:
    """STACKS_SIGNAL prints this process's Python stacks, every thread's, to stderr at once
    (faulthandler's C handler, so a process waiting on the GPU or in a collective answers too),
    then, when the main thread next runs Python, sends it to this process's children one after
    the other (a blocked system call returns to run it), so their stacks follow in the log."""
    signal.signal(STACKS_SIGNAL, _stacks_to_children)
    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=True)
    # Restart the system calls it lands in (SA_RESTART), so that a library's blocking read or
    # write in any thread goes on rather than failing with EINTR; poll and select still return
    # early, which is how a waiting main thread gets to pass the signal on.
    signal.siginterrupt(STACKS_SIGNAL, False)


def _stacks_to_children(signum, frame) -> None:
    for child in multiprocessing.active_children():
        time.sleep(0.2)  # the previous process's dump written first, not interleaved with this one's
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, STACKS_SIGNAL)


def freeze_startup_heap() -> None:
    """Last step of a server process's start: collect once, then move every object it holds into
    the collector's permanent generation (gc.freeze), which no later collection walks. A process
    ends its start with ~350k objects (torch, transformers, the tokenizer, the model, its graphs)
    and a backlog of them not yet examined, so without this its first full collections come with
    the first requests and each walks them all: on the CPU the HTTP process took one of 285 ms and
    the model worker three of 160-210 ms within the first 3 s of a run, delaying those requests'
    first tokens (a warm-up request absorbed them; vLLM's benchmark client sends none)."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info("start-up heap frozen: %d objects out of garbage collection (%.0f ms)", gc.get_freeze_count(),
                (time.perf_counter() - start) * 1000)


def init_child_process(parent_pid: int, log_level: str) -> None:
    """First call in every child: SIGINT and SIGTERM are the main process's to handle (they may reach
    the whole group); STOP_SIGNAL, from the parent or at its death, exits cleanly; STACKS_SIGNAL
    prints the stacks."""
    setup_logging(log_level)
    dump_stacks_on_signal()
    for signum in GROUP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    # See start_signals_blocked: a pending SIGTERM or SIGINT is dropped, a pending STACKS_SIGNAL dumps now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, START_BLOCKED)
    signal.signal(STOP_SIGNAL, _exit_on_stop)
    die_with_parent(parent_pid)


@contextlib.contextmanager
def start_signals_blocked():
    """Start children inside this. A spawned child runs its imports before init_child_process, and a
    SIGTERM or SIGINT to the whole group, or a STACKS_SIGNAL passed on, would then kill it (a
    handler does not survive exec; the signal mask does): it starts with them blocked, until it
    handles them. Ours arrive when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, START_BLOCKED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_processes(processes, timeout: float = 5.0) -> None:
    """STOP_SIGNAL all at once, then SIGKILL whichever lingers past `timeout`; always reaped (no zombie).

    A process that stops children of its own needs a longer `timeout` than it gives them."""
    for process in processes:
        if process.is_alive():  # not yet reaped (only we reap it), so the pid is still its own
            logger.debug("stopping %s (pid %s)", process.name, process.pid)
            os.kill(process.pid, STOP_SIGNAL)
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            logger.warning("%s (pid %d) still runs %g s after the stop signal; killing it", process.name, process.pid,
                           timeout)
            process.kill()
        process.join()
        logger.debug("%s stopped (exit code %s)", process.name, process.exitcode)


def return_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim). On the CPU a model
    worker allocates activations of every step's shape; glibc keeps what they free, so an idle
    worker would otherwise stay at its busiest size. A no-op where there is no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def use_one_heap() -> None:
    """Make every thread of this process allocate from glibc's main heap (M_ARENA_MAX 1), where
    `return_free_heap` gives back free memory at the top too. Call before the threads that
    allocate start. A CPU model worker's device thread otherwise gets an arena of its own, whose
    free top (up to 64 MiB a sub-heap) malloc_trim never returns: the worker's idle RSS wandered
    by 20-40 MiB from one busy period to the next (tests/test_worker_memory.py). A no-op where
    there is no mallopt."""
    try:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass
