"""A shared-prefix burst through the real engine on the CPU: which steps give each request its first
token, how much of its prompt it took from the cache, and how many prompt tokens were computed.

    python test/benchmark/engine/prefix_replay.py [--preset tiny-qwen3.5] [--prefix-len 2000]
        [--question-len 128] [--groups 8] [--group-size 8] [--interval 2048] [--chunk 2048]
        [--burst 8192] [--first-alone 1] [--header-len 0]

`groups` system prompts of `prefix-len` random tokens, each followed by `group-size` questions of
`question-len` random tokens (4 output tokens each), as device_serving.sh's SHARED_PREFIX workload
sends them to a GPU, after `--header-len` tokens that every prompt starts with (a chat template's
header). The first request arrives alone and runs `--first-alone` steps before the rest
arrive (a server starts the first prompt it gets). The engine is the server's (scheduler, engine
core, ModelRunner) on a tiny random model of the preset's family, so step counts and token counts
are the scheduler's, not a cost model's: a step here is one of the server's steps, whatever it
would take on a GPU. Where the GPU is compute-bound (a burst of long prompts), the prompt tokens
computed before a request's first token stand in for its time to first token: the median of those
with the cache against `--no-cache` estimates the TTFT ratio. For a hybrid preset `--interval` is the snapshot interval
(--state_snapshot_interval); the budgets are --chunked_prefill_size and the burst budget.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from lightllm.engine.config import EngineConfig  # noqa: E402
from lightllm.engine.core import EngineCore  # noqa: E402
from lightllm.engine.model_runner import ModelRunner  # noqa: E402
from lightllm.engine.request import GenerateReq, SamplingParams  # noqa: E402
from lightllm.engine.scheduler import Scheduler  # noqa: E402
from lightllm.tools.bench_model import write_bench_model  # noqa: E402

NEW_TOKENS = 4


def replay(args, model_dir: Path) -> dict:
    total = args.groups * args.group_size * (args.prefix_len + args.question_len + NEW_TOKENS)
    config = EngineConfig(model_dir=str(model_dir), max_total_token_num=total + 1024,
                          max_req_total_len=args.prefix_len + args.question_len + NEW_TOKENS + 8,
                          running_max_req_size=args.groups * args.group_size, disable_cuda_graph=True,
                          state_snapshot_interval=args.interval, state_snapshot_slots=args.snapshot_slots)
    runner = ModelRunner(config, device="cpu", check_budget=False)
    hybrid = runner.state_pool is not None
    scheduler = Scheduler(runner.max_total_token_num, args.chunk, runner.req_table.max_reqs,
                          burst_chunk_budget=args.burst, prefix_cache=not args.no_cache, snapshot_interval=args.interval if hybrid else 0,
                          snapshot_slots=runner.info["state_snapshot_slots"] if hybrid and not args.no_cache else 0)
    core = EngineCore(scheduler, runner, eos_token_ids=[])
    gen = torch.Generator().manual_seed(args.seed)
    vocab = runner.config.vocab_size
    header = torch.randint(0, vocab, (args.header_len,), generator=gen).tolist()
    prefixes = [header + torch.randint(0, vocab, (args.prefix_len - args.header_len,), generator=gen).tolist()
                for _ in range(args.groups)]
    prompts = [p + torch.randint(0, vocab, (args.question_len,), generator=gen).tolist()
               for p in prefixes for _ in range(args.group_size)]
    computed = []
    schedule = scheduler.schedule

    def counted():
        plan = schedule()
        computed.append(sum(len(c.token_ids) for c in plan.chunks))
        return plan

    scheduler.schedule = counted
    first: dict[int, tuple[int, int]] = {}
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    core.add(GenerateReq(0, prompts[0], params))
    step = 0
    while step < 10_000:
        if step == args.first_alone:
            for i, prompt in enumerate(prompts[1:], 1):
                core.add(GenerateReq(i, prompt, params))
        for out in core.step():
            first.setdefault(out.req_id, (step, out.cached_tokens))
        step += 1
        if step > args.first_alone and not scheduler.has_work:
            break
    for out in core.drain():
        first.setdefault(out.req_id, (step, out.cached_tokens))
    steps = sorted(s for s, _ in first.values())
    done = [sum(computed[: s + 1]) for s in steps]  # prompt tokens computed by the end of its first token's step
    return {"requests": len(prompts), "hybrid": hybrid, "median_step": statistics.median(steps),
            "median_tokens_before": statistics.median(done),
            "last_step": steps[-1], "resumed": sum(c >= args.prefix_len for _, c in first.values()),
            "prompt_tokens_computed": sum(computed), "prompt_tokens": sum(map(len, prompts))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--preset", default="tiny-qwen3.5", help="a tiny preset of lightllm.tools.bench_model")
    add("--prefix-len", type=int, default=2000)
    add("--question-len", type=int, default=128)
    add("--groups", type=int, default=8)
    add("--group-size", type=int, default=8)
    add("--interval", type=int, default=2048, help="the snapshot interval (hybrid presets)")
    add("--snapshot-slots", type=int, default=64)
    add("--chunk", type=int, default=2048, help="the step's prompt-token budget")
    add("--burst", type=int, default=8192, help="the burst budget")
    add("--first-alone", type=int, default=1, help="steps the first request runs before the rest arrive")
    add("--header-len", type=int, default=0, help="tokens every prompt starts with (inside --prefix-len)")
    add("--no-cache", action="store_true", help="the prefix cache off (--disable_prefix_cache): the baseline")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = replay(args, write_bench_model(Path(tmp) / "model", args.preset, seed=args.seed))
    print("| requests | first token: median step / last step | prompt tokens computed before the median "
          "first token | resumed from the shared prefix | prompt tokens computed / sent |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    print(f"| {result['requests']} | {result['median_step']:g} / {result['last_step']} | "
          f"{result['median_tokens_before']:,.0f} | {result['resumed']} | "
          f"{result['prompt_tokens_computed']:,} / {result['prompt_tokens']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
