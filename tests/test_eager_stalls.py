"""test/benchmark/engine/eager_stalls.py runs end to end on the CPU (tiny model, every mode in a
process of its own) and reads the step trace as it says: a pass's steps only, a launch held beyond
its CPU time counted as a stall, the device's idle time between steps."""

import json
import re

from benchmark.engine import eager_stalls


def test_eager_stalls_reports_each_mode_and_pass(tmp_path):
    out = tmp_path / "stalls.md"
    assert eager_stalls.main(["--device", "cpu", "--dtype", "float32", "--chunk", "64", "--prompts", "4",
                              "--decodes", "6", "--steps", "3", "--ladder", "3", "--out-md", str(out)]) == 0
    rows = re.findall(r"^\| (lazy|eager|lazy-ladder) \| [\d.]+ \| (\d) \| [\d.]+ \| ([\d.]+) \|", out.read_text(), re.M)
    assert [(mode, int(p)) for mode, p, _ in rows] == [(m, p) for m in ("lazy", "eager", "lazy-ladder") for p in (1, 2)]
    assert all(float(device) > 0 for _, _, device in rows)


def test_a_pass_counts_its_own_steps_and_the_held_launches(tmp_path):
    trace = tmp_path / "steps.jsonl"

    def step(i, start, end, launch, cpu, chunk=64):
        return {"step": i, "chunk_tokens": chunk, "start_ms": start, "end_ms": end, "launch_ms": launch,
                "launch_cpu_ms": cpu}
    records = [step(5, 0, 10, 3, 3, chunk=0),  # a prefill of the decodes: not a pass's (no id in range)
               step(11, 20, 30, 5, 4), step(12, 30, 40, 50, 5), step(13, 70, 80, 6, 5),  # pass 1 (ids 10..19)
               step(21, 100, 110, 4, 4), step(22, 110, 120, 4, 4)]  # pass 2 (ids 20..)
    trace.write_text("\n".join(map(json.dumps, records)) + "\n")
    first, second = eager_stalls.summarise(trace, [(10, 1.0), (20, 2.0)], stall_ms=20)
    assert (first["steps"], first["stalls"], first["held_ms"], first["idle_ms"]) == (3, 1, 45, 30)
    assert (second["steps"], second["stalls"], second["idle_ms"], second["wall_s"]) == (2, 0, 0, 2.0)
    assert first["launch_ms"] == 6 and first["device_ms"] == 10
