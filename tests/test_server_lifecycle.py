"""Start-up, shutdown and failure: flags, dead children, no orphans, SIGTERM to the process group."""

import concurrent.futures
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lightllm.server.config import ServerConfig
from lightllm.tools.bench_model import TOKENIZER_FILES, write_bench_model
from lightllm.tools.default_model import ensure_default_model
from server_utils import Server, sse_events, start_server, wait_exited


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")


def run_cli(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lightllm.server.api_server", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_help_documents_every_flag():
    help_text = run_cli("--help").stdout
    flags = [f.name for f in dataclasses.fields(ServerConfig) if not f.metadata.get("internal")]
    assert len(flags) >= 18
    for name in flags:
        assert f"--{name}" in help_text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--chunked_prefill_size", "0"], "--chunked_prefill_size must be at least 1"),
        (["--burst_chunked_prefill_size", "100", "--chunked_prefill_size", "200"],
         "--burst_chunked_prefill_size must be 0 (off) or at least --chunked_prefill_size"),
        (["--max_req_input_len", "100", "--max_req_total_len", "50"], "--max_req_total_len must be larger"),
        (["--tp", "0"], "--tp must be at least 1"),
        (["--port", "eighty"], "invalid int value"),
    ],
)
def test_bad_flags_fail_at_once_with_a_clear_message(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_a_port_in_use_fails_at_once_with_one_line_before_the_model_is_looked_for(tmp_path):
    """An empty model cache: had the server looked for the default model first, it would build it."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        result = run_cli("--port", str(port), env={**os.environ, "LIGHTLLM_CACHE": str(tmp_path)})
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.endswith(f"cannot listen on 127.0.0.1:{port}: address already in use")
    assert result.stdout == "" and not any(tmp_path.iterdir())


def test_unloadable_model_fails_start_up_with_a_clear_message(tmp_path):
    model_dir = tmp_path / "not_a_model"
    model_dir.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy2(ensure_default_model() / name, model_dir / name)
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["GPT17ForMagic"]}))
    result = subprocess.run(
        [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(model_dir), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert f"cannot load the model from {model_dir}" in result.stderr and "GPT17ForMagic" in result.stderr
    assert "the router process" in result.stderr and "before it was ready" in result.stderr


def test_killed_main_process_takes_its_children_along(tiny_dir, tmp_path):
    server = start_server(["--model_dir", str(tiny_dir)], tmp_path / "server.log")
    family = server.processes()
    assert len(server.model_workers()) == 1
    server.proc.send_signal(signal.SIGKILL)  # no chance to clean up: the children must notice alone
    server.proc.wait(timeout=10)
    gone, alive = wait_exited(family[1:], timeout=20)
    assert not alive, f"orphans: {alive}"
    server.stop()


def _slow_child(pipe, parent_pid: int) -> None:
    from lightllm.utils.process import STACKS_SIGNAL, init_child_process

    init_child_process(parent_pid, "INFO")
    time.sleep(2.5)  # a slow model load
    # A report can still come after this (the parent passes the signal on 0.2 s after its own
    # dump), and while the interpreter exits its handler is gone, so the default action would end
    # the child with -SIGUSR2 (it did in CI). A server's children never exit after their start;
    # this one does, so it takes no more stacks signals once its stacks have been checked.
    signal.pthread_sigmask(signal.SIG_BLOCK, [STACKS_SIGNAL])
    pipe.send("ready")


def test_a_slow_start_reports_every_process_stacks_and_goes_on(monkeypatch, caplog, capfd):
    """A start not ready after LIGHTLLM_STARTUP_REPORT_S seconds says so, and every process (the
    main one, then its children, passed on) prints its stacks; the wait goes on until the child is
    ready."""
    import faulthandler
    import multiprocessing

    from lightllm.server import api_server
    from lightllm.utils.process import STACKS_SIGNAL, dump_stacks_on_signal, start_signals_blocked

    monkeypatch.setenv("LIGHTLLM_STARTUP_REPORT_S", "1")
    dump_stacks_on_signal()  # as the server's main process does first
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_slow_child, args=(theirs, os.getpid()))
    try:
        with start_signals_blocked():  # as the server starts its children: the signal waits for their set-up
            child.start()
        theirs.close()
        assert api_server.wait_until_ready([api_server.Child("slow one", child, ours)]) == []
    finally:
        child.join(10)
        faulthandler.unregister(STACKS_SIGNAL)
        signal.signal(STACKS_SIGNAL, signal.SIG_DFL)
    reports = [r.getMessage() for r in caplog.records if "not ready after" in r.getMessage()]
    assert reports and reports[0].startswith("not ready after 1 s (slow one still starting)")
    err = capfd.readouterr().err
    assert "wait_until_ready" in err  # this process's stack
    assert "_slow_child" in err  # the child's, in its sleep
    assert child.exitcode == 0


def write_small_vocab_model(out):
    """A model that knows only the tokenizer's first 2000 ids: longer ids make the runner raise."""
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=2000, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy2(ensure_default_model() / name, out / name)
    return out


@pytest.fixture(scope="module")
def small_vocab_server(tmp_path_factory):
    """One server on the small-vocabulary model for the tests that leave it running: started
    without waiting for /health, so that the first /health after the serving line is the one
    test_the_first_health_after_the_serving_line_is_200 checks. Its teardown is the SIGTERM that
    must stop it with status 0 and leave no process behind (Server.stop)."""
    model_dir = write_small_vocab_model(tmp_path_factory.mktemp("small_vocab"))
    server = Server(["--model_dir", str(model_dir)], tmp_path_factory.mktemp("small_vocab_server") / "server.log")
    try:
        line = server.wait_for_log_line(f"serving {model_dir} on ")
        first_health = server.health()
        yield SimpleNamespace(server=server, model_dir=model_dir, serving_line=line, first_health=first_health)
    finally:
        assert server.stop() == 0


def test_the_first_health_after_the_serving_line_is_200(small_vocab_server):
    server, model_dir = small_vocab_server.server, small_vocab_server.model_dir
    assert small_vocab_server.first_health == 200
    assert small_vocab_server.serving_line.endswith(f"serving {model_dir} on {server.url}")


def test_a_failing_request_gets_a_500_and_the_others_go_on(small_vocab_server):
    server = small_vocab_server.server
    body = {"inputs": "a b c d", "parameters": {"max_new_tokens": 100, "ignore_eos": True}}
    with requests.post(f"{server.url}/generate_stream", json=body, stream=True, timeout=120) as stream:
        lines = (line for line in stream.iter_lines() if line)
        first = json.loads(next(lines)[len(b"data:"):])
        failed = server.post("/generate", {"inputs": "photosynthesis"})  # token ids past 2000
        rest = [json.loads(line[len(b"data:"):]) for line in lines]
    assert failed.status_code == 500
    assert failed.json()["error_type"] == "internal" and "out of range" in failed.json()["error"]
    assert not first["finished"] and rest[-1]["finished"] and rest[-1]["finish_reason"] == "length"
    assert 1 + len(rest) == 100
    openai_failed = server.post("/v1/completions", {"prompt": "photosynthesis"})
    assert openai_failed.status_code == 500
    error = openai_failed.json()["error"]
    assert error["type"] == "internal" and "out of range" in error["message"]
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    server.wait_for(lambda: server.metrics()["lightllm:kv_cache_used_tokens"] == 0, what="all tokens free")


def test_sigusr2_to_the_main_process_prints_every_process_stacks_and_the_server_goes_on(small_vocab_server):
    """`kill -USR2 MAIN_PID` on a running server: the main process and, passed on, each of its
    processes (router, detokenizer, model worker) print their threads' stacks to the log, none
    stops, and the server answers as before; SIGTERM then stops it cleanly (the fixture's
    teardown: status 0, no process left)."""
    server = small_vocab_server.server
    family = server.processes()
    servers = [p for p in family if p.pid == server.proc.pid or "spawn_main" in " ".join(p.cmdline())]
    assert len(servers) == 4  # main, router, detokenizer, model worker (not the resource tracker)
    before = server.generate("a b c d", max_new_tokens=4)["generated_text"]
    earlier = len(server.log_text())  # what the fixture's start and the tests before wrote
    server.proc.send_signal(signal.SIGUSR2)
    # faulthandler's header for the thread that took the signal, once per process
    server.wait_for(lambda: server.log_text()[earlier:].count("Current thread") >= len(servers),
                    what="every process's stacks")
    log = server.log_text()[earlier:]
    assert "serve_http" in log and "run_model_worker" in log  # the main process's and the worker's main threads
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family)
    assert server.generate("a b c d", max_new_tokens=4)["generated_text"] == before


def unavailable_event(event: dict) -> bool:
    return event["finish_reason"] == "error" and event["error_type"] == "unavailable"


LONG = {"max_new_tokens": 1000, "ignore_eos": True}  # far longer than the drain


def whole_request(server, i: int) -> requests.Response:
    if i % 2:
        return server.post("/v1/completions", {"prompt": f"whole {i}", "max_tokens": 1000, "ignore_eos": True})
    return server.post("/generate", {"inputs": f"whole {i}", "parameters": LONG})


def test_sigterm_to_the_process_group_drains_as_sigterm_to_the_main_process_does(tiny_dir, tmp_path):
    """`kill -TERM -- -PGID` (a container's stop, a supervisor) reaches every process of the server.
    The children ignore it and go on until the main process has drained and stops them: of 40 open
    requests, streamed and whole, each finishes or ends as unavailable, none gets a 500, the exit
    status is 0 and no process is left."""
    open_each = 20
    args = ["--model_dir", str(tiny_dir), "--shutdown_timeout", "3", "--max_total_token_num", "60000"]
    server = start_server(args, tmp_path / "server.log", own_process_group=True)
    family = server.processes()
    (socket_dir,) = server.socket_dirs()
    streams = [server.stream({"inputs": f"stream {i}", "parameters": LONG}) for i in range(open_each)]
    events = [sse_events(stream) for stream in streams]
    for stream_events in events:
        next(stream_events)
    with concurrent.futures.ThreadPoolExecutor(open_each) as pool:
        wholes = [pool.submit(whole_request, server, i) for i in range(open_each)]
        server.wait_for(lambda: server.metrics()["lightllm:num_requests_running"] == 2 * open_each,
                        what="40 requests running")
        os.killpg(server.proc.pid, signal.SIGTERM)
        lasts = [list(stream_events)[-1] for stream_events in events]
        replies = [whole.result() for whole in wholes]
    for last in lasts:
        assert last["finish_reason"] == "length" or unavailable_event(last), last
    for i, reply in enumerate(replies):
        assert reply.status_code in (200, 503), reply.text
        if reply.status_code == 503:
            error = reply.json()["error"]
            assert (error["type"] if i % 2 else reply.json()["error_type"]) == "unavailable"
    assert server.proc.wait(timeout=60) == 0
    gone, alive = wait_exited(family, timeout=10)
    assert not alive, f"left behind: {alive}"
    assert not socket_dir.exists()
    log = server.log_text()
    assert "exited with code" not in log and "Traceback" not in log and "killing it" not in log
    server.stop()


def test_a_second_sigterm_stops_at_once(tiny_dir, tmp_path):
    """The first SIGTERM drains for up to --shutdown_timeout (here far longer than the test); a
    second one ends the open requests as unavailable and stops the server now, with status 0."""
    server = start_server(["--model_dir", str(tiny_dir), "--shutdown_timeout", "600"], tmp_path / "server.log")
    family = server.processes()
    with server.stream({"inputs": "cut me", "parameters": {"max_new_tokens": 2500, "ignore_eos": True}}) as stream:
        events = sse_events(stream)
        next(events)
        server.proc.send_signal(signal.SIGTERM)
        server.wait_for(lambda: server.health() == 503, what="/health 503 while draining")
        server.proc.send_signal(signal.SIGTERM)
        last = list(events)[-1]
    assert unavailable_event(last) and last["error"] == "the server is shutting down"
    assert server.proc.wait(timeout=60) == 0
    gone, alive = wait_exited(family, timeout=10)
    assert not alive, f"left behind: {alive}"
    server.stop()


def test_a_stop_signal_during_a_child_start_stops_once_the_child_is_registered(monkeypatch):
    """The router's stop handler, run while it starts a model worker (the race the start-up test
    below can hit: the worker, not yet among active_children, was left reading its start-up data
    from a closed pipe and printed an EOFError): it waits for the start, then stops and exits."""
    from lightllm.utils import process

    calls = []
    monkeypatch.setattr(process, "_deferred", None)
    monkeypatch.setattr(process, "stop_processes", lambda children: calls.append("stop children"))
    monkeypatch.setattr(process.logging, "shutdown", lambda: None)
    monkeypatch.setattr(process.os, "_exit", lambda code: calls.append(("exit", code)))
    with process.starting_child():
        with process.starting_child():
            process._exit_on_stop(process.STOP_SIGNAL, None)  # as the signal, mid-start
        assert calls == []  # the outer start is still going
    assert calls == ["stop children", ("exit", 0)]
    process._exit_on_stop(process.STOP_SIGNAL, None)  # outside a start: at once
    assert calls[2:] == ["stop children", ("exit", 0)]


def test_the_main_process_stop_waits_for_a_child_start_too(monkeypatch):
    """The main process's SIGTERM handler (SystemExit), run inside a router's or the detokenizer's
    start (Python runs a handler that arrived just before the signals were blocked at the next
    bytecode, also inside Process.start()): the start ends first, then the stop unwinds."""
    from lightllm.server import api_server
    from lightllm.utils import process

    monkeypatch.setattr(process, "_deferred", None)
    monkeypatch.setattr(api_server, "_stop_signals", [])
    started = False
    with pytest.raises(SystemExit):
        with process.starting_child():
            api_server.stop_when_asked(signal.SIGTERM, None)
            started = True  # the rest of the start still runs
    assert started and api_server.stop_asked()


STOP_INSIDE_A_DEL = """
import os, signal
from lightllm.server import api_server
api_server.catch_stop_signals()

class Collected:
    def __del__(self):  # as the garbage collector runs one while the tokenizer loads
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the handler runs between two of these bytecodes
            pass

Collected()
print("stop asked:", api_server.stop_asked())
"""


def test_a_stop_inside_a_del_is_recorded_and_prints_no_traceback():
    """SIGTERM while the garbage collector runs a __del__: Python cannot raise the handler's
    SystemExit there. The stop is recorded for the next step of the start to see, and the log shows
    no traceback for it."""
    done = subprocess.run([sys.executable, "-c", STOP_INSIDE_A_DEL], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    assert "stop asked: True" in done.stdout
    assert "Traceback" not in done.stderr and "SystemExit" not in done.stderr, done.stderr


@pytest.mark.parametrize("stage", ["children importing", "model worker loading"])
def test_sigterm_to_the_process_group_during_start_up_stops_cleanly(tiny_dir, tmp_path, stage):
    """A stop in the first seconds (a supervisor that gives up, a container stopped at once) reaches
    every process while the children still import or load the model: the start ends with exit
    status 0, no process left and no socket directory left."""
    server = Server(["--model_dir", str(tiny_dir)], tmp_path / "server.log", own_process_group=True)
    main = psutil.Process(server.proc.pid)
    if stage == "children importing":
        server.wait_for(lambda: len(main.children()) >= 2, timeout=60, what="router and detokenizer spawned")
    else:
        server.wait_for(lambda: server.model_workers(), timeout=120, what="a model worker spawned")
    family = server.processes()
    socket_dirs = server.socket_dirs()
    os.killpg(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.log_text()[-3000:]
    gone, alive = wait_exited(family, timeout=10)
    assert not alive, f"left behind: {alive}"
    assert not any(d.exists() for d in socket_dirs) and not server.socket_dirs()
    assert "Traceback" not in server.log_text(), server.log_text()[-3000:]
    server.stop()
