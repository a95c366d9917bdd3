"""The grammar compiler child: small when ready (xgrammar's compiler and the tokenizer's view, no
torch, no tokenizer), the same serialized grammars as a compile in this process, and stopped when
a compile outgrows its memory bound."""

import json

import psutil
import pytest

from lightllm.engine.grammar import Grammars
from lightllm.engine.tokenizer import load_tokenizer
from lightllm.frontend.errors import RequestError
from lightllm.server.httpserver.grammar_worker import CompileStopped, CompileWorker
from server_utils import ref_chain

# What a process may add to the server (issue goal); the child loading the tokenizer and all of
# xgrammar (with torch) was 465 MB when ready.
READY_RSS_BYTES = 200e6
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
          "required": ["city"]}
TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True,
       "stop_after_first": False, "tags": [{"begin": '<tool_call>{"name": "f", "arguments": ', "end": "}</tool_call>",
                                            "content": {"type": "json_schema", "json_schema": SCHEMA}}]}}
GRAMMARS = [("json_schema", json.dumps(SCHEMA)), ("json_object", ""), ("regex", r"[a-z]{2,5}-\d+"),
            ("ebnf", 'root ::= "yes" | "no"'), ("structural_tag", json.dumps(TAG))]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(str(default_model_dir), "auto", False)


@pytest.fixture(scope="module")
def worker(tokenizer):
    worker = CompileWorker(tokenizer, len(tokenizer), [tokenizer.eos_token_id], "info")
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def compiled_here(tokenizer, default_model_dir):
    """The model runner's Grammars, which compiles in its own process (as the offline LLM does)."""
    return Grammars(str(default_model_dir), len(tokenizer), stop_token_ids=[tokenizer.eos_token_id], max_threads=1)


def test_the_child_is_small_when_ready(worker):
    assert psutil.Process(worker.pid).memory_info().rss < READY_RSS_BYTES


@pytest.mark.parametrize("kind, spec", GRAMMARS, ids=[kind for kind, _ in GRAMMARS])
def test_the_child_compiles_what_a_compile_here_gives(worker, compiled_here, kind, spec):
    """What the model runner reads back: the child compiles the grammar's EBNF and the tokenizer's
    view from JSON, the runner's Grammars the grammar itself against the tokenizer."""
    assert worker.compile(kind, spec, lambda: float("inf")) == compiled_here.serialize(kind, spec)


def test_a_grammar_xgrammar_refuses_is_a_400(worker):
    with pytest.raises(RequestError) as raised:
        worker.compile("regex", "[a-", lambda: float("inf"))
    assert raised.value.status_code == 400 and "regex" in str(raised.value)


def test_a_compile_past_its_memory_bound_is_stopped(worker):
    """A chain of 1200 $refs takes about 475 MB to compile; the child is killed past the bound."""
    with pytest.raises(CompileStopped) as stopped:
        worker.compile("json_schema", json.dumps(ref_chain(1200)), lambda: float("inf"))
    assert stopped.value.memory and worker.pid is None
    worker.start()  # and the next compile has one again
    assert worker.compile("regex", "[ab]+", lambda: float("inf"))


def test_a_big_compile_leaves_the_child_near_its_ready_size(worker):
    """A chain of 500 $refs takes about 90 MB to compile and, without a trim of the freed heap after
    it, left tens of MB in the child: now the same child, not a restarted one, is back within 16 MiB
    of ready (the server's few percent)."""
    worker.start()
    pid, ready = worker.pid, worker._ready_rss
    worker.compile("json_schema", json.dumps(ref_chain(500)), lambda: float("inf"))
    assert worker.pid == pid, "restarted: the compile left more than KEPT_MEMORY_BYTES"
    assert psutil.Process(pid).memory_info().rss <= ready + (16 << 20)
