"""test/benchmark/serving/spec_sweep.py without a server: loads as written, the oracle from the plain
run's outputs, the table's ratios against speculation off, and saved sweeps merged into one report.
Also the copy workloads' requests (test/benchmark/lib/copy_workloads.py) from given text."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmark.lib.controlled_draft import ControlledDraft, read_oracle, write_oracle
from benchmark.lib.copy_workloads import REPLACEMENT, build_requests, word_to_replace
from benchmark.serving import spec_sweep
from benchmark.serving.spec_sweep import OFF, Cell, Load, markdown, matches, oracle_pairs, parse_loads

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_loads_are_parsed_as_written():
    assert parse_loads("batch1, conc8,burst1000,poisson2.5,conc64@500,batch1@16") == [
        Load("batch1", None, 1), Load("conc8", None, 8), Load("burst1000", 1000), Load("poisson2.5", None, rate=2.5),
        Load("conc64@500", 500, 64), Load("batch1@16", 16, 1)]
    assert parse_loads("burst10@3") == [Load("burst10@3", 3)]  # @COUNT wins over the burst's own


@pytest.mark.parametrize("text", ["", "batch2", "conc0", "poisson0", "burst", "conc8@0", "rate5", "conc8,,x"])
def test_malformed_loads_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_loads(text)


@pytest.mark.parametrize("text", ["1.5", "-0.1", "0.2,x"])
def test_alphas_outside_zero_to_one_are_refused(text):
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        spec_sweep.parse_alphas(text)


def test_the_controlled_settings_name_the_draft_and_its_oracle(tmp_path):
    args = spec_sweep.build_parser().parse_args(["--alphas", "0,0.8", "--num-speculative-tokens", "6", "--seed", "3"])
    off, zero, high = spec_sweep.settings_of(args)
    assert (off.flags(args, tmp_path / "o.jsonl"), zero.alpha, high.name) == ([], 0.0, "alpha 0.8")
    flag, config = high.flags(args, tmp_path / "o.jsonl")
    assert flag == "--speculative_config"
    assert json.loads(config) == {"method": spec_sweep.CONTROLLED, "num_speculative_tokens": 6,
                                  "oracle": str(tmp_path / "o.jsonl"), "alpha": 0.8, "seed": 3}
    copy = spec_sweep.build_parser().parse_args(["--workload", "copy", "--methods", "ngram,suffix"])
    assert [(s.name, s.flags(copy, tmp_path)[1:]) for s in spec_sweep.settings_of(copy)] == [
        (OFF, []), ("ngram", ['{"method": "ngram", "num_speculative_tokens": 8}']),
        ("suffix", ['{"method": "suffix", "num_speculative_tokens": 8}'])]


def test_the_oracle_takes_each_prompts_first_returned_output(tmp_path):
    prompts = [[1, 2], [3], [4, 5, 6]]
    plain = {"batch1@2": [[10, 11], None], "conc8": [[12, 13], [14, 15], [16, 17]]}  # request 1 failed at batch1
    pairs = oracle_pairs(prompts, plain)
    assert pairs == [([1, 2], [10, 11]), ([3], [14, 15]), ([4, 5, 6], [16, 17])]
    path = tmp_path / "oracle.jsonl"
    assert write_oracle(path, pairs) == 3 and read_oracle(path) == pairs
    draft = ControlledDraft(100, path, alpha=1.0)
    draft.start(7, [3])
    assert draft.propose(7, 4) == [14, 15]
    assert oracle_pairs(prompts, {"batch1": [None, None, None]}) == []


def test_outputs_match_only_where_off_returned_the_same():
    assert matches([[1, 2], [3, 4], None], [[1, 2], [3, 5], [6, 7]]) == (1, 2)
    assert matches([[1, 2], [3, 4]], [[1, 2], None]) == (1, 2)  # a failed request does not match
    assert matches(None, [[1]]) == (None, None)


def cells() -> list[Cell]:
    return [
        Cell("batch1", OFF, None, 8, 0, 100.0, 10.0, 12.0),
        Cell("batch1", "alpha 0.8", 0.8, 8, 0, 250.0, 4.0, 6.0, {"drafts": 100, "draft_tokens": 400, "accepted": 240},
             8, 8),
        Cell("conc8", OFF, None, 8, 0, 400.0, 20.0, 25.0),
        Cell("conc8", "alpha 0.8", 0.8, 7, 1, 300.0, 30.0, 50.0, {}, 6, 8, "HTTP 500: x|y"),
        Cell("conc8", "alpha 0", 0.0, 0, 0, error="server start: RuntimeError: server exited with 1:\n"
             "INFO starting\nTraceback (most recent call last):\n  ...\nFileNotFoundError: oracle.jsonl\n"),
    ]


def test_the_table_gives_each_setting_against_off_at_its_load():
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in markdown(cells()).splitlines()]
    header = rows[0]
    assert header[:5] == ["load", "setting", "done", "out tok/s", "x off"] and len(rows) == 2 + 5
    by = {(row[0], row[1]): dict(zip(header, row)) for row in rows[2:]}
    # the columns repeat "x off": read them by position
    fast = rows[3]
    assert fast[:2] == ["batch1", "alpha 0.8"]
    assert fast[3:9] == ["250.0", "2.50", "4.00", "0.40", "6.00", "0.50"]
    assert fast[9:12] == ["2.40", "60%", "8/8"]  # accepted per drafting step, share of draft tokens accepted
    slow = rows[5]
    assert slow[2:9] == ["7/8", "300.0", "0.75", "30.00", "1.50", "50.00", "2.00"]
    assert slow[9:12] == ["-", "-", "6/8"]  # no counters on /metrics
    assert "|" not in slow[12] and slow[12].startswith("HTTP 500")  # a | would break the table
    failed = by[("conc8", "alpha 0")]
    assert failed["out tok/s"] == "-"  # a server's log tail: the first line and the reason, on one line
    assert failed["error"] == "server start: RuntimeError: server exited with 1: ... FileNotFoundError: oracle.jsonl"
    assert by[("batch1", OFF)]["same as off"] == "-"


def test_saved_sweeps_merge_into_one_report(tmp_path):
    first, second = cells()[:2], cells()[2:]
    paths = []
    for n, part in enumerate((first, second)):
        out = tmp_path / f"part{n}.json"
        args = spec_sweep.build_parser().parse_args(["--out-json", str(out)])
        spec_sweep.report(args, part, [{"date": f"day {n}", "command": "cmd"}])
        paths.append(out)
    out_md, out_json, png = tmp_path / "all.md", tmp_path / "all.json", tmp_path / "all.png"
    assert spec_sweep.main(["--merge", *map(str, paths), "--out-md", str(out_md), "--out-json", str(out_json),
                            "--plot", str(png)]) == 0
    merged = json.loads(out_json.read_text())
    assert [Cell(**c) for c in merged["cells"]] == cells()
    assert [m["date"] for m in merged["meta"]] == ["day 0", "day 1"]
    assert markdown(cells()) in out_md.read_text() and "day 1" in out_md.read_text()
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_the_plot_draws_methods_by_name(tmp_path):
    by_method = [Cell("batch1", OFF, None, 4, 0, 50.0), Cell("batch1", "ngram", None, 4, 0, 90.0),
                 Cell("batch1", "suffix", None, 4, 0, 110.0), Cell("conc8", "ngram", None, 0, 4, error="x")]
    spec_sweep.plot(by_method, tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes().startswith(PNG_MAGIC)


# ---- copy workloads ----

PASSAGE = ("Alice met Bob in Paris. Alice said the weather in Paris was lovely, and Bob agreed that "
           "Alice was right about the weather.")


def test_the_word_replaced_is_the_most_frequent_capitalised_long_one():
    assert word_to_replace(PASSAGE) == "Alice"  # 3 times; "Paris" twice, "weather" lower case
    assert word_to_replace("the weather and the weather again, rain") == "weather"
    assert word_to_replace("a b c") is None


def test_copy_requests_take_turns_and_hold_the_passage():
    pairs = [(f"Question {i}?", f"{PASSAGE} Number {i}.") for i in range(12)] + [("Short?", "Too short.")]
    words = lambda text: len(text.split())  # noqa: E731  (a tokenizer's stand-in: one token a word)
    requests = build_requests(pairs, words, 6, seed=1, passage_tokens=(10, 100))
    assert [r.kind for r in requests] == ["repeat", "edit", "multi-turn"] * 2
    for request in requests:
        passage_tokens = words(PASSAGE) + 2
        assert request.max_tokens >= passage_tokens  # room to copy it all
        assert PASSAGE in "".join(m["content"] for m in request.messages)
        assert request.messages[-1]["role"] == "user"
    edit = requests[1].messages[0]["content"]
    assert '"Alice"' in edit and REPLACEMENT in edit
    chat = requests[2].messages
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant", "user"]
    answers = dict(pairs)
    assert answers[chat[2]["content"]] == chat[3]["content"] != chat[1]["content"]  # the passage: the latest answer
    assert "previous answer" in chat[4]["content"]
    with pytest.raises(ValueError, match="only"):
        build_requests(pairs, words, 20, passage_tokens=(10, 100))
    with pytest.raises(ValueError, match="kinds"):
        build_requests(pairs, words, 2, kinds=("paraphrase",))
