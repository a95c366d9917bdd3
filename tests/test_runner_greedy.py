"""Greedy continuations of the default model (SmolLM2-135M-Instruct, fp32, CPU) through
ModelRunner equal transformers' `generate(do_sample=False)` token for token, whether the
prompts run one at a time or as one mixed batch (prefill together, decode together).
Relies on transformers' Llama modeling code and `generate` as the oracle, and on its tokenizer and chat template for the prompts."""

import pytest
import torch
from helpers.models import make_runner
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightllm.engine.request import SamplingParams
from benchmark.lib.direct_step import run_step
from lightllm.tools.default_model import ensure_default_model

NEW_TOKENS = 32
TEXTS = ["The capital of France is", "def fibonacci(n):\n   ",
         "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model()


@pytest.fixture(scope="module")
def prompts(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write one sentence about the moon."}],
                                         add_generation_prompt=True, tokenize=False)
    return [tokenizer(text).input_ids for text in TEXTS + [chat]]


@pytest.fixture(scope="module")
def hf_greedy(model_dir, prompts):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # always NEW_TOKENS tokens, as the runner gives
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module")
def runner(model_dir):
    return make_runner(model_dir, tokens=1024, max_req_total_len=128)


def generate(runner, prompts, first_id):
    """NEW_TOKENS greedy tokens for each prompt, all in one batch."""
    ids = list(range(first_id, first_id + len(prompts)))
    out = run_step(runner, prompts=[(i, p, SamplingParams()) for i, p in zip(ids, prompts)])
    tokens = [[tok] for tok, _ in out]
    logprobs = [lp for _, lp in out]
    for _ in range(NEW_TOKENS - 1):
        for seq, (tok, lp) in zip(tokens, run_step(runner, ids)):
            seq.append(tok)
            logprobs.append(lp)
    runner.free(ids)
    assert all(-100 < lp <= 0 for lp in logprobs)
    return tokens


def test_one_at_a_time_matches_transformers(runner, prompts, hf_greedy):
    for i, (prompt, expected) in enumerate(zip(prompts, hf_greedy)):
        assert generate(runner, [prompt], first_id=i) == [expected]
    assert runner.stats()["tokens_used"] == 0


def test_mixed_batch_matches_transformers(runner, prompts, hf_greedy):
    assert len({len(p) for p in prompts}) == len(prompts), "prompts of different lengths"
    assert generate(runner, prompts, first_id=100) == hf_greedy
    assert runner.stats() == {"tokens_used": 0, "max_total_token_num": 1024, "running_requests": 0, "cache_nodes": 0,
                              "host_tokens_used": 0}
