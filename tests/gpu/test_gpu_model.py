"""The engine on CUDA (Triton kernels, CUDA graphs) against transformers on the same GPU and weights.

    python -m pytest -m gpu tests/gpu/test_gpu_model.py [-k CASE]

The tiny random models of tests/helpers/models.py at its GPU_SIZES (Llama: GQA with llama3
rope; Qwen2: q/k/v bias, tied embeddings; Qwen3: q/k norms; Gemma 2 and 3: sliding windows past
which the prompts run, soft caps; Mixtral and Qwen3-MoE: the fused MoE kernel; Gemma 4: shared K/V,
per-layer inputs, GELU experts; gpt-oss: sinks, YaRN, expert biases) prefill a mixed
batch through ModelRunner and decode greedily (CUDA graphs), and run through the engine core
(chunked prefill beside running decodes, with one step in flight and without). Bounds:
- fp32 agrees with transformers' greedy `generate` token for token.
- bf16 rounding may flip near-ties: the mean share of each sequence before its first difference
  from transformers' bf16 tokens is at least BF16_AGREEMENT, or our bf16 tokens are no further
  from transformers' fp32 tokens than its own bf16 tokens are (a router's top-k or a soft cap
  flips bf16 early in either); the prefill logits are within BF16_LOGIT_TOL (max |difference| /
  max |logit|) of our CPU fp32 logits, or within transformers' own bf16 distance where that is
  larger, with the same top token but where the fp32 top two are a near-tie (gap at most twice
  the row's error). On the CPU, transformers' bf16 last-position logits were 0.47 from its fp32
  ones for Mixtral, 0.095 for Gemma 2, 0.07 for Llama (hidden 256).
- Graph-replayed engine steps give exactly the eager steps' fp32 greedy tokens, with one step in
  flight and without, with the prefix cache (a late request sharing a prompt's first 96 tokens)
  and without.
- fp8 weights (fp32 activations) cost the GPU no more than the CPU, whose torch reference path
  tests/test_fp8.py holds to transformers: one prefill step's fp8 logits are no further from the
  unquantised ones than 1.5x the CPU's distance (+0.01), with the CPU's fp8 top tokens (all
  prompts: cuBLAS's scaled GEMM; the first alone: the small-M Triton GEMM). fp32 summation order
  can move a value across an fp8 rounding boundary (up to 6%), so fp32 closeness cannot hold.
- The fp8 KV cache: greedy tokens at least 0.9 the CPU's (tests/test_fp8_kv_cache.py holds the
  CPU to transformers with the same rounding); a K value may cross an e4m3 boundary likewise.
- A runner's graphs capture while an earlier runner, dropped in a reference cycle with its graphs,
  waits for the garbage collector (a second `LLM` in one process).
- gpt-oss with MXFP4 experts (a checkpoint as published): widened at load, its bf16 prefill logits
  are no further from the CPU's fp32 than 1.5x the packed kernels' distance (or BF16_LOGIT_TOL),
  and its greedy tokens agree with the packed ones' (BF16_AGREEMENT); re-encoded in fp8, as the
  fp8 bound above.
"""

import gc

import pytest
import torch
from helpers.models import (GPU_SIZES, LLAMA3_ROPE, YARN_ROPE, assert_idle, engine, hf_greedy, make_gpu_model,
                            make_runner, random_prompts)

from benchmark.lib.direct_step import run_step
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import GenerateReq, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# helpers.models' CASES at GPU_SIZES, with these changes: rope scaling from position 64, windows
# of 64 that the 130- and 300-token prompts run past, more experts
CASES = {
    "llama_gqa_llama3_rope": dict(rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 64}),
    "qwen2_bias_tied": dict(num_key_value_heads=4),
    "qwen3_head_dim_24": {},
    "gemma2_window_16": dict(sliding_window=64, query_pre_attn_scalar=48),
    "gemma3_window_16": dict(sliding_window=64, query_pre_attn_scalar=64, tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=8),
    "qwen3_moe": dict(num_experts=16, moe_intermediate_size=128),
    # heads of 32 and 64 (one extend-attention block size), per-layer inputs over the whole vocabulary
    "gemma4": dict(num_hidden_layers=4, head_dim=32, global_head_dim=64, sliding_window=64,
                   vocab_size_per_layer_input=1000),
    "gemma4_moe": dict(num_hidden_layers=2, head_dim=32, global_head_dim=64, sliding_window=64, num_experts=16,
                       moe_intermediate_size=128),
    # attention sinks on sliding and full layers, YaRN past position 64, experts with biases and the clamped SwiGLU
    "gpt_oss": dict(num_local_experts=8, intermediate_size=128, sliding_window=64,
                    rope_parameters={**YARN_ROPE, "original_max_position_embeddings": 64}),
}
PROMPT_LENS = (5, 130, 37, 300)
NEW_TOKENS = 24
BF16_AGREEMENT = 0.5  # mean share of greedy tokens before the first flip, against transformers' bf16
BF16_LOGIT_TOL = 0.05  # prefill logits, bf16 on the GPU against fp32 on the CPU, relative to the largest
PATHS = ("runner", "engine chunk 64, overlap", "engine chunk 7, no overlap")


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(model directory, transformers model, prompts, transformers' greedy tokens by dtype)."""
    model_dir = tmp_path_factory.mktemp(request.param)
    hf_model = make_gpu_model(request.param, model_dir, **CASES[request.param])
    prompts = random_prompts(1, PROMPT_LENS, vocab=GPU_SIZES["vocab_size"])
    reference = {dtype: list(hf_greedy(hf_model.to("cuda", dtype), prompts, NEW_TOKENS).values())
                 for dtype in (torch.float32, torch.bfloat16)}
    return model_dir, hf_model, prompts, reference


def gpu_runner(model_dir, dtype="float32", device="cuda", **settings):
    return make_runner(model_dir, tokens=4096, device=device, max_req_total_len=512, cuda_graph_max_tokens=512,
                       data_type=dtype, **settings)


def runner_tokens(model_dir, prompts, dtype="float32", **settings) -> list[list[int]]:
    """Greedy tokens through ModelRunner: every prompt in one prefill step, then decode steps."""
    runner = gpu_runner(model_dir, dtype, **settings)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    out = [[t] for t, _ in run_step(runner, prompts=[(i, p, params) for i, p in enumerate(prompts)])]
    ids = list(range(len(prompts)))
    for _ in range(NEW_TOKENS - 1):
        for seq, (t, _) in zip(out, run_step(runner, ids)):
            seq.append(t)
    runner.free(ids)
    assert runner.stats()["tokens_used"] == 0, "tokens left in use after freeing every request"
    return out


def engine_tokens(model_dir, prompts, dtype="float32", chunk=64, overlap=True, cuda_graph=True,
                  prefix_cache=True) -> list[list[int]]:
    """Through the engine core: request 0 decodes alone for 3 steps, then the rest arrive; the
    last prompt arrives 6 steps later (with prompts sharing a prefix: a prefix-cache hit)."""
    core = engine(gpu_runner(model_dir, dtype, cuda_graph=cuda_graph), chunk, overlap, prefix_cache)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    core.add(GenerateReq(0, prompts[0], params))
    outs = core.step() + core.step() + core.step()
    for i, prompt in enumerate(prompts[1:-1], 1):
        core.add(GenerateReq(i, prompt, params))
    for _ in range(6):
        outs += core.step()
    core.add(GenerateReq(len(prompts) - 1, prompts[-1], params))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for out in outs + core.drain():
        tokens[out.req_id].append(out.token_id)
    assert_idle(core)
    return [tokens[i] for i in range(len(prompts))]


def path_tokens(path: str, model_dir, prompts, dtype: str) -> list[list[int]]:
    if path == "runner":
        return runner_tokens(model_dir, prompts, dtype)
    return engine_tokens(model_dir, prompts, dtype, chunk=64 if "64" in path else 7, overlap="no overlap" not in path)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean share of each sequence before its first differing token (after a difference the two
    continuations see different contexts, so later tokens say nothing)."""
    def prefix(sa, sb):
        return next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), len(sa))
    return sum(prefix(sa, sb) / len(sa) for sa, sb in zip(a, b)) / len(a)


def prefill_logits(model_dir, prompts, dtype="float32", **settings) -> torch.Tensor:
    """The fp32 logits (on the host) that one prefill step of every prompt samples from."""
    from lightllm.engine import model_runner

    seen = []
    real_sample = model_runner.sample
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "sample", lambda x, batch: seen.append(x.float().cpu()) or real_sample(x, batch))
        runner = gpu_runner(model_dir, dtype, **settings)
        seen.clear()  # a CUDA runner's start-up samples a random row once (ModelRunner._warm_sampler)
        run_step(runner, prompts=[(i, p, SamplingParams()) for i, p in enumerate(prompts)])
    assert len(seen) == 1 and seen[0].shape[0] == len(prompts), [tuple(x.shape) for x in seen]
    return seen[0]


def distance(logits: torch.Tensor, exact: torch.Tensor) -> float:
    return ((logits - exact).abs().max() / exact.abs().max()).item()


def same_top(logits: torch.Tensor, exact: torch.Tensor) -> bool:
    """The same top token in every row, except where `exact`'s top two are a near-tie that the
    row's own error can flip (their gap at most twice the row's largest |difference|)."""
    for row in (logits.argmax(-1) != exact.argmax(-1)).nonzero().flatten().tolist():
        top = exact[row].topk(2).values
        if top[0] - top[1] > 2 * (logits[row] - exact[row]).abs().max():
            return False
    return True


@pytest.mark.parametrize("path", PATHS)
def test_fp32_greedy_tokens_equal_transformers(case, path):
    model_dir, _, prompts, reference = case
    ours, theirs = path_tokens(path, model_dir, prompts, "float32"), reference[torch.float32]
    assert agreement(ours, theirs) == 1.0, first_differences(ours, theirs, prompts)


def first_differences(ours: list[list[int]], theirs: list[list[int]], prompts: list[list[int]]) -> list[str]:
    """Where each differing sequence first differs: its prompt's length and the token's index."""
    out = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            out.append(f"prompt {i} ({len(prompts[i])} tokens): token {at}, ours {a[at:at + 4]}, theirs {b[at:at + 4]}")
    return out


@pytest.mark.parametrize("path", PATHS)
def test_bf16_greedy_tokens_near_transformers_bf16(case, path):
    model_dir, _, prompts, reference = case
    ours = path_tokens(path, model_dir, prompts, "bfloat16")
    theirs = agreement(reference[torch.bfloat16], reference[torch.float32])
    agree, own = agreement(ours, reference[torch.bfloat16]), agreement(ours, reference[torch.float32])
    assert agree >= BF16_AGREEMENT or own >= theirs, (agree, own, theirs)


def test_bf16_prefill_logits_near_cpu_fp32(case):
    model_dir, hf_model, prompts, _ = case
    bf16, exact = prefill_logits(model_dir, prompts, "bfloat16"), prefill_logits(model_dir, prompts, device="cpu")
    hf_model = hf_model.to("cuda", torch.bfloat16)
    with torch.no_grad():
        hf_bf16 = torch.stack([hf_model(torch.tensor([p], device="cuda")).logits[0, -1].float().cpu() for p in prompts])
    bound = max(BF16_LOGIT_TOL, distance(hf_bf16, exact))
    assert distance(bf16, exact) <= bound and same_top(bf16, exact), (distance(bf16, exact), bound)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_graph_replayed_steps_equal_eager_steps(case, overlap, prefix_cache):
    model_dir, _, prompts, _ = case
    shared = prompts + [prompts[1][:96] + prompts[2][:20]]  # the last shares prompt 1's first 96 tokens
    graphs, eager = (engine_tokens(model_dir, shared, overlap=overlap, cuda_graph=g, prefix_cache=prefix_cache)
                     for g in (True, False))
    assert graphs == eager


@pytest.mark.parametrize("first_only", [False, True], ids=["all prompts", "first prompt (small-M GEMM)"])
def test_fp8_prefill_costs_the_gpu_no_more_than_the_cpu(case, first_only):
    model_dir, _, prompts, _ = case
    batch = prompts[:1] if first_only else prompts
    logits = {(device, q): prefill_logits(model_dir, batch, device=device, quantization=q)
              for device in ("cuda", "cpu") for q in ("fp8", None)}
    gpu_err, cpu_err = (distance(logits[(device, "fp8")], logits[(device, None)]) for device in ("cuda", "cpu"))
    assert gpu_err <= 1.5 * cpu_err + 0.01, (gpu_err, cpu_err)
    assert same_top(logits[("cuda", "fp8")], logits[("cpu", "fp8")])


def test_fp8_kv_cache_greedy_tokens_near_the_cpu(case):
    model_dir, _, prompts, _ = case
    gpu = runner_tokens(model_dir, prompts, kv_cache_dtype="fp8_e4m3")
    cpu = runner_tokens(model_dir, prompts, device="cpu", kv_cache_dtype="fp8_e4m3")
    assert agreement(gpu, cpu) >= 0.9


@pytest.fixture(scope="module")
def mxfp4_case(tmp_path_factory):
    """gpt-oss's case with its experts replaced by random MXFP4 ones, as a published checkpoint holds them."""
    from test_gpt_oss import write_mxfp4_checkpoint

    model_dir = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4_checkpoint(make_gpu_model("gpt_oss", model_dir, **CASES["gpt_oss"]), model_dir)
    return model_dir, random_prompts(1, PROMPT_LENS, vocab=GPU_SIZES["vocab_size"])


def test_mxfp4_experts_widened_at_load_near_the_packed_kernels(mxfp4_case):
    """--mxfp4_experts dequantized (the dense experts' kernels) against the packed MXFP4 kernels, each
    through its runner's CUDA graphs: bf16 prefill logits no further from the CPU's fp32 than the
    packed ones' (or BF16_LOGIT_TOL), the same top tokens, and greedy decoding that agrees."""
    model_dir, prompts = mxfp4_case
    exact = prefill_logits(model_dir, prompts, device="cpu")
    packed = prefill_logits(model_dir, prompts, "bfloat16")
    wide = prefill_logits(model_dir, prompts, "bfloat16", mxfp4_experts="dequantized")
    bound = max(BF16_LOGIT_TOL, 1.5 * distance(packed, exact))
    assert distance(wide, exact) <= bound and same_top(wide, exact), (distance(wide, exact), bound)
    tokens = {form: runner_tokens(model_dir, prompts, "bfloat16", mxfp4_experts=form)
              for form in ("packed", "dequantized")}
    assert agreement(tokens["dequantized"], tokens["packed"]) >= BF16_AGREEMENT


def test_mxfp4_experts_in_fp8_cost_the_gpu_no_more_than_the_cpu(mxfp4_case):
    """--mxfp4_experts dequantized --quantization fp8 (the experts re-encoded in fp8 with the same
    values): as test_fp8_prefill_costs_the_gpu_no_more_than_the_cpu, against the experts widened in
    --data_type."""
    model_dir, prompts = mxfp4_case
    logits = {(device, q): prefill_logits(model_dir, prompts, device=device, quantization=q,
                                          mxfp4_experts="dequantized")
              for device in ("cuda", "cpu") for q in ("fp8", None)}
    gpu_err, cpu_err = (distance(logits[(device, "fp8")], logits[(device, None)]) for device in ("cuda", "cpu"))
    assert gpu_err <= 1.5 * cpu_err + 0.01, (gpu_err, cpu_err)
    assert same_top(logits[("cuda", "fp8")], logits[("cpu", "fp8")])


def test_graphs_capture_while_an_earlier_runners_graphs_wait_for_collection(tmp_path, monkeypatch):
    """A runner dropped in a reference cycle keeps its CUDA graphs until the cyclic collector runs,
    which it may do at any allocation: inside the next runner's capture, where destroying a graph
    invalidated that capture. Here a captured graph is dropped in a cycle at the first captured
    forward, and the collector is made to run at once: the capture must not see it."""
    model_dir = tmp_path / "llama"
    make_gpu_model("llama_gqa_llama3_rope", model_dir, **CASES["llama_gqa_llama3_rope"])
    x = torch.ones(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.mul_(2)
    garbage = [graph]
    del graph
    forward = ModelRunner.target_forward

    def forward_dropping_a_graph(self, batch, kv):
        if garbage and torch.cuda.is_current_stream_capturing():
            cycle = [garbage.pop()]
            cycle.append(cycle)
            del cycle
            kept = [[] for _ in range(1000)]  # allocations past the threshold: the collector runs if it may
            del kept
        return forward(self, batch, kv)

    monkeypatch.setattr(ModelRunner, "target_forward", forward_dropping_a_graph)
    thresholds = gc.get_threshold()
    gc.set_threshold(10)
    try:
        runner = gpu_runner(model_dir)
    finally:
        gc.set_threshold(*thresholds)
    assert not garbage, "no forward was captured"
    assert runner.graphs is not None and runner.graphs.graphs, "no graph captured"
    monkeypatch.undo()
    prompts = random_prompts(1, (5, 37), vocab=GPU_SIZES["vocab_size"])
    assert engine_tokens(model_dir, prompts) == engine_tokens(model_dir, prompts, cuda_graph=False)
