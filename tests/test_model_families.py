"""Qwen3, Gemma 2, 3 and 4 and gpt-oss (tiny, random, fp32) through the engine core and a real model
runner: prompts longer than the sliding window (16; gpt-oss's 8), generations well past it, chunked prefill
with chunks under, at and over the window, and the prefix cache on and off (later prompts find
a 40-token system prompt cached) all give transformers' greedy tokens.
Relies on transformers' modeling code of each (eager attention with its
sliding-window mask) and its greedy `generate` as the oracle."""

import pytest
import torch
from helpers.models import Client, assert_idle, engine, hf_greedy, make_model, make_runner

from lightllm.engine.request import SamplingParams

NEW = 24  # a 5-token prompt ends 29 positions in: decodes past the window


def tokens(seed: int, n: int, vocab: int = 101) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompts() -> list[list[int]]:
    system = tokens(1, 40)
    return [system + tokens(10 + i, 3 + 4 * i) for i in range(3)] + [tokens(2, 45), tokens(3, 5)]


@pytest.mark.parametrize("name,chunks", [("qwen3_head_dim_24", (7, 16, 64)), ("gemma2_window_16", (7, 16, 64)),
                                         ("gemma3_window_16", (7, 16, 64)), ("gemma4", (7, 16, 64)),
                                         ("gpt_oss", (5, 8, 64))])
def test_chunked_prefill_and_prefix_cache_equal_transformers(name, chunks, tmp_path):
    """Chunks under, at and over the model's sliding window (gpt-oss's is 8, the others' 16)."""
    hf_model = make_model(name, tmp_path)
    runner = make_runner(tmp_path, tokens=1024, max_req_total_len=96)
    workload = prompts()
    expected = list(hf_greedy(hf_model, workload, NEW).values())
    greedy = SamplingParams(max_new_tokens=NEW)
    for chunk, prefix_cache in zip(chunks, (True, False, True)):
        core = engine(runner, chunk=chunk, prefix_cache=prefix_cache)
        client = Client(core)
        # staggered: later prompts find the system prompt cached; then all at once, all cached
        got = client.run(workload, greedy, staggered=True) + client.run(workload, greedy)
        assert (core.scheduler.prefix_hit_tokens > 0) == prefix_cache
        assert got == expected + expected, (chunk, prefix_cache)
        assert_idle(core)


class MetaWeights:
    """A weight source that makes no data: records what the layers ask for, as (full shape, dtype)."""

    def __init__(self):
        self.asked: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def get(self, name, shape, dim=0, start=0, length=None, dtype=None):
        self.asked[name] = (tuple(shape), dtype or torch.bfloat16)
        part = list(shape)
        part[dim] = shape[dim] - start if length is None else length
        return torch.empty(part, dtype=dtype or torch.bfloat16, device="meta")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self.asked.items()}


@pytest.mark.parametrize("preset,shape", [("qwen3-8b", (36, 4096, 32, 8, 12288, 128)),
                                          ("gemma3-12b", (48, 3840, 16, 8, 15360, 256))])
def test_bench_presets_load_with_the_checkpoint_names_and_shapes(preset, shape, default_model_dir, tmp_path):
    """Each preset's config reads, and the model built from it (on the meta device: no 8B of weights)
    asks for exactly the tensors, of exactly the shapes, that transformers' model of that config
    holds; at tp 2 as well."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightllm.models import LlamaModel, read_config
    from lightllm.tools.bench_model import write_bench_model
    from lightllm.utils.dist import TPGroup

    model_dir = write_bench_model(tmp_path / preset, preset, tokenizer_dir=default_model_dir)
    assert not list(model_dir.glob("*.safetensors"))  # served with --load_format dummy
    cfg = read_config(model_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
            cfg.head_dim) == shape
    assert cfg.torch_dtype == "bfloat16" and cfg.vocab_size == 49152 and cfg.qk_norm
    if preset == "gemma3-12b":  # 5 sliding layers of every 6, each rope as Gemma 3's own
        assert cfg.layer_windows == ((1024,) * 5 + (0,)) * 8 and cfg.tie_word_embeddings
        assert cfg.local_rope_theta == 10000.0 and cfg.rope_theta == 1e6
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    expected = {name: tuple(t.shape) for name, t in hf_model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for rank in (0, 1):
        weights = MetaWeights()
        LlamaModel(cfg, weights, TPGroup(rank, 2), 256, torch.device("meta"))
        assert weights.shapes() == expected
