"""Mixture-of-experts models end to end: tiny random Mixtral and Qwen3-MoE (fp32) served at --tp 1
give transformers' greedy tokens (through the torch reference of the fused MoE: the CPU path), and
the qwen3-30b-a3b benchmark preset is a config the server accepts, split as it would be over GPUs.
Relies on transformers' Mixtral and Qwen3-MoE modeling code and greedy `generate` as the oracle."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightllm.models import read_config
from lightllm.models.layers import split_even
from lightllm.tools.bench_model import write_bench_model
from lightllm.utils.dist import TPGroup
from server_utils import preset_server

WORDS = "the a model token expert router batch river stone light 你好 café runs quickly over under".split()


@pytest.fixture(scope="module", params=["tiny-mixtral", "tiny-qwen3-moe"])
def moe_server(request, tmp_path_factory):
    with preset_server(tmp_path_factory, request.param) as (model_dir, server):
        yield server, model_dir


def test_greedy_matches_transformers(moe_server):
    server, model_dir = moe_server
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    rng = random.Random(random.randrange(1 << 30))
    for _ in range(3):
        prompt = " ".join(rng.choices(WORDS, k=rng.randrange(1, 40)))
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        result = server.generate(prompt, max_new_tokens=16)
        assert result["generated_text"] == [tokenizer.decode(out, skip_special_tokens=True)], prompt
        assert result["count_output_tokens"] == len(out)


def test_qwen3_30b_a3b_preset_is_accepted_and_splits_over_8_ranks(default_model_dir, tmp_path):
    model_dir = write_bench_model(tmp_path / "qwen3-30b-a3b", "qwen3-30b-a3b", tokenizer_dir=default_model_dir)
    cfg = read_config(model_dir)
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm and cfg.torch_dtype == "bfloat16"
    shape = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert shape == (48, 2048, 32, 4, 128)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (128, 8, 768)
    assert cfg.moe.renormalize and cfg.moe.layers == tuple(range(48))
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.layer_windows == ()
    assert cfg.vocab_size == len(AutoTokenizer.from_pretrained(model_dir, local_files_only=True)) == 49152
    assert not list(model_dir.glob("*.safetensors"))  # served with --load_format dummy
    for tp in (2, 4, 8):
        assert split_even(768, TPGroup(tp - 1, tp), "moe")[1] == 768 // tp
