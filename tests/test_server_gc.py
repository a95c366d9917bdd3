"""Each server process freezes its start-up heap (gc.freeze) before it serves, so that no full
garbage collection walks the ~350k objects of its start while the first requests wait: with the
heaps unfrozen, the HTTP process and the model worker each ran full collections of 160-290 ms
(2 CPU cores) within the first seconds of serving."""

from __future__ import annotations

import os
import re

import pytest
import requests

from benchmark.lib.server_process import start_server

# Imported by every Python process of the server (sitecustomize on its PYTHONPATH): before each
# full collection, the process's name and the objects that collection is about to walk.
PROBE = '''
import gc, multiprocessing, os
def _record(phase, info):
    if phase == "start" and info["generation"] == 2:
        with open(os.path.join({out!r}, f"{{os.getpid()}}.txt"), "a") as f:
            f.write(f"{{multiprocessing.current_process().name}} {{len(gc.get_objects())}}\\n")
gc.callbacks.append(_record)
'''
SERVING = ("MainProcess", "router", "detokenizer", "model_worker_0")  # HTTP, router, detokenizer, worker


@pytest.mark.timeout(300)
def test_no_full_collection_walks_the_start_up_heap_while_serving(tmp_path):
    from lightllm.tools.bench_model import write_bench_model

    model = write_bench_model(tmp_path / "tiny", "tiny", seed=0)
    probe, walks = tmp_path / "probe", tmp_path / "walks"
    probe.mkdir(), walks.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE.format(out=str(walks)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(probe), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    server = start_server(["--model_dir", str(model), "--max_total_token_num", "8192"], tmp_path / "server.log",
                          own_session=True, env=env)
    try:
        for f in walks.iterdir():  # the start's own collections
            f.unlink()
        for i in range(24):  # each token's messages pass through every process
            body = {"prompt": f"request {i}: " + "tell me more " * (4 + i), "max_tokens": 12, "ignore_eos": True,
                    "stream": i % 2 == 0}
            assert requests.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
    finally:
        log = server.log_text()
        assert server.stop() == 0
    frozen = dict(re.findall(r"\[(\w+)\] lightllm\.utils\.process: start-up heap frozen: (\d+) objects", log))
    assert set(SERVING) <= set(frozen), frozen  # each says how many objects its start left
    assert all(int(frozen[name]) > 10_000 for name in SERVING), frozen  # the router ~30k, the others ~300k
    # a full collection while serving walks what came since, never the start's heap again
    walked = [line.split() for f in walks.iterdir() for line in f.read_text().splitlines()]
    assert all(int(count) < int(frozen[name]) / 2 for name, count in walked if name in SERVING), (walked, frozen)
