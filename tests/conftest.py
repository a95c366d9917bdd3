"""Test setup: offline Hugging Face, and the Triton interpreter when there is no GPU.

Both must be set before anything imports triton or transformers, hence at the top of this file.
"""
import importlib.metadata
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import helpers  # noqa: E402,F401  (puts test/ on the path: the benchmark scripts import as `benchmark`)
import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Under pytest-xdist (the README's command runs two test processes) each process takes its
    # share of the cores: two OpenMP teams of two threads on two cores stall each other, a
    # descheduled thread holding up its whole op. Subprocesses the tests start inherit the share.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if _workers > 1:
        _threads = max(1, (os.cpu_count() or 1) // _workers)
        torch.set_num_threads(_threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a loaded scalar into a loop bound with int() on a 1-element
    array, which numpy >= 2.4 rejects (triton-lang/triton#9171), so `range(start, end)` over
    values loaded in a kernel fails. Re-register the conversion on a squeezed array."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_scalar_index()


def _keep_transformers_delta_rule_in_torch() -> None:
    """Where flash-linear-attention is installed (the `cuda` extra), transformers' decorator puts fla's
    kernels in place of its own torch code for the hybrid models' delta rule, which takes no CPU
    tensors and is the code our CUDA path runs: the oracle stays transformers' torch code."""
    import importlib.util
    import inspect

    if importlib.util.find_spec("fla") is None:
        return
    for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            if hasattr(module, name):
                setattr(module, name, inspect.unwrap(getattr(module, name)))


_keep_transformers_delta_rule_in_torch()


# The releases the tests lean on (transformers as the oracle, triton's interpreter, the tokenizers,
# xgrammar's masks, the HTTP stack): a red run that did not change our code names which one moved.
REPORTED_PACKAGES = ("torch", "transformers", "triton", "tokenizers", "xgrammar", "fastapi")


def pytest_report_header(config) -> str:
    return "versions: " + ", ".join(f"{name} {installed_version(name)}" for name in REPORTED_PACKAGES)


# The slowest files (over 60 s each on 2 cores, one process, 2026-12-04), run first: the README's
# command gives each file whole to the next free test process, and a slow file taken last runs
# alone at the end while the other process has nothing left.
SLOW_FILES = ("test_kernels.py", "test_spec_decode.py", "test_server_lifecycle.py", "test_model_vs_hf.py",
              "test_server_families.py", "test_fused_moe.py", "test_server_fuzz.py", "test_benchmark_client.py",
              "test_server_health.py", "test_multinode.py", "test_hybrid_spec.py", "test_server_openai.py",
              "test_server_openai_fields.py", "test_server_api.py", "test_server_grammar_bounds.py",
              "test_count_launches.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: the rest keep their order


def installed_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@pytest.fixture
def captured_logits(monkeypatch):
    """Every logits tensor the ModelRunner samples from, in order."""
    from lightllm.engine import model_runner, sampling

    seen = []

    def capture(logits, batch):
        seen.append(logits.clone())
        return sampling.sample(logits, batch)

    monkeypatch.setattr(model_runner, "sample", capture)
    return seen


@pytest.fixture(scope="session")
def default_model_dir():
    from lightllm.tools.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_server(default_model_dir, tmp_path_factory):
    """One server on the default model, shared by the HTTP API tests of every file. Its chunk budget
    is 512, not 2048: no test sends it a longer prompt (one past 2048 is refused either way), and
    the start-up's profile step, a full chunk beside a full batch of decodes, takes ~20 s of a
    2-core CPU at 2048 and a few at 512."""
    from server_utils import start_server

    args = ["--model_dir", str(default_model_dir), "--chunked_prefill_size", "512"]
    server = start_server(args, tmp_path_factory.mktemp("server") / "server.log")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session")
def tool_server(tmp_path_factory):
    """One server on a tiny random model whose chat template knows tools (tests/tool_model.py),
    with Qwen3's reasoning parser, shared by the tool, /v1/responses and /v1/messages tests."""
    from server_utils import start_server
    from tool_model import write_tool_model

    model_dir = write_tool_model(tmp_path_factory.mktemp("tool_model"))
    server = start_server(["--model_dir", str(model_dir), "--reasoning_parser", "qwen3"],
                          tmp_path_factory.mktemp("tool_server") / "server.log")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(tool_server):
    """OpenAI's client on the tool server (test_server_messages overrides it with Anthropic's)."""
    from server_utils import openai_client

    return openai_client(tool_server.url)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
