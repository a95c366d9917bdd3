"""Tiny random models of every family, saved with transformers' own classes, and what the tests
do with them: a ModelRunner or an engine core on one, a schedule of prefill and decode steps, and
the comparisons with transformers on the same weights (fp32 on the CPU: atol = rtol = 1e-4,
observed differences ~1e-6)."""

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM,
                          Gemma4TextConfig, GptOssConfig,
                          GptOssForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from lightllm.engine.config import EngineConfig
from lightllm.engine.core import EngineCore
from lightllm.engine.model_runner import ModelRunner
from benchmark.lib.direct_step import run_step
from lightllm.engine.request import FinishReason, GenerateReq, SamplingParams
from lightllm.engine.scheduler import Scheduler

ATOL = RTOL = 1e-4


BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=101)


# YaRN as gpt-oss's (factor 32 over 4096 there), over a context the schedules' sequences pass
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
             "original_max_position_embeddings": 16, "rope_theta": 150000.0}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}


CASES = {
    "llama_mha": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4)),
    "llama_gqa_llama3_rope": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2,
                                                                  rope_parameters=LLAMA3_ROPE)),
    "llama_mqa_tied_theta": (LlamaConfig, LlamaForCausalLM,
                             dict(num_key_value_heads=1, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1234.5})),
    "llama_head_dim_32": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, head_dim=32)),
    "mistral_gqa": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2)),
    "mistral_window_8": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=8)),
    "qwen2_bias_tied": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # q/k norms; head_dim apart from hidden / heads (64 / 4 = 16)
    "qwen3_head_dim_24": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=24)),
    "qwen3_tied_bias": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                                                            attention_bias=True)),
    # Sliding layers (window 16: the schedule's sequences grow past it) beside global ones; Gemma 2's
    # soft caps (attention 50, logits 30) and alternating layers; Gemma 3's q/k norms, its own rotary
    # base on the sliding layers and linear scaling on the global ones; query_pre_attn_scalar apart
    # from head_dim; tied and untied heads.
    "gemma2_window_16": (Gemma2Config, Gemma2ForCausalLM, dict(num_hidden_layers=3, num_key_value_heads=2,
                                                               head_dim=16, sliding_window=16,
                                                               query_pre_attn_scalar=24)),
    "gemma3_window_16": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        num_hidden_layers=3, num_key_value_heads=1, head_dim=32, sliding_window=16, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}})),
    # experts in every layer, the top 2 of 4 renormalised
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_key_value_heads=2, num_local_experts=4,
                                                        num_experts_per_tok=2)),
    # q/k norms, head_dim apart from hidden / heads; experts in layer 0 (top 3 of 8, renormalised), a
    # dense MLP in layer 1 (mlp_only_layers)
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_key_value_heads=2, head_dim=32, num_experts=8,
                                                            num_experts_per_tok=3, moe_intermediate_size=32,
                                                            norm_topk_prob=True, mlp_only_layers=[1])),
    # Qwen3-MoE's window slides in every layer: transformers ignores max_window_layers there (its
    # real config.json has max_window_layers = num_hidden_layers)
    "qwen3_moe_window_8": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    # attention sinks, sliding (8) and full layers alternating, YaRN, q/k/v/o biases; experts with
    # biases and the clamped SwiGLU in every layer, the top 2 of 4 (intermediate 32: one MXFP4 group)
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, dict(num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                                      num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                                      rope_parameters=YARN_ROPE)),
    # Gemma 4: sliding (window 8, head 16, 2 KV heads) and global layers (head 32, 1 KV head, v = k,
    # a quarter of each head turning), the last two reading the K/V of layers 0 and 1 with MLPs
    # twice as wide; per-layer inputs of 8; logits capped at 30; each layer's scalar drawn too
    "gemma4": (Gemma4TextConfig, Gemma4ForCausalLM, dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=101, final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 5000.0}})),
    # ... and with its own v projection, no KV sharing, no per-layer inputs, untied
    "gemma4_plain": (Gemma4TextConfig, Gemma4ForCausalLM, dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "full_attention"], hidden_size_per_layer_input=0,
        tie_word_embeddings=False)),
    # the MoE variant: 4 GELU experts (top 2, renormalised, each scaled) beside every layer's dense MLP
    "gemma4_moe": (Gemma4TextConfig, Gemma4ForCausalLM, dict(
        num_hidden_layers=2, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32)),
    # top-k weights as their share of all experts (norm_topk_prob false); experts in every second layer
    "qwen3_moe_sparse_step": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                              dict(num_key_value_heads=4, num_experts=6, num_experts_per_tok=2,
                                   moe_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=2)),
}

# The GPU tests' models (tests/gpu): CASES at these sizes, weights 0.08 times a standard normal.
GPU_SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8, head_dim=64,
                 vocab_size=1000)
GPU_WEIGHT_SCALE = 0.08


def randomize_(model, seed, scale=0.15, generator=None):
    """Larger-than-default weights (and nonzero biases, non-unit norms) so differences show."""
    gen = generator or torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else scale * noise)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4 scales each layer's output by it (1 as initialised)
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def make_model(name, out_dir, seed=0, scale=0.15, generator=None, **sizes):
    """Save the tiny model `name` of CASES (BASE's sizes, or `sizes`) to out_dir, its weights
    `scale` times a standard normal (from `generator`, else one seeded with `seed`); returns the
    transformers model."""
    config_cls, model_cls, extra = CASES[name]
    config = config_cls(**{**BASE, **extra, **sizes}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed, scale, generator)
    model.save_pretrained(out_dir)
    return model


def make_gpu_model(name, out_dir, **changes):
    """CASES' `name` at GPU_SIZES (and `changes`) for tests/gpu, saved to out_dir. Its weights
    are drawn from torch's global generator after the model's own initialisation (seed 0): the
    draws on which the GPU tests' bf16 and fp8 bounds hold (H200, 2026-12-02; other draws of the
    Qwen3-MoE model have left the bf16 bound)."""
    return make_model(name, out_dir, scale=GPU_WEIGHT_SCALE, generator=torch.default_generator,
                      **{**GPU_SIZES, **changes})


def make_runner(model_dir, tokens: int = 256, device: str = "cpu", cuda_graph: bool = True, tp_rank: int = 0,
                **settings):
    """A runner on `model_dir` with a KV budget of `tokens`, taken as given (no profile step)."""
    settings = {"max_req_total_len": 64, "running_max_req_size": 8, **settings}
    config = EngineConfig(model_dir=str(model_dir), max_total_token_num=tokens, disable_cuda_graph=not cuda_graph,
                          **settings)
    return ModelRunner(config, tp_rank, device=device, check_budget=False)


def hf_last_logits(hf_model, seqs):
    with torch.no_grad():
        return torch.stack([hf_model(torch.tensor([s])).logits[0, -1] for s in seqs])


def hf_pairs(hf_model, captured_logits, steps):
    """(our logits, transformers' logits) for every step of run_schedule."""
    return [(logits, hf_last_logits(hf_model, seqs)) for logits, seqs in zip(captured_logits, steps)]


def assert_logits_match_hf(hf_model, captured_logits, steps):
    for ours, theirs in hf_pairs(hf_model, captured_logits, steps):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)


def max_hf_difference(hf_model, captured_logits, steps) -> float:
    return max((ours - theirs).abs().max().item() for ours, theirs in hf_pairs(hf_model, captured_logits, steps))


def assert_rank(rank: int, row: torch.Tensor, token: int, tol: float) -> None:
    """`rank` is vLLM's rank of `token` in the oracle's logprobs `row` (how many tokens are at least
    as likely), where tokens within `tol` of it may fall on either side."""
    lo = int((row > row[token] + tol).sum()) + 1
    hi = int((row >= row[token] - tol).sum())
    assert lo <= rank <= hi, (token, rank, lo, hi)


def run_schedule(runner, prompts):
    """Prefill two requests, decode, add a third, decode all, free one, decode the rest, then the last alone.
    Returns [(sequences fed so far, for each row of that step's logits)]."""
    seqs = {i: list(p) for i, p in enumerate(prompts)}
    steps = []

    def record(ids, out):
        steps.append([list(seqs[i]) for i in ids])
        for i, (tok, _) in zip(ids, out):
            seqs[i].append(tok)

    greedy = SamplingParams()
    record([0, 1], run_step(runner, prompts=[(0, prompts[0], greedy), (1, prompts[1], greedy)]))
    record([0, 1], run_step(runner, [0, 1]))
    record([2], run_step(runner, prompts=[(2, prompts[2], greedy)]))
    for _ in range(3):
        record([1, 0, 2], run_step(runner, [1, 0, 2]))
    runner.free([0])
    record([2, 1], run_step(runner, [2, 1]))
    runner.free([1])
    for _ in range(2):  # one request alone: batch-1 decode steps
        record([2], run_step(runner, [2]))
    runner.free([2])
    return steps


def random_prompts(seed, lengths=(3, 17, 9), vocab=BASE["vocab_size"]):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def engine(runner: ModelRunner, chunk: int, overlap: bool = True, prefix_cache: bool = True) -> EngineCore:
    scheduler = Scheduler(runner.max_total_token_num, chunk, runner.req_table.max_reqs, prefix_cache=prefix_cache)
    return EngineCore(scheduler, runner, eos_token_ids=[], overlap=overlap)


def hf_greedy(hf_model, prompts, new_tokens) -> dict[int, list[int]]:
    """transformers' greedy tokens of each prompt, EOS ignored, on the model's device."""
    hf_model.generation_config.eos_token_id = None
    out = {}
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], device=hf_model.device)
            full = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     do_sample=False)
            out[i] = full[0, len(p):].tolist()
    return out


def assert_idle(core: EngineCore) -> None:
    """No request holds a slot or a row; the slots in use are the prefix cache's, and a flush
    frees every one (so the next engine on this runner starts empty)."""
    runner = core._workers
    assert not runner.reqs and runner.req_table.free_count == runner.req_table.max_reqs
    assert runner.token_table.used_count == core.scheduler.cached_tokens
    cached = core.scheduler.cached_tokens
    assert core.scheduler.flush_cache() == cached
    core.drain()
    assert runner.token_table.used_count == 0 and not runner.nodes


class Client:
    """Requests through one engine, with ids that never repeat."""

    def __init__(self, core):
        self.core, self.next_id = core, 0

    def run(self, prompts, params: SamplingParams, staggered: bool = False) -> list[list[int]]:
        """All prompts at once (or, `staggered`, each after the one before has prefilled)."""
        ids, got = [], {}
        for prompt in prompts:
            ids.append(self.next_id)
            self.core.add(GenerateReq(self.next_id, prompt, params))
            self.next_id += 1
            if staggered:
                for out in self.core.step() + self.core.step():
                    got.setdefault(out.req_id, []).append(out)
        for out in self.core.drain():
            got.setdefault(out.req_id, []).append(out)
        assert all(got[i][-1].finish_reason is FinishReason.LENGTH for i in ids)
        return [[o.token_id for o in got[i]] for i in ids]


RUNNER_SETTINGS = dict(max_total_token_num=2048, max_req_total_len=256, running_max_req_size=16, chunked_prefill_size=256)


def runner_config(model_dir, **settings) -> EngineConfig:
    """The engine config of the worker tests: a 2048-token budget, checked by a small profile step."""
    return EngineConfig(model_dir=str(model_dir), **{**RUNNER_SETTINGS, **settings})
