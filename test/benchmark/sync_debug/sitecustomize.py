"""With SYNC_DEBUG=1: torch's sync debug mode in every process, each call site of a synchronizing
CUDA operation printed to stderr (its stack) the first 3 times and then every 200th, with a count.

Put this folder on PYTHONPATH (Python imports `sitecustomize` at start-up, in the server's child
processes too), e.g. `SYNC_DEBUG=1 PYTHONPATH=test/benchmark/sync_debug:$PYTHONPATH python -m
lightllm.server.api_server ...`, then `grep -A9 '^SYNC' server.log`. Torch's mode is a prototype:
it does not see every synchronizing call (docs/benchmarks-log.md, 2026-11-27, fifth session)."""
import os

if os.environ.get("SYNC_DEBUG") == "1":
    import collections
    import sys
    import time
    import traceback
    import warnings

    import torch

    torch.cuda.set_sync_debug_mode("warn")
    _counts = collections.Counter()
    _show = warnings.showwarning

    def _report(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return _show(message, category, filename, lineno, file, line)
        frames = traceback.extract_stack()[:-2]
        key = tuple(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}:{f.name}" for f in frames[-8:])
        _counts[key] += 1
        n = _counts[key]
        if n <= 3 or n % 200 == 0:
            sys.stderr.write(f"SYNC pid {os.getpid()} t {time.time():.3f} n {n} {message}\n  " + "\n  ".join(key) + "\n")

    warnings.showwarning = _report
    warnings.filterwarnings("always", message=".*synchroniz.*")
