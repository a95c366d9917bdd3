"""--kv_cache_dtype fp8_e4m3: the model with an fp8 KV cache against transformers running the same
arithmetic (K after rotary and V rounded to the nearest e4m3 value, saturating at 448), the default
model's logits against its bf16-cache ones, and the budget: twice the tokens in the same bytes."""

import pytest
import torch
import transformers.models.llama.modeling_llama as hf_llama
import transformers.models.qwen2.modeling_qwen2 as hf_qwen2

from lightllm.common.token_table import TokenTable
from lightllm.engine.model_runner import run_step
from lightllm.models import ModelConfigError, resolve_kv_dtype
from lightllm.server.config import ServerConfig, build_parser
from lightllm.server.io_struct import SamplingParams
from test_model_vs_hf import (ATOL, assert_logits_match_hf, make_model, make_runner, max_hf_difference,
                              random_prompts, run_schedule)

FP8 = torch.float8_e4m3fn


def fp8_rounded(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(FP8).to(x.dtype)


def fp8_kv_emulated_(hf_model, monkeypatch):
    """transformers' attention reading K and V as an fp8 cache holds them."""
    for module in (hf_llama, hf_qwen2):
        rotary = module.apply_rotary_pos_emb

        def rounded_k(q, k, cos, sin, *args, rotary=rotary, **kwargs):
            q, k = rotary(q, k, cos, sin, *args, **kwargs)
            return q, fp8_rounded(k)

        monkeypatch.setattr(module, "apply_rotary_pos_emb", rounded_k)
    for layer in hf_model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda _module, _args, v: fp8_rounded(v))
    return hf_model


@pytest.mark.parametrize("name", ["llama_gqa_llama3_rope", "qwen2_bias_tied"])
def test_fp8_kv_cache_matches_transformers_with_the_same_rounding(name, tmp_path, captured_logits, monkeypatch):
    hf_model = fp8_kv_emulated_(make_model(name, tmp_path), monkeypatch)
    runner = make_runner(tmp_path, kv_cache_dtype="fp8_e4m3")
    assert runner.token_table.k[0].dtype == FP8
    steps = run_schedule(runner, random_prompts(1))
    assert_logits_match_hf(hf_model, captured_logits, steps)


def test_fp8_kv_rounding_changes_the_logits(tmp_path, captured_logits):
    """The comparison above would pass vacuously if the cache kept K and V exactly."""
    hf_model = make_model("llama_gqa_llama3_rope", tmp_path)
    steps = run_schedule(make_runner(tmp_path, kv_cache_dtype="fp8_e4m3"), random_prompts(1))
    assert max_hf_difference(hf_model, captured_logits, steps) > 100 * ATOL


def test_default_model_fp8_kv_logits_stay_close(default_model_dir, captured_logits):
    """SmolLM2-135M, fp32 on the CPU: the next-token distributions of four prompts, then of one
    decode step, with an fp8 KV cache against an fp32 one. Measured: KL 0.0048 nats, the same top-1
    token in all eight (fp8 projections, for comparison: 0.052 nats, test_fp8.py)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three laws of thermodynamics are"]
    reqs = [(i, tok(p).input_ids, SamplingParams()) for i, p in enumerate(prompts)]
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        runner = make_runner(default_model_dir, tokens=512, kv_cache_dtype=kv_cache_dtype)
        run_step(runner, prompts=reqs)
        run_step(runner, [0, 1, 2, 3])
    exact = torch.cat(captured_logits[:2])
    fp8 = torch.cat(captured_logits[2:])
    kl = torch.nn.functional.kl_div(fp8.log_softmax(-1), exact.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert 1e-6 < kl < 0.03, kl
    assert torch.equal(exact.argmax(-1), fp8.argmax(-1))


def test_an_fp8_cache_holds_twice_the_tokens_in_the_same_bytes():
    shape = dict(size=64, num_layers=2, kv_heads=2, head_dim=16, device="cpu")
    assert TokenTable(dtype=torch.bfloat16, **shape).nbytes() == 2 * TokenTable(dtype=FP8, **shape).nbytes()


def test_kv_cache_dtype_flag():
    assert build_parser().parse_args(["--kv_cache_dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    assert ServerConfig.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv_cache_dtype", "int8"])
    assert resolve_kv_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert resolve_kv_dtype("fp8_e4m3", torch.bfloat16, torch.device("cpu")) == FP8
    with pytest.raises(ModelConfigError, match="auto or fp8_e4m3"):
        resolve_kv_dtype("fp8", torch.bfloat16, torch.device("cpu"))
