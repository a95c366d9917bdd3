#!/usr/bin/env bash
# The first-token tail under vLLM's client, on a lent GPU in one call: tail_trace.py once per part,
# each a fresh server (bench-8b, dummy weights, bf16, no prefix cache: the warm-up's prompts are the
# first measured ones) with --step_trace, fed the saved requests at $RATE req/s as `vllm bench serve
# --backend vllm --dataset-name sharegpt --ignore-eos --seed 0` sends them (its arrival times, its
# /v1/completions body: the server's default temperature, its TTFT).
#   cold     no request before the measured ones (vLLM's client)
#   warm     compare.py's warm-up first: the first 32 requests, 16 tokens each, greedy, together
#   greedy   cold, with temperature 0 sent
# PART@TREE runs the server of another checkout (an older commit's: `git worktree add .gpu/old COMMIT`
# before the call, carried), this tree's client; its trace places no request among the steps before d216d9d.
# Each part takes about 2 minutes on an H200 (start, 50 s of requests, stop): two fit in one call.
# Needs (carried, git-ignored): .whl/ (the wheels the image lacks), .gpu/bench-8b, .gpu/requests-1000.json.
# Results: $OUT/<part>/{tail.md,tail.json,steps.jsonl,server.log} and $OUT/<part>.log (the part's name with
# any character other than letters, digits, _ . - as _); the reports at the end.
#   bash test/benchmark/serving/tail_device.sh cold warm
# Elsewhere (the CPU, scaled down): MODEL, REQUESTS, SERVER_ARGS, N, RATE, PYTHON, NO_WHEELS=1.
set -u
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/tail_out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
[[ -n ${NO_WHEELS:-} ]] || "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$ROOT:$ROOT/test:/tmp/site HF_HUB_OFFLINE=1
PARTS=("$@")
((${#PARTS[@]})) || PARTS=(cold warm)
TAIL=("$PYTHON" test/benchmark/serving/tail_trace.py --model "${MODEL:-.gpu/bench-8b}"
  --requests "${REQUESTS:-.gpu/requests-1000.json}" --num-prompts "${N:-1000}" --rate "${RATE:-20}"
  --server-args "${SERVER_ARGS:---load_format dummy --data_type bfloat16 --disable_prefix_cache}"
  --start-timeout 100 --timeout 80)
name() { echo "${1//[^A-Za-z0-9_.-]/_}"; }
for part in "${PARTS[@]}"; do
  kind=${part%%@*} tree=()
  [[ $part == *@* ]] && tree=(--server-tree "${part#*@}")
  case $kind in
    cold) extra=(--warmup 0) ;;
    warm) extra=(--warmup 32) ;;
    greedy) extra=(--warmup 0 --temperature 0) ;;
    *) echo "unknown part $part"; continue ;;
  esac
  dir=$OUT/$(name "$part")
  timeout -k 10 170 "${TAIL[@]}" "${extra[@]}" "${tree[@]}" --label "$part" --out-dir "$dir" > "$dir.log" 2>&1
  echo "== $part: rc $? at $SECONDS s"
done
for part in "${PARTS[@]}"; do
  dir=$OUT/$(name "$part")
  if [[ -f $dir/tail.md ]]; then cat "$dir/tail.md"; echo; else tail -20 "$dir.log"; fi
done
