"""Entry point: `python -m lightllm.server.api_server [flags]` (`--help` lists them).

The main process first takes the HTTP port (a port in use fails at once, with one line), then
starts the router (which starts one model worker per tensor-parallel rank; one router per --dp
replica) and the detokenizer, waits until each reports ready, then serves HTTP itself, and logs
"serving ... on http(s)://HOST:PORT" once /health answers 200. If a child process dies, every open
request ends with an error naming it, and the server stops with a non-zero exit status.
SIGTERM or Ctrl-C (to the main process or its whole group) drains: new requests get 503, open
ones have --shutdown_timeout seconds to finish and then end as unavailable (503 with Retry-After);
then every child stops. Either signal before the server serves stops the start, exit status 0.
The socket directory goes in every case (a SIGKILL's is removed by the next start).
With --nnodes > 1, node 0 runs as above and drives the other nodes' ranks too; a node with
--node_rank > 0 runs only its model workers (`node.py`).
"""

# Spawned children import this module again (as __mp_main__): keep the imports at the top light.
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lightllm.server.config import ServerConfig, parse_config
from lightllm.server.io_struct import RouterHeartbeat, RouterReady
from lightllm.utils.process import (GROUP_SIGNALS, STACKS_SIGNAL, deferred_while_starting, dump_stacks_on_signal,
                                    freeze_startup_heap, setup_logging, start_signals_blocked, starting_child,
                                    stop_processes)

if TYPE_CHECKING:
    from lightllm.server.httpserver.manager import HttpServerManager

logger = logging.getLogger("lightllm.server")

# Seconds of start-up (model load, profile step, graph capture) between two reports of a start not
# yet ready, each with every process's stacks (wait_until_ready); the variable overrides it (0: none).
STARTUP_REPORT_S = 600.0
STARTUP_REPORT_ENV = "LIGHTLLM_STARTUP_REPORT_S"


@dataclass
class Child:
    name: str
    process: multiprocessing.Process
    ready_pipe: multiprocessing.connection.Connection  # our end: the child sends one ready message


def router_name(replica: int, replicas: int) -> str:
    return "router" if replicas == 1 else f"router {replica}"


def start_children(config: ServerConfig, heartbeats: list[RouterHeartbeat], children: list[Child]) -> None:
    """One router per --dp replica (each starts its model workers), and the detokenizer, each added
    to `children` as it starts (a stop signal may end this midway: the caller stops those started)."""
    from lightllm.server.detokenization.manager import start_detokenization_process
    from lightllm.server.router.manager import start_router_process

    context = multiprocessing.get_context("spawn")
    routers = [(router_name(d, config.dp), start_router_process, (heartbeat, d)) for d, heartbeat in enumerate(heartbeats)]
    for name, target, extra in (*routers, ("detokenizer", start_detokenization_process, ())):
        ours, theirs = context.Pipe(duplex=False)
        process = context.Process(target=target, args=(config, theirs, os.getpid(), *extra), name=name)
        with start_signals_blocked(), starting_child():
            process.start()
            children.append(Child(name, process, ours))
        theirs.close()


def wait_until_ready(children: list[Child]) -> list[RouterReady] | None:
    """Block until every child reports ready (None if one dies first); return the routers' reports.
    Every STARTUP_REPORT_S seconds without them it says so, and every process prints its stacks into
    the log (STACKS_SIGNAL): a start that stalls (a model on a slow disk, a collective or a kernel
    that never ends) shows where each process waits."""
    waiting = {child.ready_pipe: child for child in children}
    reports = {}
    every = float(os.environ.get(STARTUP_REPORT_ENV, STARTUP_REPORT_S))
    start = time.monotonic()
    while waiting:
        ready = multiprocessing.connection.wait(list(waiting), timeout=every if every > 0 else None)
        if not ready:
            logger.warning("not ready after %.0f s (%s still starting); every process's stacks follow",
                           time.monotonic() - start, ", ".join(child.name for child in waiting.values()))
            os.kill(os.getpid(), STACKS_SIGNAL)  # this process's, then passed on to its children
        for pipe in ready:
            child = waiting.pop(pipe)
            try:
                reports[child.name] = pipe.recv()
            except EOFError:  # it exited without a report
                child.process.join()
                logger.error(
                    "the %s process (pid %d) exited with code %s before it was ready; see its log above",
                    child.name, child.process.pid, child.process.exitcode,
                )
                return None
    return [report for report in reports.values() if isinstance(report, RouterReady)]


def listen_http(config: ServerConfig) -> socket.socket:
    """The HTTP socket, bound and listening before anything else starts, so that a port in use
    fails at once, not after the model has loaded. Listening (not only binding) holds the port:
    two SO_REUSEADDR sockets may both bind one port while neither listens. Connections made
    while the model loads wait in the backlog and are answered once the server serves."""
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a predecessor's TIME_WAIT does not block us
        sock.bind((config.host, config.port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def announce_serving(config: ServerConfig, sock: socket.socket, manager: HttpServerManager) -> None:
    """Log where the server serves, once uvicorn accepts connections and /health's own condition
    holds, so that a client reading the line gets 200 from its first /health."""
    url = f"{config.scheme}://{config.host}:{sock.getsockname()[1]}"
    problem = manager.health_problem()
    if problem is None:
        logger.info("serving %s on %s", config.model_dir, url)
    else:
        logger.error("listening on %s, but unhealthy: %s", url, problem)


PROBE_PATHS = ("/health", "/metrics")


def no_probe_lines(record: logging.LogRecord) -> bool:
    """Leaves out the access-log lines of load balancers' and Prometheus' probes, a line every few
    seconds each that would bury the requests (uvicorn's args: client, method, path, version, status)."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (len(args) > 2 and isinstance(args[2], str) and args[2].split("?")[0] in PROBE_PATHS)


def serve_http(config: ServerConfig, tokenizer, ready: list[RouterReady], heartbeats: list[RouterHeartbeat],
               sock: socket.socket, children: list[Child]) -> int:
    """Serve until Ctrl-C/SIGTERM (exit status 0, after draining) or until a child process dies (1)."""
    import uvicorn
    import uvloop

    from lightllm.server.httpserver.app import create_app
    from lightllm.server.httpserver.connections import guarded_protocol

    app = create_app(config, tokenizer, ready, heartbeats)
    manager = app.state.server.manager
    # Every request has ended before uvicorn stops; this bounds the writing of their last bytes.
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=3,
                                           ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                                           http=guarded_protocol(config.request_receive_timeout,
                                                                 config.max_connections),
                                           timeout_keep_alive=config.keep_alive_timeout))
    if config.log_level != "debug":  # after uvicorn.Config, which sets its loggers up
        logging.getLogger("uvicorn.access").addFilter(no_probe_lines)
    freeze_startup_heap()
    exit_code = 0
    drain_task = None

    def on_child_exit(child: Child) -> None:
        nonlocal exit_code
        asyncio.get_running_loop().remove_reader(child.process.sentinel)
        child.process.join()
        reason = f"the {child.name} process (pid {child.process.pid}) exited with code {child.process.exitcode}"
        logger.error("%s; shutting the server down", reason)
        exit_code = 1
        manager.fail_all(reason)
        server.should_exit = True

    async def drain() -> None:
        logger.info("shutting down: new requests get 503; %d open ones have %g s to finish",
                    manager.open_requests, config.shutdown_timeout)
        manager.refuse_new("the server is shutting down")
        if not await manager.wait_idle(config.shutdown_timeout):
            logger.warning("ending %d requests still open after %g s", manager.open_requests, config.shutdown_timeout)
            manager.end_all_unavailable("the server is shutting down")
        server.should_exit = True

    def begin_drain() -> None:
        nonlocal drain_task
        if drain_task is None:
            drain_task = asyncio.ensure_future(drain())
        else:  # a second signal: stop now
            manager.end_all_unavailable("the server is shutting down")
            server.should_exit = True

    async def start_and_announce(sockets: list[socket.socket]) -> None:
        await uvicorn.Server.startup(server, sockets)  # returns once it accepts connections
        if server.started:  # else it failed and said why
            announce_serving(config, sock, manager)

    async def run() -> None:
        if stop_asked():  # before uvicorn takes the signals over: see stop_when_asked
            return
        loop = asyncio.get_running_loop()
        for child in children:
            loop.add_reader(child.process.sentinel, on_child_exit, child)  # readable when it exits
        # uvicorn's handler of SIGINT and SIGTERM; it runs between two bytecodes, so it only schedules.
        server.handle_exit = lambda signum, frame: loop.call_soon_threadsafe(begin_drain)
        server.startup = start_and_announce
        await server.serve(sockets=[sock])

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())
    return exit_code


_stop_signals: list[int] = []  # SIGTERM / SIGINT received before uvicorn handles them


@deferred_while_starting
def stop_when_asked(signum, frame) -> None:
    """SIGTERM or SIGINT before the server serves: unwind (the `finally` blocks stop the children),
    exit status 0. SystemExit raised inside a __del__ or a weakref callback (the garbage collector
    runs during the tokenizer's load) is dropped (drop_the_stops_exit): `stop_asked` is checked
    between the steps of the start too."""
    _stop_signals.append(signum)
    sys.exit(0)


def stop_asked() -> bool:
    return bool(_stop_signals)


def drop_the_stops_exit(unraisable) -> None:
    """sys.unraisablehook: the stop's SystemExit where Python cannot raise it (a __del__) is not an
    error to print as one; anything else goes to the default hook."""
    if issubclass(unraisable.exc_type, SystemExit) and stop_asked():
        return
    sys.__unraisablehook__(unraisable)


def catch_stop_signals() -> None:
    sys.unraisablehook = drop_the_stops_exit
    for signum in GROUP_SIGNALS:
        signal.signal(signum, stop_when_asked)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    setup_logging(config.log_level)
    dump_stacks_on_signal()
    catch_stop_signals()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub; children inherit it
    if config.node_rank > 0:  # no HTTP: only model workers
        from lightllm.server.node import serve_node

        return serve_node(resolve_model_dir(config))
    try:
        sock = listen_http(config)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", config.host, config.port, (exc.strerror or str(exc)).lower())
        return 1
    with sock:
        # After the port is ours: the default model's first start converts it.
        config = resolve_model_dir(config).with_addresses()
        try:
            return serve(config, sock)
        finally:
            shutil.rmtree(config.socket_dir, ignore_errors=True)


def resolve_model_dir(config: ServerConfig) -> ServerConfig:
    """The config with its model directory (the default model's, prepared on first use) and its name."""
    model_dir = config.model_dir
    if model_dir is None:
        from lightllm.tools.default_model import ensure_default_model

        model_dir = str(ensure_default_model())
    return dataclasses.replace(config, model_dir=model_dir,
                               served_model_name=config.served_model_name or Path(model_dir).resolve().name)


def serve(config: ServerConfig, sock: socket.socket) -> int:
    heartbeats = [RouterHeartbeat(multiprocessing.get_context("spawn")) for _ in range(config.dp)]
    children: list[Child] = []
    try:
        start_children(config, heartbeats, children)
        from lightllm.frontend.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config)  # while the children load the model
        if stop_asked():
            return 0
        ready = wait_until_ready(children)
        if ready is None or stop_asked():
            return 0 if stop_asked() else 1
        return serve_http(config, tokenizer, ready, heartbeats, sock, children)
    finally:
        # The router first stops its workers (waiting up to 5 s; a GPU worker's exit can take
        # seconds): an equal wait here could kill it midway.
        stop_processes([child.process for child in children], timeout=20.0)
        logger.info("server stopped")


def run_main() -> None:
    """main(), then exit without running C++ destructors: a grammar still compiling on the HTTP
    process's daemon thread (grammar_cache.py) would end in std::terminate, and an abort. Every
    `finally` has run by then (children stopped, socket directory removed)."""
    try:
        code = main()
    except SystemExit as exc:  # a stop signal's handler
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_main()
