"""GPU check and benchmark of CUDA-graph decode.

    python test/benchmark/gpu_graph_check.py [--model .gpu/bench-8b]

1. Correctness: a tiny random Llama (GQA, llama3 rope, fp32) runs a schedule whose decode
   batch changes size as requests join and finish (12 requests, running_max_req_size 16, so
   buckets 1..16 and most steps padded). Each request's greedy tokens with CUDA graphs must
   equal those without graphs and those of transformers' greedy `generate` on the same GPU.
2. Speed: the bench-8b-shaped model (Llama-3.1-8B shape, dummy bf16 weights; the directory
   needs only config.json, see `python -m lightllm.tools.bench_model`) at context 1024:
   median time of one `decode` step (10 timed after 3 warm-ups, each between two device
   synchronisations) with and without graphs, at batch 1, 8, 64, 128 and 256. The runner is
   built with max_req_total_len 3072 (the server's default), so captured decode attention
   plans its splits for 3072 tokens while the requests hold about 1024.

Prints markdown tables. Exit status 1 on a token mismatch, 2 without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightllm.engine.request import SamplingParams
from lightllm.engine.model_runner import ModelRunner, run_step

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, vocab_size=1000,
            rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                             "rope_theta": 500000.0})
# (prompt length, new tokens, decode step at which the request joins)
SCHEDULE = [(5, 30, 0), (130, 12, 0), (37, 25, 0), (300, 8, 0), (17, 40, 0), (64, 20, 3), (9, 3, 3),
            (250, 33, 5), (1, 18, 6), (77, 27, 6), (190, 15, 10), (44, 22, 12)]
BENCH_BATCHES = (1, 8, 64, 128, 256)
BENCH_CONTEXT = 1024
BENCH_MAX_REQ_TOTAL_LEN = 3072
WARMUP, ITERS = 3, 10
PREFILL_CHUNK_TOKENS = 16384

logger = logging.getLogger("gpu_graph_check")


# ---- 1. correctness ----

def build_tiny(out_dir: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return model


def run_schedule(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens per request, and the decode batch size of every step."""
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    tokens: dict[int, list[int]] = {}
    sizes, step = [], 0
    while len(tokens) < len(SCHEDULE) or any(len(tokens[i]) < SCHEDULE[i][1] for i in tokens):
        joining = [i for i, (_, _, start) in enumerate(SCHEDULE) if start == step and i not in tokens]
        if joining:
            for i, (tok, _) in zip(joining, run_step(runner, prompts=[(i, prompts[i], params) for i in joining])):
                tokens[i] = [tok]
        finished = [i for i in tokens if len(tokens[i]) == SCHEDULE[i][1] and i in runner.reqs]
        if finished:
            runner.free(finished)
        running = [i for i in tokens if len(tokens[i]) < SCHEDULE[i][1]]
        if running:
            sizes.append(len(running))
            for i, (tok, _) in zip(running, run_step(runner, running)):
                tokens[i].append(tok)
        step += 1
    runner.free([i for i in tokens if i in runner.reqs])
    assert runner.stats()["tokens_used"] == 0, "tokens left in use after freeing every request"
    return [tokens[i] for i in range(len(SCHEDULE))], sizes


def transformers_greedy(model: LlamaForCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    model = model.to("cuda", torch.float32)
    outs = []
    for prompt, (_, new_tokens, _) in zip(prompts, SCHEDULE):
        ids = torch.tensor([prompt], device="cuda")
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs


def check_correctness() -> bool:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n, _, _ in SCHEDULE]
    with tempfile.TemporaryDirectory() as d:
        hf_model = build_tiny(d)
        results = {}
        for cuda_graph in (True, False):
            runner = ModelRunner(d, max_total_token_num=8192, max_req_total_len=512, running_max_req_size=16,
                                 data_type="float32", device="cuda", cuda_graph=cuda_graph)
            results[cuda_graph] = run_schedule(runner, prompts)
            del runner
        reference = transformers_greedy(hf_model, prompts)
    (graph_tokens, sizes), (eager_tokens, _) = results[True], results[False]
    rows = ["| request | prompt | new tokens | graphs == eager | graphs == transformers |", "|---|---|---|---|---|"]
    for i, (g, e, r) in enumerate(zip(graph_tokens, eager_tokens, reference)):
        rows.append(f"| {i} | {SCHEDULE[i][0]} | {SCHEDULE[i][1]} | {g == e} | {g == r} |")
    print("\n".join(rows))
    print(f"\ndecode batch sizes, step by step: {sizes}")
    ok = graph_tokens == eager_tokens == reference
    print(f"\ncorrectness: {'PASS' if ok else 'FAIL'}\n", flush=True)
    return ok


# ---- 2. speed ----

def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_ms(runner: ModelRunner, batch: int, first_id: int) -> float:
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    vocab = runner.config.vocab_size
    reqs = [(first_id + i, torch.randint(vocab, (BENCH_CONTEXT,), generator=gen).tolist(), params)
            for i in range(batch)]
    per_chunk = max(1, PREFILL_CHUNK_TOKENS // BENCH_CONTEXT)
    for start in range(0, batch, per_chunk):
        run_step(runner, prompts=reqs[start: start + per_chunk])
    ids = [r[0] for r in reqs]
    times = [timed(lambda: run_step(runner, ids)) for _ in range(WARMUP + ITERS)]
    runner.free(ids)
    return 1000 * statistics.median(times[WARMUP:])


def bench(model_dir: Path, cuda_graph: bool) -> tuple[dict[int, float], float]:
    """Decode ms per batch size, and the runner's start-up time (capture included)."""
    start = time.perf_counter()
    runner = ModelRunner(str(model_dir), max_total_token_num=None, max_req_total_len=BENCH_MAX_REQ_TOTAL_LEN,
                         running_max_req_size=max(BENCH_BATCHES), data_type="bfloat16", load_format="dummy",
                         device="cuda", cuda_graph=cuda_graph)
    startup = time.perf_counter() - start
    results = {}
    for batch in BENCH_BATCHES:
        if batch * (BENCH_CONTEXT + WARMUP + ITERS) > runner.max_total_token_num:
            logger.warning("batch %d skipped: KV budget %d tokens", batch, runner.max_total_token_num)
            continue
        results[batch] = decode_ms(runner, batch, first_id=10_000 * batch)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return results, startup


def run_bench(model_dir: Path) -> None:
    eager, eager_start = bench(model_dir, cuda_graph=False)
    graphs, graph_start = bench(model_dir, cuda_graph=True)
    print(f"bench-8b-shaped decode at context {BENCH_CONTEXT}, {torch.cuda.get_device_name()}; runner start-up "
          f"{eager_start:.1f} s without graphs, {graph_start:.1f} s with (capture included)\n")
    print("| batch | eager ms | graphs ms | speedup | graphs tokens/s |\n|---|---|---|---|---|")
    for batch in graphs:
        if batch in eager:
            print(f"| {batch} | {eager[batch]:.3f} | {graphs[batch]:.3f} | {eager[batch] / graphs[batch]:.2f}x "
                  f"| {batch / graphs[batch] * 1000:.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(".gpu/bench-8b"),
                        help="bench-8b model directory (config.json is enough)")
    parser.add_argument("--skip-bench", action="store_true", help="only the correctness check")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("gpu_graph_check.py: no CUDA GPU found; nothing was checked", flush=True)
        return 2
    ok = check_correctness()
    if not args.skip_bench:
        if not (args.model / "config.json").exists():
            print(f"no {args.model}/config.json: write it with "
                  f"`python -m lightllm.tools.bench_model --out {args.model}`; benchmark skipped")
            return 0 if ok else 1
        run_bench(args.model)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
