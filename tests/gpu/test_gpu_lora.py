"""LoRA adapters on the GPU: a batch mixing three adapters and the base model (more adapters than
slots, chunks beside decodes) gives each request the same greedy tokens from captured CUDA graphs
as eagerly, and as PEFT on transformers' greedy `generate` on the same GPU and weights (a tiny
random Llama, fp32: the LoRA kernels multiply fp32 in IEEE precision, not TF32).

    python -m pytest -m gpu tests/gpu/test_gpu_lora.py
"""

import pytest
import torch
from helpers.lora import ALL_TARGETS, make_adapter, peft_greedy
from helpers.models import GPU_SIZES, make_gpu_model, make_runner, random_prompts

from lightllm.engine.core import EngineCore
from lightllm.engine.request import GenerateReq, SamplingParams
from lightllm.engine.scheduler import Scheduler
from lightllm.models.lora import SHARE_ROWS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NEW_TOKENS = 12
ADAPTERS = [(16, 32, ALL_TARGETS, False), (8, 8, ["q_proj", "v_proj", "down_proj"], True), (4, 8, ALL_TARGETS, False)]


def serve(runner, requests) -> list[list[int]]:
    """requests: (prompt, adapter id), all at once through an engine with 2 slots."""
    core = EngineCore(Scheduler(runner.max_total_token_num, 32, runner.req_table.max_reqs, max_loras=2,
                                lora_ids=(1, 2, 3)), runner, eos_token_ids=[])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outs = [o for i, (p, lora) in enumerate(requests) for o in core.add(GenerateReq(i, p, params, lora_id=lora))]
    outs += core.drain()
    return [[o.token_id for o in outs if o.req_id == i] for i in range(len(requests))]


def test_graphs_and_eager_equal_peft_with_mixed_adapters(tmp_path):
    model_dir = tmp_path / "model"
    make_gpu_model("llama_gqa_llama3_rope", model_dir)
    adapters = [make_adapter(model_dir, tmp_path / f"a{i}", *spec, seed=i) for i, spec in enumerate(ADAPTERS)]
    prompts = random_prompts(2, [5, 40, 77], vocab=GPU_SIZES["vocab_size"])
    requests = [(p, lora) for lora in range(4) for p in prompts]
    results = {}
    for cuda_graph in (True, False):
        runner = make_runner(model_dir, tokens=4096, device="cuda", cuda_graph=cuda_graph, max_req_total_len=256,
                             running_max_req_size=16, lora_modules=tuple(f"a{i}={p}" for i, p in enumerate(adapters)),
                             max_loras=2, max_lora_rank=16)
        results[cuda_graph] = serve(runner, requests)
        if cuda_graph:  # each decode bucket also without the LoRA kernels, for steps of no adapter row
            assert runner.graphs.base_graphs.keys() == runner.graphs.graphs.keys()
        del runner
    assert results[True] == results[False]
    expected = []
    for lora in range(4):
        expected += peft_greedy(model_dir, adapters[lora - 1] if lora else None, prompts, NEW_TOKENS, device="cuda")
    assert results[True] == expected


def test_split_down_projection_adds_the_adapter_once(tmp_path):
    """bf16, tp 1: the down projection of a step of few rows returns fp32 partial sums over K for the
    next norm to add (RowParallelLinear.split_sum) and hands that norm the adapters' share
    (defer_lora_sum: computed beside the GEMM); without the hand-over the share goes into the first
    partial sum, and without the split into the whole output. Each way the sum is x W^T + (x A^T)
    B^T per row, on rows of slot 0, of slot 1 and of none; a step with no adapter row adds nothing."""
    model_dir = tmp_path / "model"
    make_gpu_model("llama_gqa_llama3_rope", model_dir)
    runner = make_runner(model_dir, tokens=1024, device="cuda", cuda_graph=False, data_type="bfloat16",
                         max_loras=2, max_lora_rank=16)
    down = runner.model.layers[0].mlp.down
    norm = down.lora_norm
    assert down.split_sum == 2 and down.lora is not None and norm is runner.model.layers[1].input_norm
    torch.manual_seed(0)
    target = down.lora
    target.a.copy_(torch.randn_like(target.a) * 0.05)
    target.b.copy_(torch.randn_like(target.b) * 0.05)
    slots = torch.tensor([0, -1, 1, 0], device="cuda")
    assert len(slots) <= SHARE_ROWS  # a step small enough to hand its share over
    x = torch.randn(len(slots), down.weight_t.shape[0], device="cuda", dtype=torch.bfloat16)
    base = x.float() @ down.weight_t.float()
    expected = base.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[t] += (x[t].float() @ target.a[slot].float().T) @ target.b[slot].float().T
    tol = dict(atol=2e-2 * expected.abs().max().item(), rtol=2e-2)
    runner.model.lora.prepare(slots)
    split = down(x)
    share, norm.lora_share = norm.lora_share, None
    assert split.shape[0] == 2 and split.dtype == torch.float32 and share.dtype == torch.float32
    torch.testing.assert_close(split.sum(0), base, **tol)  # the GEMM's alone: the share is the norm's
    torch.testing.assert_close(split.sum(0) + share, expected, **tol)
    down.lora_norm = None
    torch.testing.assert_close(down(x).sum(0), expected, **tol)
    down.split_sum = 0
    whole = down(x)
    torch.testing.assert_close(whole.float(), expected, **tol)
    runner.model.lora.prepare(None)
    down.split_sum, down.lora_norm = 2, norm
    torch.testing.assert_close(down(x).sum(0), base, **tol)
    assert norm.lora_share is None
