#!/usr/bin/env bash
# LoRA serving on a lent GPU in one call: bench-8b with COUNT random rank-RANK adapters against the
# base model alone, on the same saved ShareGPT requests. From the repo root:
#
#   bash test/benchmark/serving/lora_device.sh [COUNT [RANK [N]]]      (defaults 16, 16, 1000)
#
# Rows: a server without adapters, N requests at once (streamed, ignore_eos); a server with the
# adapters (--lora_modules, --max_loras COUNT: all resident), the same N requests with request i
# naming adapter i mod (COUNT + 1), the last share on the base model; one request at a time
# (single_request.py, 256 tokens) on each, with and without an adapter. Before each burst the
# server answers single_request.py, so the burst does not pay the kernels' first compiles.
# BURSTS=0: the one-at-a-time rows alone (about half the call's time). SINGLES=0: the bursts alone
# (each server answers one short request first instead, the same warm-up of its first compiles).
# PEER=vllm: the same two bursts on vLLM instead (installed in /tmp/vsite by ../shared/peers'
# vllm_device.sh; its defaults, --enable-lora --lora-modules NAME=DIR ... --max-loras COUNT
# --max-lora-rank RANK for the second), through /v1/completions with each request's adapter as
# its `model`; vLLM serves no /generate_stream, so no one-at-a-time rows.
# Needs (carried, git-ignored): .whl/ (the wheels the image lacks), .gpu/bench-8b,
# .gpu/requests-N.json. Results: $OUT/lora.md (the table), $OUT/*.json (benchmark_serving's).
# TRACE=1: each server with --step_trace; $OUT/traces.md has test/benchmark/engine/step_trace.py's
# summary of each burst's steps, $OUT/work.tar.gz the traces and the servers' logs (no
# one-at-a-time rows).
set -euo pipefail
ROOT=$(pwd); DRY=0; SERVER=; END=$((SECONDS + ${BUDGET_S:-570}))
source "$ROOT/test/benchmark/lib/gpu_lib.sh"
OUT=${OUT:-/tmp/lora_out}; WORK=${WORK:-/tmp/lora_work}; MODEL=${MODEL:-$ROOT/.gpu/bench-8b}
COUNT=${1:-16}; RANK=${2:-16}; N=${3:-1000}
rm -rf "$WORK"; mkdir -p "$OUT" "$WORK"
install_kit
export PYTHONPATH=$ROOT:$ROOT/test:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m lightllm.tools.bench_lora --model "$MODEL" --out "$WORK/loras" --count "$COUNT" --rank "$RANK" \
  > "$WORK/flags.txt"
read -r -a modules <<<"$(sed -n 's/^--lora_modules //p' "$WORK/flags.txt")"
adapters=$(sed -n 's/^--lora-adapters //p' "$WORK/flags.txt")

serve() {  # serve NAME SERVER-FLAGS...: a server in a session of its own, once /health answers
  local name=$1; shift
  setsid python3 -m lightllm.server.api_server --model_dir "$MODEL" --load_format dummy --port 8000 "$@" \
    ${TRACE:+--step_trace "$WORK/steps-$name.jsonl"} > "$WORK/$name-server.log" 2>&1 &
  SERVER=$!
  wait_healthy 8000 $((SECONDS + 300)) "$WORK/$name-server.log"
}
single() {  # single NAME [--adapter A]: one request at a time, 256 tokens, 5 times
  local name=$1; shift
  [[ -z ${TRACE:-} ]] || return 0  # a traced call's servers run the bursts alone
  if [[ ${SINGLES:-1} == 0 ]]; then
    timeout 60 python3 test/benchmark/serving/single_request.py --max-new-tokens 16 --repeat 1 "$@" > /dev/null 2>&1 \
      || echo "warm-up $name failed"
    return 0
  fi
  timeout 120 python3 test/benchmark/serving/single_request.py --max-new-tokens 256 "$@" > "$OUT/single-$name.md" 2>&1 \
    || echo "single $name failed"
}
burst() {  # burst NAME [CLIENT-FLAGS...]: the N saved requests at once (none with BURSTS=0)
  local name=$1; shift
  [[ ${BURSTS:-1} != 0 ]] || return 0
  timeout $(($(left) > 60 ? $(left) : 60)) python3 test/benchmark/serving/benchmark_serving.py --model "$MODEL" \
    --requests "$ROOT/.gpu/requests-$N.json" --num-prompts "$N" --stream --no-progress \
    --result-json "$OUT/burst-$name.json" "$@" > "$WORK/burst-$name.log" 2>&1 || echo "burst $name failed"
}

serve_vllm() {  # serve_vllm NAME VLLM-FLAGS...: vLLM on port 8000, once /health answers
  local name=$1; shift
  (cd /tmp && exec env PYTHONPATH=/tmp/vsite setsid python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --load-format dummy --dtype bfloat16 --max-model-len 8192 --host 127.0.0.1 --port 8000 "$@") \
    > "$WORK/$name-server.log" 2>&1 &
  SERVER=$!
  wait_healthy 8000 $((SECONDS + 420)) "$WORK/$name-server.log"
}

if [[ ${PEER:-} == vllm ]]; then
  serve_vllm vllm-base
  burst vllm-base --api completions
  stop_server
  serve_vllm vllm-lora --enable-lora --lora-modules "${modules[@]}" --max-loras "$COUNT" --max-lora-rank "$RANK"
  burst vllm-lora --api completions --lora-adapters "$adapters"
  stop_server
else
  serve base
  single base
  burst base
  stop_server
  serve lora --lora_modules "${modules[@]}" --max_loras "$COUNT" --max_lora_rank "$RANK"
  single lora-0 --adapter lora-0
  single lora-server-base  # before the burst, as the base server's
  burst lora --lora-adapters "$adapters"
  stop_server
fi

python3 - "$OUT" "$COUNT" "$RANK" "$N" > "$OUT/lora.md" <<'PY'
import json, re, sys
from pathlib import Path
out, count, rank, n = Path(sys.argv[1]), *sys.argv[2:]
def burst(name):
    path = out / f"burst-{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}
def tpot(name):
    path = out / f"single-{name}.md"
    rows = re.findall(r"\| median \| [\d.]+ \| ([\d.]+) \|", path.read_text()) if path.exists() else []
    return float(rows[0]) if rows else None
print(f"{count} adapters of rank {rank}, {n} requests at once (request i: adapter i mod {int(count) + 1})\n")
print("| server | req/s | output tok/s | median / P99 TTFT ms | median / P99 TPOT ms | failed |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
ratios = []
for server, prefix in (("ours", ""), ("vLLM", "vllm-")):
    base, lora = burst(prefix + "base"), burst(prefix + "lora")
    for name, row in (("base model only", base), ("with the adapters", lora)):
        if row:
            print(f"| {server}, {name} | {row['request_throughput']:.2f} | {row['output_throughput']:.0f} | "
                  f"{row.get('median_ttft_ms', 0):.0f} / {row.get('p99_ttft_ms', 0):.0f} | "
                  f"{row.get('median_tpot_ms', 0):.2f} / {row.get('p99_tpot_ms', 0):.2f} | {row['failed']} |")
    if base and lora:
        ratios.append(f"{server}: throughput with the adapters / base only: "
                      f"{lora['request_throughput'] / base['request_throughput']:.3f}x")
print("\n" + "\n".join(ratios))
one = {name: tpot(name) for name in ("base", "lora-0", "lora-server-base")}
if any(one.values()):
    print(f"\none request at a time, median TPOT ms: base server {one['base']}, adapter lora-0 {one['lora-0']}, "
          f"LoRA server without an adapter {one['lora-server-base']}")
if one["base"] and one["lora-0"]:
    print(f"TPOT with an adapter / base server: {one['lora-0'] / one['base']:.3f}x")
PY
cat "$OUT/lora.md"
if [[ -n ${TRACE:-} ]]; then
  for name in base lora; do
    echo "### $name"; python3 test/benchmark/engine/step_trace.py "$WORK/steps-$name.jsonl" --floor "$MODEL" || true
  done > "$OUT/traces.md" 2>&1
  tar -C "$WORK" -czf "$OUT/work.tar.gz" --exclude loras . || true
fi
