"""The engine core (scheduler + model runner in process, no sockets): chunked prefill mixed with
running decodes equals transformers' greedy generate; overlap on and off give the same tokens;
an abort mid-prefill frees its chunks' slots; idle, every KV slot is free.
Relies on transformers' Llama, Qwen2, Qwen3 and Qwen3-MoE modeling code (rotary with llama3 scaling) and its greedy
`generate` as the oracle."""

import pytest
import torch
from helpers.models import assert_idle, engine, hf_greedy, make_model, make_runner
from transformers import AutoModelForCausalLM

from lightllm.engine.core import EngineCore
from lightllm.engine.request import FinishReason, GenerateReq, SamplingParams
from seeds import fresh_seed  # noqa: E402

NEW_TOKENS = 6
PROMPT_LENS = (5, 50, 17, 1, 33)
SAMPLED = dict(do_sample=True, temperature=0.9, top_k=30, top_p=0.95, seed=1234)


def random_prompts(vocab: int, lengths=PROMPT_LENS, seed=None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed if seed is not None else fresh_seed("torch seed"))
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def generate(core: EngineCore, prompts, params: SamplingParams, stagger: int = 0) -> dict[int, list[int]]:
    """Every prompt to the end. With `stagger`, request 0 decodes alone for that many steps
    before the others arrive, so their chunks run beside its decodes."""
    tokens: dict[int, list[int]] = {}

    def collect(outs):
        for out in outs:
            assert out.finish_reason in (None, FinishReason.LENGTH), out
            tokens.setdefault(out.req_id, []).append(out.token_id)

    core.add(GenerateReq(0, prompts[0], params))
    for _ in range(stagger):
        collect(core.step())
    for i, prompt in enumerate(prompts[1:], 1):
        core.add(GenerateReq(i, prompt, params))
    collect(core.drain())
    return tokens


@pytest.mark.parametrize("name", ["llama_gqa_llama3_rope", "qwen2_bias_tied", "qwen3_tied_bias", "qwen3_moe"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_with_running_decodes_equals_transformers(name, chunk, tmp_path):
    hf_model = make_model(name, tmp_path)
    runner = make_runner(tmp_path, tokens=512)
    prompts = random_prompts(hf_model.config.vocab_size)
    expected = hf_greedy(hf_model, prompts, NEW_TOKENS)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    for stagger in (0, 3):  # alone, and beside a running decode
        core = engine(runner, chunk)
        assert generate(core, prompts, params, stagger) == expected
        assert_idle(core)


@pytest.fixture(scope="module")
def default_runner(default_model_dir):
    return make_runner(default_model_dir, tokens=2048, max_req_total_len=256)


@pytest.fixture(scope="module")
def default_hf(default_model_dir):
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_default_model_chunked_equals_transformers(chunk, default_runner, default_hf):
    prompts = random_prompts(default_hf.config.vocab_size, lengths=(40, 9, 23), seed=chunk)
    expected = hf_greedy(default_hf, prompts, 4)
    core = engine(default_runner, chunk)
    got = generate(core, prompts, SamplingParams(max_new_tokens=4), stagger=2)
    assert got == expected
    assert_idle(core)


@pytest.mark.parametrize("params", [dict(), SAMPLED], ids=["greedy", "seeded"])
def test_overlap_on_and_off_and_sequential_give_the_same_tokens(params, tmp_path):
    hf_model = make_model("llama_gqa_llama3_rope", tmp_path)
    runner = make_runner(tmp_path, tokens=512)
    prompts = random_prompts(hf_model.config.vocab_size)
    sampling = SamplingParams(max_new_tokens=12, **params)
    runs = []
    for overlap in (True, False):
        core = engine(runner, 16, overlap=overlap, prefix_cache=False)
        runs.append(generate(core, prompts, sampling, stagger=2))
        assert_idle(core)
    core = engine(runner, 16, prefix_cache=False)
    sequential = {i: generate(core, [p], sampling)[0] for i, p in enumerate(prompts)}
    assert runs[0] == runs[1] == sequential
    assert all(len(t) == 12 for t in sequential.values())
    assert_idle(core)


def test_an_abort_mid_prefill_frees_its_chunks(tmp_path):
    make_model("llama_gqa_llama3_rope", tmp_path)
    runner = make_runner(tmp_path, tokens=512)
    core = engine(runner, chunk=8)
    core.add(GenerateReq(0, random_prompts(101, lengths=(40,))[0], SamplingParams(max_new_tokens=4)))
    core.step()
    core.step()
    assert 8 <= runner.token_table.used_count <= 16  # two chunks launched; one may still be in flight
    assert core.abort(0)
    assert core.drain() == []
    assert core.scheduler.cached_tokens == 16  # its two computed chunks stay cached
    assert_idle(core)
    assert not core.abort(0)  # already gone
