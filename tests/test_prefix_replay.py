"""test/benchmark/engine/prefix_replay.py runs the server's engine over a shared-prefix burst on the
CPU and reports what the scheduler did with it."""

import argparse

from benchmark.engine import prefix_replay


def test_a_hybrid_burst_whose_prompts_share_a_header_resumes_from_each_groups_prefix(tmp_path):
    """3 groups of 4 prompts sharing 100 tokens each, all starting with the same 3 (a template
    header): apart from each group's leader and the first group's (the first prompt ran alone, its
    snapshot lies past the shared prefix) requests resume from their group's prefix, so well under
    half of the prompt tokens sent are computed."""
    args = argparse.Namespace(preset="tiny-qwen3.5", prefix_len=100, question_len=24, groups=3, group_size=4,
                              interval=64, snapshot_slots=8, chunk=32, burst=128, first_alone=1, header_len=3, seed=0,
                              no_cache=False)
    result = prefix_replay.replay(args, prefix_replay.write_bench_model(tmp_path / "model", args.preset))
    assert result["hybrid"] and result["requests"] == 12
    assert result["resumed"] >= 2 * 3  # the second and third groups' followers at least
    assert result["prompt_tokens_computed"] < result["prompt_tokens"] / 2
    assert result["median_step"] <= result["last_step"]
    assert 0 < result["median_tokens_before"] <= result["prompt_tokens_computed"]
