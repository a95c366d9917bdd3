"""Our Llama-family model, driven through ModelRunner, against transformers on the same weights.

Tiny random models (hidden 64, 2 layers) built with transformers' own config classes and
saved with save_pretrained. For each prefill and decode step we compare the last-token
logits the runner samples from with transformers' logits for the full sequence so far.
fp32 on CPU; tolerance atol = rtol = 1e-4 (observed differences are ~1e-6).
"""

import json
import os
import shutil

import pytest
import torch
from helpers.models import (BASE, CASES, assert_logits_match_hf, make_model, make_runner, random_prompts,
                            run_schedule)

import lightllm.kernels
from lightllm.models import ModelConfigError, WeightLoadError, layers, moe
from lightllm.engine.request import SamplingParams
from benchmark.lib.direct_step import run_step


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, tmp_path, captured_logits):
    hf_model = make_model(name, tmp_path)
    runner = make_runner(tmp_path)
    steps = run_schedule(runner, random_prompts(1))
    assert len(captured_logits) == len(steps)
    assert_logits_match_hf(hf_model, captured_logits, steps)
    assert runner.stats() == {"tokens_used": 0, "max_total_token_num": 256, "running_requests": 0, "cache_nodes": 0,
                              "host_tokens_used": 0}
    assert runner.token_table.free_count == int(runner.token_table.mem_state.sum()) == 256


def test_info_reads_config_and_generation_config(tmp_path):
    make_model("qwen2_bias_tied", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 9}))
    info = make_runner(tmp_path).info
    assert info["architecture"] == "Qwen2ForCausalLM" and info["dtype"] == "float32"
    assert info["eos_token_ids"] == [9, 7] and info["vocab_size"] == 101
    assert info["max_position_embeddings"] == cfg["max_position_embeddings"]


def logits_of(model_dir, captured, **kw):
    captured.clear()
    run_schedule(make_runner(model_dir, **kw), random_prompts(2))
    return list(captured)


def write_bin_shards(hf_model, out_dir):
    """pytorch_model-0000{1,2}.bin + index, split by tensor."""
    state = {k: v.clone() for k, v in hf_model.state_dict().items()}
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, out_dir / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (out_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_checkpoint_layouts_load_identically(tmp_path, captured_logits):
    single, sharded, bin_one, bin_sharded = (tmp_path / n for n in ("single", "sharded", "bin", "bin_sharded"))
    hf_model = make_model("qwen2_bias_tied", single)
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    for d in (bin_one, bin_sharded):
        d.mkdir()
        shutil.copy(single / "config.json", d)
    torch.save(hf_model.state_dict(), bin_one / "pytorch_model.bin")
    write_bin_shards(hf_model, bin_sharded)
    expected = logits_of(single, captured_logits)
    for other in (sharded, bin_one, bin_sharded):
        for a, b in zip(expected, logits_of(other, captured_logits)):
            assert torch.equal(a, b), other.name


def test_dummy_weights_need_only_the_config(tmp_path, captured_logits):
    make_model("llama_gqa_llama3_rope", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    logits = logits_of(tmp_path, captured_logits, load_format="dummy")
    assert all(torch.isfinite(x).all() and x.std() > 0 for x in logits)


@pytest.mark.parametrize("name,quantization,split", [
    ("llama_gqa_llama3_rope", None, [2, 2]), ("llama_gqa_llama3_rope", "fp8", [0, 0]),
    ("gemma2_window_16", None, [0, 0, 0]), ("qwen3_moe", None, [None, 2])])
def test_which_down_projections_leave_their_sum_to_the_next_norm(name, quantization, split, tmp_path):
    """tp 1: a dense MLP's bf16 down projection hands its partial sums over K to the norm after it
    (RowParallelLinear.defer_split_sum; taken on a GPU by steps of up to SPLIT_SUM_ROWS rows): not
    with fp8 weights, not under Gemma's sandwich norms (their output norm needs the sum alone), and
    an expert layer has no such projection (None). K = 128 splits into two 64-column slices."""
    config_cls, model_cls, extra = CASES[name]
    model_cls(config_cls(**{**BASE, **extra, "intermediate_size": 128})).save_pretrained(tmp_path)
    runner = make_runner(tmp_path, quantization=quantization, load_format="dummy")
    got = [layer.mlp.down.split_sum if isinstance(layer.mlp, layers.GatedMLP) else None
           for layer in runner.model.layers]
    assert got == split


def test_unsupported_architecture_is_named(tmp_path):
    make_model("llama_mha", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelConfigError, match=r"unsupported architecture 'GPT2LMHeadModel'.*"
                                               r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                               r"Gemma2ForCausalLM, Gemma3ForCausalLM"):
        make_runner(tmp_path)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(ModelConfigError, match="config.json not found"):
        make_runner(tmp_path)


def test_missing_weights_are_named(tmp_path):
    make_model("llama_mha", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no weights found"):
        make_runner(tmp_path)


def test_missing_shard_is_named(tmp_path):
    make_model("llama_mha", tmp_path).save_pretrained(tmp_path, max_shard_size="40KB")
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(WeightLoadError, match=f"{shard.name} is missing"):
        make_runner(tmp_path)


def test_corrupt_weight_file_is_named(tmp_path):
    make_model("llama_mha", tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(WeightLoadError, match="cannot read weight file .*model.safetensors"):
        make_runner(tmp_path)


def test_shape_mismatch_is_named(tmp_path):
    make_model("llama_mha", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(WeightLoadError, match="gate_proj.weight' has shape"):
        make_runner(tmp_path)


TRITON_OPS = {"rms_norm": "rms_norm_triton", "add_rms_norm": "add_rms_norm_triton",
              "rotary_kv_": "rotary_kv_triton",
              "extend_attention": "extend_attention_triton", "decode_attention": "decode_attention_triton",
              "silu_and_mul": "silu_and_mul_triton", "gelu_tanh_and_mul": "gelu_tanh_and_mul_triton"}


@pytest.mark.parametrize("name", ["llama_gqa_llama3_rope", "qwen2_bias_tied", "qwen3_head_dim_24", "gemma2_window_16",
                                  "gemma3_window_16", "qwen3_moe", "gpt_oss"])
def test_triton_kernels_match_transformers(name, tmp_path, captured_logits, monkeypatch):
    """The GPU path (Triton kernels, under the interpreter: this runner is on the CPU) as the layers
    call it: strided q/k views, int32/int64 index tensors, packed prompts, token-table decode. On a
    GPU machine, tests/gpu/test_gpu_model.py runs such models on the device (pytest -m gpu)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the runner here is on the CPU, where Triton needs TRITON_INTERPRET=1 (tests/conftest.py sets "
                    "it on machines without a GPU)")
    for op, triton_fn in TRITON_OPS.items():
        monkeypatch.setattr(layers, op, getattr(lightllm.kernels, triton_fn))
    monkeypatch.setattr(moe, "fused_moe", lightllm.kernels.fused_moe_triton)
    hf_model = make_model(name, tmp_path)
    steps = run_schedule(make_runner(tmp_path), random_prompts(4))
    assert_logits_match_hf(hf_model, captured_logits, steps)


def test_runner_refuses_bad_steps_and_keeps_its_state(tmp_path):
    make_model("llama_mha", tmp_path)
    runner = make_runner(tmp_path, tokens=32)
    greedy = SamplingParams()
    run_step(runner, prompts=[(0, [1, 2, 3], greedy)])
    before = runner.stats()
    bad_prefills = {
        "already running": [(0, [4], greedy)],
        "repeat": [(1, [4], greedy), (1, [5], greedy)],
        "prompt of 0 tokens": [(1, [], greedy)],
        "prompt of 65 tokens": [(1, [1] * 65, greedy)],
        "out of range": [(1, [101], greedy)],
        "needs 30 KV cache tokens, 29 free": [(1, [1] * 30, greedy)],
    }
    for message, reqs in bad_prefills.items():
        with pytest.raises((ValueError, RuntimeError), match=message):
            run_step(runner, prompts=reqs)
        assert runner.stats() == before and runner.token_table.free_count == 29
    with pytest.raises(ValueError, match="unknown"):
        run_step(runner, [0, 7])
    runner.free([7])  # never added (as after a failed step): nothing to free
    with pytest.raises(KeyError, match="repeated"):
        runner.free([0, 0])
    assert runner.stats() == before
    run_step(runner, [0])
    runner.free([0])
    assert runner.stats()["tokens_used"] == 0 and runner.req_table.free_count == 8
