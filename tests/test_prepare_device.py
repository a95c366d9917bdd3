"""What test/benchmark/prepare_device.py makes for a GPU call: one wheel a package at the version
installed here, the saved requests as the serving benchmark samples them, the records cut to the
prefix workloads' length, and nothing made twice."""

from __future__ import annotations

import importlib.metadata
import json
import random
import re

import pytest

from benchmark import prepare_device as prep
from benchmark.lib import sharegpt
from benchmark.lib.prefix_workloads import MAX_TEXT_CHARS

NAMES = ("rpyc", "plumbum", "fla-core")  # two installed here, one not (its range from setup.py)


class FakePip:
    """`download(requirement, folder)` that writes the wheel pip would: the pinned version, or 0.6.9
    for a range; records what it was asked for."""

    def __init__(self, extra: bool = False):
        self.asked, self.extra = [], extra

    def __call__(self, wanted: str, folder):
        self.asked.append(wanted)
        name, _, version = wanted.partition("==")
        name = re.split(r"[<>=]", name)[0]
        (folder / f"{prep.normalized(name)}-{version or '0.6.9'}-py3-none-any.whl").write_bytes(b"")
        if self.extra:
            (folder / f"{prep.normalized(name)}-0.0.1-py3-none-any.whl").write_bytes(b"")


def installed(name: str) -> str:
    return importlib.metadata.version(name)


def test_each_package_keeps_one_wheel_at_the_version_installed_here(tmp_path):
    stale = tmp_path / "rpyc-5.0.0-py3-none-any.whl"
    stale.write_bytes(b"")
    current = tmp_path / f"plumbum-{installed('plumbum')}-py3-none-any.whl"
    current.write_bytes(b"")
    pip = FakePip()
    kept = prep.prepare_wheels(tmp_path, NAMES, pip)
    # the stale one is replaced, the current one is not fetched again
    assert pip.asked == [f"rpyc=={installed('rpyc')}", prep.requirement("fla-core")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in kept)
    assert {p.name.split("-")[0]: prep.wheel_version(p) for p in kept} == {
        "rpyc": installed("rpyc"), "plumbum": installed("plumbum"), "fla_core": "0.6.9"}
    assert not stale.exists() and current.exists()
    pip.asked.clear()
    assert prep.prepare_wheels(tmp_path, NAMES, pip) == kept and pip.asked == []  # nothing made twice


def test_a_download_that_brings_two_wheels_of_a_package_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="expected one new wheel"):
        prep.prepare_wheels(tmp_path, ("rpyc",), FakePip(extra=True))


def test_wheel_names_are_normalized_as_wheel_files_spell_them():
    assert prep.normalized("pydantic-core") == "pydantic_core"
    assert prep.normalized("Typing.Inspection") == "typing_inspection"
    assert prep.normalized("prometheus_client") == "prometheus_client"


@pytest.fixture(scope="module")
def records():
    rng = random.Random(3)
    words = "the cache keeps every prompt prefix it has seen 東京 café 🙂".split()

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    return [{"id": str(i), "conversations": [{"from": "human", "value": text(rng.randint(3, 1200))},
                                             {"from": "gpt", "value": text(rng.randint(3, 300))}]}
            for i in range(400)]


def test_records_are_the_first_ones_with_every_message_cut(records):
    cut = prep.cut_records(records, count=250)
    assert [r["id"] for r in cut] == [r["id"] for r in records[:250]]
    for full, short in zip(records, cut):
        assert [t["value"] for t in short["conversations"]] == [t["value"][:MAX_TEXT_CHARS]
                                                               for t in full["conversations"]]
    assert any(len(t["value"]) > MAX_TEXT_CHARS for r in records[:250] for t in r["conversations"])


def test_saved_requests_are_the_benchmarks_sample_and_each_smaller_one_its_prefix(tmp_path, records,
                                                                                 default_model_dir):
    from transformers import AutoTokenizer

    paths = prep.prepare_requests(tmp_path, [20, 50], default_model_dir, records)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    expected = sharegpt.sample_requests(sharegpt.conversation_pairs(records), tokenizer, 50, seed=0)
    assert len(expected) == 50
    assert sharegpt.read_requests(paths[1]) == expected
    assert sharegpt.read_requests(paths[0]) == expected[:20]
    stamps = [p.stat().st_mtime_ns for p in paths]
    prep.prepare_requests(tmp_path, [20, 50], default_model_dir, [])  # present: not sampled again
    assert [p.stat().st_mtime_ns for p in paths] == stamps


def test_a_run_without_wheels_names_what_a_call_carries(tmp_path, records, default_model_dir):
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(records))
    carry = prep.main(["--root", str(tmp_path), "--no-wheels", "--requests", "10", "--dataset", str(dataset)])
    assert [p.relative_to(tmp_path).as_posix() for p in carry] == [
        ".gpu/bench-8b", ".gpu/requests-10.json", ".gpu/sharegpt-2000rec.json", ".gpu/COMMIT"]
    config = json.loads((tmp_path / ".gpu/bench-8b/config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (32, 4096)  # Llama-3.1-8B's shape
    assert len(sharegpt.read_requests(tmp_path / ".gpu/requests-10.json")) == 10
    assert json.loads((tmp_path / ".gpu/sharegpt-2000rec.json").read_text()) == prep.cut_records(records)
    assert (tmp_path / ".gpu/COMMIT").read_text().strip()
