"""LoRA under tensor parallelism on the CPU: two gloo ranks give the logits of one rank for a batch
that mixes two adapters and the base model (prefill chunks, then decodes). Column-parallel layers
keep all of A and their rows of B, row-parallel ones their columns of A and all of B, their share
added before the all-reduce (lightllm/models/lora.py). fp32, atol = rtol = 1e-4."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.lora import ALL_TARGETS, make_adapter
from helpers.models import make_model, make_runner, random_prompts

from lightllm.engine import model_runner, sampling
from lightllm.engine.plan import Chunk, StepPlan
from lightllm.engine.request import SamplingParams
from lightllm.utils.net import free_port

ATOL = RTOL = 1e-4
DECODE_STEPS = 3


def lora_logits(model_dir, adapters, **settings) -> list[torch.Tensor]:
    """Every step's logits: three prompts under adapter 1, none and adapter 2, then decodes."""
    seen = []

    def capture(logits, batch):
        seen.append(logits.clone())
        return sampling.sample(logits, batch)

    original, model_runner.sample = model_runner.sample, capture
    try:
        runner = make_runner(model_dir, lora_modules=tuple(f"{i}={path}" for i, path in enumerate(adapters)),
                             max_loras=2, max_lora_rank=8, **settings)
        prompts = random_prompts(5, lengths=(6, 11, 4))
        chunks = [Chunk(i, p, 0, True, SamplingParams(), lora=lora) for i, (p, lora) in enumerate(zip(prompts, (1, 0, 2)))]
        runner.step(StepPlan(0, [], chunks, sync=True))
        for step in range(1, 1 + DECODE_STEPS):
            runner.step(StepPlan(step, [0, 1, 2], [], sync=True))
        runner.free([0, 1, 2])
    finally:
        model_runner.sample = original
    return seen


def tp_worker(rank, world_size, port, model_dir, adapters, out_file):
    logits = lora_logits(model_dir, adapters, tp_rank=rank, tp=world_size, nccl_port=port)
    if rank == 0:
        torch.save(logits, out_file)
    dist.barrier()  # both ranks leave the group before either exits (see test_tp.py)
    dist.destroy_process_group()


def test_tp2_matches_tp1_with_adapters(tmp_path):
    model_dir = tmp_path / "model"
    make_model("llama_gqa_llama3_rope", model_dir, seed=4)
    adapters = [make_adapter(model_dir, tmp_path / "a", 8, 16, ALL_TARGETS, seed=5),
                make_adapter(model_dir, tmp_path / "b", 4, 8, ["k_proj", "o_proj", "up_proj", "down_proj"], True, seed=6)]
    out_file = tmp_path / "tp2.pt"
    mp.spawn(tp_worker, args=(2, free_port(), model_dir, adapters, out_file), nprocs=2, join=True)
    tp2, tp1 = torch.load(out_file), lora_logits(model_dir, adapters)
    assert len(tp2) == len(tp1) == 1 + DECODE_STEPS
    for ours, reference in zip(tp2, tp1):
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=RTOL)
