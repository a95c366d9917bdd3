#!/usr/bin/env bash
# The host tier's multi-turn goal on a lent GPU, in one call: multi_turn_tiers.py at 4x the KV
# budget of bench-8b, the device cache alone and with a 24 GiB host tier, each server with a step
# trace, within SECONDS; then the CUDA path of the pool (tests/gpu/test_gpu_host_kv_cache.py, 90 s at most).
# Needs (carried, git-ignored): .whl/ (the wheels the image lacks), .gpu/bench-8b.
# Results under $OUT: tiers.md and .json, the run's log, the servers' logs, each variant's step
# trace and its summary (with the host time of the plans' ops: offloads and loads).
#   bash test/benchmark/serving/tiers_device.sh [SECONDS for the benchmark, default 240]
set -u
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/tiers_out}
TOTAL=${1:-240}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$ROOT:$ROOT/test:/tmp/site HF_HUB_OFFLINE=1
[[ -f .gpu/COMMIT ]] && export LIGHTLLM_COMMIT=$(cat .gpu/COMMIT)
python3 test/benchmark/serving/multi_turn_tiers.py --model .gpu/bench-8b --synthetic --budget 32768 --working-sets 4 \
  --variants gpu,host --turns 12 --turn-len 64 --output-len 32 --think 2.0 --host-kv-gb 24 \
  --server-args "--load_format dummy --data_type bfloat16 --step_trace $OUT/steps-{variant}.jsonl" \
  --total-timeout "$TOTAL" --log-dir "$OUT/logs" --out-md "$OUT/tiers.md" --out-json "$OUT/tiers.json" \
  > "$OUT/tiers.log" 2>&1
echo "== multi_turn_tiers.py: rc $? at $SECONDS s"
grep -v '"POST \|"GET ' "$OUT/tiers.log" | cut -c1-400 | tail -25
grep -h "KV pool\|profile step\|router ready" "$OUT"/logs/*.log | cut -c1-300
for variant in gpu host; do
  trace="$OUT/steps-$variant.jsonl"
  [[ -f $trace ]] || continue
  python3 test/benchmark/engine/step_trace.py "$trace" > "$OUT/steps-$variant.txt" 2>&1
  python3 - "$trace" "$variant" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
ops = [r for r in rows if r.get("ops")]
busy = sum(r["end_ms"] - r["start_ms"] for r in rows) / 1000
span = (rows[-1]["end_ms"] - rows[0]["start_ms"]) / 1000 if rows else 0
print(f"{sys.argv[2]}: {len(rows)} steps over {span:.1f} s, device busy {busy:.1f} s; {len(ops)} with ops: "
      f"{statistics.mean(r['ops'] for r in ops) if ops else 0:.1f} ops, ops_ms mean "
      f"{statistics.mean(r['ops_ms'] for r in ops) if ops else 0:.2f} max {max((r['ops_ms'] for r in ops), default=0):.1f}, "
      f"{sum(r['ops_ms'] for r in ops) / 1000:.1f} s in all; launch_ms mean {statistics.mean(r['launch_ms'] for r in rows):.2f}")
PY
  head -12 "$OUT/steps-$variant.txt"
done
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_host_kv_cache.py > "$OUT/gpu-test.txt" 2>&1
echo "== tests/gpu/test_gpu_host_kv_cache.py: rc $? at $SECONDS s"; tail -2 "$OUT/gpu-test.txt"
cat "$OUT/tiers.md" 2>/dev/null
