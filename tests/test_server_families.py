"""One server per new family (bench_model's tiny-qwen3, tiny-gemma2, tiny-gemma3, tiny-gpt-oss, tiny-gemma4: random
fp32 weights, the default model's tokenizer, a sliding window of 16 for Gemma and gpt-oss): greedy text of prompts
longer than the window, generated past it, equals transformers' `generate`, the second time too
(with the prompt then in the prefix cache).
Relies on transformers' Qwen3, Gemma2, Gemma3, GptOss and Gemma4 modeling code and its greedy `generate` as the oracle."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server_utils import preset_server

PROMPTS = ["the river runs over the stone light and the cache of every batch runs quickly " * 3,
           "a model token café 🤖 你好 under the light"]
NEW = 24


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-gpt-oss",
                                                  "tiny-gemma4"])
def family(request, tmp_path_factory):
    with preset_server(tmp_path_factory, request.param) as (model_dir, server):
        yield model_dir, server


def test_greedy_text_equals_transformers_with_and_without_a_cache_hit(family):
    model_dir, server = family
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.generation_config.eos_token_id = None
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        first, again = (server.generate(prompt, max_new_tokens=NEW, ignore_eos=True) for _ in range(2))
        assert first["generated_text"] == again["generated_text"] == [expected]
        assert again["cached_tokens"] > 0
    assert len(tokenizer(PROMPTS[0]).input_ids) > 16
