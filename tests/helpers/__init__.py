"""Code the tests share, and the one place that lets them import the benchmark scripts.

helpers.models: tiny random models of each family saved with transformers, runners and engines on
them, and the comparisons with transformers; helpers.fake_runner: ModelRunner's step contract
without a model. The benchmark scripts import as the `benchmark` package from test/
(test/benchmark/README.md): importing this package puts test/ on sys.path. Never test/benchmark
itself: its kernels/ would be found as a top-level `kernels` package, which transformers probes for.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "test" / "benchmark"

if str(BENCHMARK.parent) not in sys.path:
    sys.path.insert(0, str(BENCHMARK.parent))
