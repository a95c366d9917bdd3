"""Gemma 4 beyond the shared equality tests (test_model_vs_hf.py, test_model_families.py, test_tp.py):
the token table holds one copy of the K/V that the last layers share, sized by each layer type's
own heads, and a multimodal checkpoint serves its text model (the towers' weights unread) with
transformers' logits."""

import json

import pytest
import torch
from helpers.models import (BASE, CASES, assert_logits_match_hf, make_model, make_runner, random_prompts,
                            randomize_, run_schedule)
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

from lightllm.engine.memory import token_budget
from lightllm.models import read_config


def test_shared_layers_own_no_kv_buffer(tmp_path, monkeypatch):
    """Layers 2 and 3 read the K/V of layers 0 (sliding: 2 heads of 16) and 1 (global: 1 head of
    32): two buffers, and the budget's bytes per token count each once."""
    make_model("gemma4", tmp_path)
    cfg = read_config(tmp_path)
    assert cfg.gemma4.kv_source == (0, 1, 0, 1) and cfg.layer_windows == (8, 0, 8, 0)
    assert (cfg.gemma4.global_head_dim, cfg.gemma4.global_kv_heads, cfg.gemma4.k_eq_v) == (32, 1, True)
    runner = make_runner(tmp_path)
    table = runner.token_table
    assert [tuple(k.shape[1:]) for k in table.k] == [tuple(v.shape[1:]) for v in table.v] == [(2, 16), (1, 32)]
    assert runner.model.kv_buffer == [0, 1, 0, 1]
    assert table.nbytes() == 2 * (256 + 1) * (2 * 16 + 1 * 32) * 4
    monkeypatch.setattr("lightllm.engine.memory.profile", lambda *a: _Budget())
    assert token_budget(runner, None, 64, 0.9, 0) == 1000  # _Budget: 1000 tokens of 2 (32 + 32) 4 bytes


class _Budget:
    def tokens(self, token_bytes, fixed_bytes):
        assert (token_bytes, fixed_bytes) == (2 * (2 * 16 + 1 * 32) * 4, 0)
        return 1000

    def describe(self, device):
        return "test"


def make_multimodal(out_dir, seed=0):
    """Gemma 4's tiny text model (CASES' "gemma4") inside a Gemma4ForConditionalGeneration with a
    vision tower, saved as the published checkpoints are (model.language_model.*, model.vision_tower.*)."""
    _, _, text = CASES["gemma4"]
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    config = Gemma4Config(text_config={**BASE, **text}, vision_config=vision, audio_config=None,
                          attn_implementation="eager")
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    randomize_(model, seed)
    model.save_pretrained(out_dir)
    return model


def test_multimodal_checkpoint_serves_its_text_model(tmp_path, captured_logits):
    hf_model = make_multimodal(tmp_path)
    cfg = read_config(tmp_path)
    assert cfg.architecture == "Gemma4ForConditionalGeneration" and cfg.gemma4.prefix == "model.language_model."
    assert cfg.num_layers == 4 and cfg.vocab_size == BASE["vocab_size"] and cfg.tie_word_embeddings
    steps = run_schedule(make_runner(tmp_path), random_prompts(5))
    assert_logits_match_hf(hf_model, captured_logits, steps)


@pytest.mark.parametrize("preset,kv_bytes", [("gemma4-31b", 2 * (50 * 16 * 256 + 10 * 4 * 512) * 2),
                                             ("gemma4-26b-a4b", 2 * (25 * 8 * 256 + 5 * 2 * 512) * 2)])
def test_bench_preset_loads_with_the_checkpoint_names_and_shapes(preset, kv_bytes, default_model_dir, tmp_path):
    """A Gemma 4 preset's config (written as the published checkpoints write theirs) reads, the
    model built from it on the meta device asks for exactly
    the tensors of transformers' model (tp 1 and 2), and its K/V take the bytes the preset states."""
    from test_model_families import MetaWeights
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightllm.models import Gemma4Model
    from lightllm.tools.bench_model import write_bench_model
    from lightllm.utils.dist import TPGroup

    model_dir = write_bench_model(tmp_path / preset, preset, tokenizer_dir=default_model_dir)
    written = json.loads((model_dir / "config.json").read_text())  # the global layers as published
    assert "per_layer_config" not in written and written["global_head_dim"] == 512
    cfg = read_config(model_dir)
    assert cfg.layer_windows == ((1024,) * 5 + (0,)) * (cfg.num_layers // 6) and cfg.logit_softcap == 30.0
    assert (cfg.moe is not None) == (preset == "gemma4-26b-a4b")
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    expected = {name: tuple(t.shape) for name, t in hf_model.state_dict().items() if name != "lm_head.weight"}
    for rank in (0, 1):
        weights = MetaWeights()
        Gemma4Model(cfg, weights, TPGroup(rank, 2), 256, torch.device("meta"))
        assert weights.shapes() == expected
    full = Gemma4Model(cfg, MetaWeights(), TPGroup(0, 1), 256, torch.device("meta"))
    assert 2 * sum(h * d for h, d in full.kv_shapes) * 2 == kv_bytes  # 880 KiB (31b), 220 KiB (26b-a4b)
