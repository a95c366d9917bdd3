"""End to end on a tiny random GQA model: transformers parity, batching, tensor parallelism.
Relies on transformers' Llama modeling code (rotary with llama3 scaling) and greedy `generate` as the oracle."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightllm.tools.bench_model import write_bench_model
from lightllm.utils.net import free_port
from server_utils import start_server

WORDS = "the a model token cache batch river stone light 你好 café 🤖 runs quickly slowly over under".split()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    server = start_server(["--model_dir", str(tiny_dir)], tmp_path_factory.mktemp("tp1") / "server.log")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def server_tp2(tiny_dir, tmp_path_factory):
    args = ["--model_dir", str(tiny_dir), "--tp", "2", "--nccl_port", str(free_port())]
    server = start_server(args, tmp_path_factory.mktemp("tp2") / "server.log")
    yield server
    assert server.stop() == 0


def random_requests(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choices(WORDS, k=rng.randrange(1, 60))), rng.randrange(1, 40)) for _ in range(n)]


def outputs(server, requests, concurrency: int) -> list[dict]:
    """The answers, less `cached_tokens`: how much of a prompt the prefix cache held depends on
    what ran before, the answer must not."""
    def run(request):
        prompt, max_new_tokens = request
        answer = server.generate(prompt, max_new_tokens=max_new_tokens)
        assert 0 <= answer.pop("cached_tokens") < answer["prompt_tokens"]
        return answer

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(run, requests))


def test_greedy_matches_transformers(server, tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, local_files_only=True)
    for prompt, _ in random_requests(4, seed=random.randrange(1 << 30)):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
        result = server.generate(prompt, max_new_tokens=20)
        assert result["generated_text"] == [tokenizer.decode(out, skip_special_tokens=True)]
        assert result["count_output_tokens"] == len(out)


def test_concurrent_requests_match_one_at_a_time(server):
    requests = random_requests(32, seed=random.randrange(1 << 30))
    one_at_a_time = outputs(server, requests, concurrency=1)
    concurrent = outputs(server, requests, concurrency=32)
    assert concurrent == one_at_a_time


def test_tp2_matches_tp1(server, server_tp2):
    requests = random_requests(12, seed=random.randrange(1 << 30))
    assert outputs(server_tp2, requests, concurrency=12) == outputs(server, requests, concurrency=12)
