"""Speculative decoding on the GPU: drafts verified in CUDA-graph decode steps and in mixed steps
beside prompt chunks give transformers' greedy tokens (a tiny random Llama, fp32), with drafts
partly wrong so that runs of every length are accepted and rejected.

    python -m pytest -m gpu tests/gpu/test_gpu_spec.py
"""

import pytest
import torch
from helpers.models import GPU_SIZES, Client, assert_idle, hf_greedy, make_gpu_model, make_runner, random_prompts
from helpers.spec import OracleDraft, speculating_engine

from lightllm.engine.request import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
def test_drafts_verified_on_the_gpu_give_transformers_greedy_tokens(tmp_path, cuda_graph):
    hf_model = make_gpu_model("llama_gqa_llama3_rope", tmp_path)
    prompts = random_prompts(3, [5, 130, 37, 300, 17, 64], vocab=GPU_SIZES["vocab_size"])
    expected = hf_greedy(hf_model.to("cuda"), prompts, 40)
    OracleDraft.ORACLE = {tuple(p): expected[i] for i, p in enumerate(prompts)}
    runner = make_runner(tmp_path, tokens=8192, device="cuda", cuda_graph=cuda_graph, max_req_total_len=512,
                         running_max_req_size=64)
    core = speculating_engine(runner, 128, "helpers.spec:OracleDraft")
    got = Client(core).run(prompts, SamplingParams(max_new_tokens=40), staggered=True)  # chunks beside drafts
    assert got == [expected[i] for i in range(len(prompts))]
    spec = core.scheduler.speculator
    assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens
    assert_idle(core)


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
def test_a_draft_model_on_the_gpu_gives_transformers_greedy_tokens(tmp_path, cuda_graph):
    """The target as its own draft model: its proposals (catch-up and single-token steps on the
    GPU, KV on the target's slots and scratch rows) are nearly all accepted, the output unchanged."""
    import json

    from helpers.models import engine

    from lightllm.engine.spec.config import SpeculativeConfig
    from lightllm.engine.spec.controller import Speculator

    hf_model = make_gpu_model("llama_gqa_llama3_rope", tmp_path)
    prompts = random_prompts(4, [5, 130, 37, 300, 17, 64], vocab=GPU_SIZES["vocab_size"])
    expected = hf_greedy(hf_model.to("cuda"), prompts, 40)
    config = json.dumps({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 4})
    runner = make_runner(tmp_path, tokens=8192, device="cuda", cuda_graph=cuda_graph, max_req_total_len=512,
                         running_max_req_size=64, speculative_config=config)
    core = engine(runner, 128)
    spec = Speculator(SpeculativeConfig.parse(config), GPU_SIZES["vocab_size"], 64 * 5, drafter=runner.draft)
    spec.guard = None  # the per-step choice alone: this checks the tokens
    spec.measured(False, 1, 0.01)
    core.scheduler.speculator = spec
    got = Client(core).run(prompts, SamplingParams(max_new_tokens=40), staggered=True)
    assert got == [expected[i] for i in range(len(prompts))]
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens
    assert_idle(core)
