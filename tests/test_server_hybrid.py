"""A server on bench_model's tiny-qwen3.5 (a hybrid model: 3 Gated DeltaNet layers and 1 gated
full-attention layer, random fp32 weights, the default model's tokenizer): greedy text equals
transformers' `generate`, also the second time, resumed from the prefix cache's snapshot of the
recurrent state at the deepest 16-token boundary of the prompt (the tokens reported cached), and
for each of n = 2 choices; an image part in a chat message is a 400
(only the text model is served).
Relies on transformers' Qwen3.5 modeling code and its greedy `generate` as the oracle."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server_utils import preset_server

PROMPT = "the river runs over the stone light and the cache of every batch runs quickly " * 3
NEW = 16


def test_greedy_text_equals_transformers_with_the_prefix_cache(tmp_path_factory):
    flags = ("--chunked_prefill_size", "16", "--state_snapshot_interval", "16")
    with preset_server(tmp_path_factory, "tiny-qwen3.5", flags) as (model_dir, server):
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        model.generation_config.eos_token_id = None
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        assert ids.shape[1] > 16  # two chunks or more
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        for cached in (0, (ids.shape[1] - 1) // 16 * 16):
            got = server.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
            assert got["generated_text"] == [expected] and got["cached_tokens"] == cached
        body = {"model": model_dir.name, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "n": 2,
                "ignore_eos": True}
        response = server.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert [c["text"] for c in choices] == [expected, expected]
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        body = {"model": model_dir.name, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
        response = server.post("/v1/chat/completions", body)
        assert response.status_code == 400 and "content" in response.json()["error"]["message"]
