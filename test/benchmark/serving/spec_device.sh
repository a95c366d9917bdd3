#!/usr/bin/env bash
# Speculative decoding on a lent GPU, in one call: spec_sweep.py's parts, each a word.
#   controlled:LOADS:ALPHAS  the controlled draft (bench-8b, dummy_echo weights) against off; off's
#                            outputs are taken from .gpu/spec when it holds them (--off-from), else run
#   methods:LOADS:METHODS    ngram/suffix against off on ShareGPT (bench-8b, dummy weights)
#   trace:LOAD:ALPHA         one controlled setting with --step_trace, the trace summarised
#   mtrace:LOAD:METHOD       one ngram or suffix setting on ShareGPT (as methods), off's and its step traces summarised
#   draft:LOADS:FORMATS      draft_model (bench-1b drafting for bench-8b, written here) against off on
#                            ShareGPT, per load format: dummy_echo (every draft accepted), dummy (none)
#   eagle3:LOADS:FORMATS     an EAGLE-3 head of bench-8b's layer shape over its whole vocabulary (its
#                            config written here) against off, per load format as draft
# Needs (carried, git-ignored): .whl/ (the wheels the image lacks), .gpu/bench-8b, .gpu/requests-1000.json.
# Results: $OUT/<part>.md and .json, the guard's verdicts in $OUT/verdicts-N.log; a part's failure does not
# stop the others.
# TOTAL_S: the seconds a controlled or methods part may take (default 520).
#   bash test/benchmark/serving/spec_device.sh controlled:batch1@12,conc64@128:0,0.8 methods:conc64@128:ngram,suffix
set -u
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/spec_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$ROOT:$ROOT/test:/tmp/site HF_HUB_OFFLINE=1
# the commit measured, written here before the call (`git rev-parse --short HEAD > .gpu/COMMIT`)
[[ -f .gpu/COMMIT ]] && export LIGHTLLM_COMMIT=$(cat .gpu/COMMIT)
# SWEEP_ARGS: more spec_sweep.py flags for every part (e.g. --warmup-requests 64)
SWEEP=(python3 test/benchmark/serving/spec_sweep.py --model .gpu/bench-8b --output-len 256 --num-prompts 128 ${SWEEP_ARGS:-})
summarize_trace() {  # summarize_trace STEPS.jsonl NAME: step_trace.py's report and the steps by kind, in $OUT
  python3 test/benchmark/engine/step_trace.py "$1" > "$OUT/$2.txt" 2>&1
  gzip -c "$1" > "$OUT/steps-$2.jsonl.gz"
  python3 - "$1" >> "$OUT/$2.txt" <<'PY'
import json, sys, statistics
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for row, after in zip(rows, rows[1:]):
    row["device"], row["period"] = row["end_ms"] - row["start_ms"], after["start_ms"] - row["start_ms"]
    if row.get("sync") and "returned_ms" in row and "received_ms" in after:  # the host's turnaround after it
        row["back"], row["router"] = row["returned_ms"] - row["end_ms"], after["received_ms"] - row["returned_ms"]
        row["to_launch"] = after["launched_ms"] - after["launch_ms"] - after["received_ms"]
        row["next_launch"] = after["launch_ms"]
        if "forwarded_ms" in after:
            row["to_forward"] = after["forwarded_ms"] - after["received_ms"]
def size(r):
    d = r.get("decodes", 0)
    return "prefill" if r.get("chunk_tokens") else ("1" if d <= 1 else "2-31" if d < 32 else "32+")
groups = {}
for r in rows[:-1]:
    groups.setdefault((size(r), bool(r.get("drafts"))), []).append(r)
span = rows[-1]["end_ms"] - rows[0]["start_ms"]
busy = sum(r["end_ms"] - r["start_ms"] for r in rows)
print(f"{len(rows)} steps over {span:.0f} ms, the device busy {busy / span:.1%}")
print("| decodes | drafts | steps | decodes | drafts | accepted | device ms | start to start ms | launch ms | sync | "
      "after a collection | ms of the run | then: result back ms | router ms | to the launch ms | next launch ms | "
      "plan to forward ms |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
def part(steps, key):  # a mean over the steps that have it (traces since 2026-12-06)
    values = [r[key] for r in steps if key in r]
    return f"{statistics.mean(values):.2f}" if values else "-"
for (kind, drafted), steps in sorted(groups.items()):
    mean = lambda key: statistics.mean(float(r.get(key, 0)) for r in steps)
    print(f"| {kind} | {drafted} | {len(steps)} | {mean('decodes'):.1f} | {mean('drafts'):.1f} | "
          f"{mean('accepted'):.1f} | {mean('device'):.2f} | {mean('period'):.2f} | {mean('launch_ms'):.2f} | "
          f"{mean('sync'):.0%} | {mean('collected'):.0%} | {sum(r['period'] for r in steps):.0f} | "
          + " | ".join(part(steps, key) for key in ("back", "router", "to_launch", "next_launch", "to_forward")) + " |")
# the router's part of the turnaround after a step with drafts, from the engine's lines (PATH.host)
origin = rows[0].get("origin_perf_s")
try:
    host = [json.loads(line) for line in open(sys.argv[1] + ".host") if line.strip()]
except OSError:
    host = []
by_step = {h["step"]: h for h in host if "step" in h}
nexts = {a["step"]: b for a, b in zip(host, host[1:]) if "step" in a}
parts = {"result across": [], "processing": [], "turn's end": [], "loop to the next step": [], "collecting": [],
         "planning": [], "plan across": []}
for row, after in zip(rows, rows[1:]):
    h, n = by_step.get(row["step"]), nexts.get(row["step"])
    if origin is None or not row.get("drafts") or not row.get("sync") or h is None or n is None or "sent" not in h:
        continue
    ms = lambda t: (t - origin) * 1000
    for name, value in (("result across", ms(h["called"]) - row["returned_ms"]),
                        ("processing", ms(h["processed"]) - ms(h["called"])),
                        ("turn's end", ms(h["sent"]) - ms(h["processed"])),
                        ("loop to the next step", ms(n["start"]) - ms(h["sent"])),
                        ("collecting", ms(n["collected"]) - ms(n["start"])),
                        ("planning", ms(n["planned"]) - ms(n["collected"])),
                        ("plan across", after.get("received_ms", ms(n["planned"])) - ms(n["planned"]))):
        parts[name].append(value)
if parts["processing"]:
    print(f"\nThe router's part after {len(parts['processing'])} steps with drafts, mean ms: "
          + ", ".join(f"{name} {statistics.mean(v):.3f}" for name, v in parts.items()))
PY
}
n=0
mark=$(mktemp)
for part in "$@"; do
  IFS=: read -r kind loads what <<<"$part"
  n=$((n + 1))
  touch "$mark"
  case $kind in
    controlled)
      off=(--requests .gpu/requests-1000.json --out-dir .gpu/spec)
      [[ -f .gpu/spec/oracle.jsonl ]] && off=(--off-from .gpu/spec --out-dir ".gpu/spec-$n")
      "${SWEEP[@]}" --server-args "--load_format dummy_echo --data_type bfloat16" "${off[@]}" --loads "$loads" \
        --alphas "$what" --out-md "$OUT/controlled-$n.md" --out-json "$OUT/controlled-$n.json" --total-timeout "${TOTAL_S:-520}" ;;
    methods)
      "${SWEEP[@]}" --server-args "--load_format dummy --data_type bfloat16" --requests .gpu/requests-1000.json \
        --out-dir ".gpu/methods-$n" --loads "$loads" --alphas "" --methods "$what" \
        --out-md "$OUT/methods-$n.md" --out-json "$OUT/methods-$n.json" --total-timeout "${TOTAL_S:-520}" ;;
    draft)
      [[ -d .gpu/bench-1b ]] || python3 -m lightllm.tools.bench_model --preset 1b --out .gpu/bench-1b \
        --tokenizer .gpu/bench-8b > /dev/null
      for format in ${what//,/ }; do
        "${SWEEP[@]}" --server-args "--load_format $format --data_type bfloat16" --requests .gpu/requests-1000.json \
          --out-dir ".gpu/draft-$n-$format" --loads "$loads" --alphas "" --methods draft_model \
          --draft-model .gpu/bench-1b --out-md "$OUT/draft-$n-$format.md" --out-json "$OUT/draft-$n-$format.json" \
          --total-timeout "${TOTAL_S:-520}"
      done ;;
    eagle3)
      python3 - .gpu/bench-8b .gpu/bench-8b-eagle3 <<'PY'
import json, pathlib, sys
config = json.loads((pathlib.Path(sys.argv[1]) / "config.json").read_text())
config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=config["vocab_size"],
              target_hidden_size=config["hidden_size"])
out = pathlib.Path(sys.argv[2]); out.mkdir(exist_ok=True); (out / "config.json").write_text(json.dumps(config))
PY
      for format in ${what//,/ }; do
        "${SWEEP[@]}" --server-args "--load_format $format --data_type bfloat16" --requests .gpu/requests-1000.json \
          --out-dir ".gpu/eagle3-$n-$format" --loads "$loads" --alphas "" --methods eagle3 \
          --draft-model .gpu/bench-8b-eagle3 --out-md "$OUT/eagle3-$n-$format.md" --out-json "$OUT/eagle3-$n-$format.json" \
          --total-timeout "${TOTAL_S:-520}"
      done ;;
    trace)
      "${SWEEP[@]}" --server-args "--load_format dummy_echo --data_type bfloat16 --step_trace /tmp/steps-$n.jsonl" \
        --off-from .gpu/spec --out-dir ".gpu/trace-$n" --loads "$loads" --alphas "$what" \
        --out-md "$OUT/trace-$n.md" --total-timeout "${TOTAL_S:-300}"
      summarize_trace "/tmp/steps-$n.jsonl" "trace-$n" ;;
    mtrace)
      "${SWEEP[@]}" --server-args "--load_format dummy --data_type bfloat16 --step_trace /tmp/steps-$n-{setting}.jsonl" \
        --requests .gpu/requests-1000.json --out-dir ".gpu/mtrace-$n" --loads "$loads" --alphas "" \
        --methods "$what" --out-md "$OUT/mtrace-$n.md" --total-timeout "${TOTAL_S:-300}"
      for steps in /tmp/steps-$n-*.jsonl; do
        name=${steps#/tmp/steps-}
        summarize_trace "$steps" "mtrace-${name%.jsonl}"
      done ;;
    *) echo "unknown part $part" ;;
  esac
  # the run-level guard's verdicts in this part's servers (docs/architecture.md, "The run-level guard")
  find .gpu -name 'server-*.log' -newer "$mark" -exec grep -H "spec.controller" {} + \
    > "$OUT/verdicts-$n.log" 2>/dev/null
  echo "== $part done at $SECONDS s"
done
cat "$OUT"/*.md 2>/dev/null
