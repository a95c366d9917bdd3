"""test/benchmark/engine/draft_source_cost.py times each host source on both workloads, from this
tree or another checkout's."""

import re
from pathlib import Path

from benchmark.engine import draft_source_cost

ROOT = Path(__file__).resolve().parents[1]


def test_draft_source_cost_times_each_source_and_workload(capsys):
    args = ["--requests", "4", "--pool", "3", "--steps", "2", "--rounds", "1"]
    assert draft_source_cost.main(args) == 0
    assert draft_source_cost.main([*args, "--tree", str(ROOT), "--methods", "suffix"]) == 0
    rows = re.findall(r"^\| (\w+) \| (\w+) \| (\d+\.\d) \| (\d+\.\d) \| (\d+\.\d) \|$", capsys.readouterr().out, re.M)
    assert [(m, w) for m, w, *_ in rows] == [("ngram", "shared"), ("ngram", "own"), ("suffix", "shared"),
                                             ("suffix", "own"), ("suffix", "shared"), ("suffix", "own")]
    assert all(float(propose) > 0 for _, _, propose, _, _ in rows)


def test_the_workloads_give_the_suffix_source_something_to_propose():
    """Outputs that loop: nearly every request's proposal is k tokens of its loop (a longest match
    may be a finished sequence's last tokens, which continue with nothing)."""
    drafts = draft_source_cost.load_drafts(None)
    for workload in draft_source_cost.WORKLOADS:
        source = drafts.SuffixDraft()
        draft_source_cost.start(source, workload, requests=8, pool=5)
        assert sum(len(source.propose(i, 4)) == 4 for i in range(8)) >= 6
