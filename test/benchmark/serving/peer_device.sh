#!/usr/bin/env bash
# One device call: the same saved ShareGPT requests against this server and against vLLM (its kit
# installed to /tmp/vsite by ../shared/peers/vllm_device.sh), one fresh server per row, with this
# project's client (benchmark_serving.py --api completions: streamed /v1/completions, ignore_eos).
#
#   bash test/benchmark/serving/peer_device.sh ITEM...
#   ITEM = SERVER:MODEL[:N[@RATE]]
#   SERVER = ours | ours+--flag,value,... (extra server flags, commas for spaces) | vllm | vllm+--flag,value,...
#   MODEL = a model directory under .gpu/ (a bench_model preset, dummy weights), N = requests
#   (default 1000, from .gpu/requests-1000.json, else the first N of requests-2000.json), RATE =
#   Poisson req/s (default: all at once).
#
# Each row: start the server (vLLM: bf16, dummy weights, --max-model-len $VLLM_MAX_LEN (8192); ours:
# bf16, dummy weights), wait until /health answers, send the requests, stop the server and wait
# until its GPU memory is free. Everything stays within TOTAL_S (570 s) of the start; a row with
# less time left than MIN_ROW_S (150; vLLM's MIN_VLLM_ROW_S, 330) is skipped. Logs and result JSONs
# in $OUT/ITEM-NAME/, the table in $OUT/peers.md and on stdout (CPU plumbing check: NO_WHEELS=1 and
# a tiny model). Needs (carried): .whl/ (the wheels the image lacks), .gpu/MODEL, .gpu/requests-*.json.
# VLLM_WHEELS=DIR: wheels installed into /tmp/vsite first, ahead of the image's for vLLM's rows. For
# Gemma 4: from transformers 5.14 a Gemma 4 config's head_dim is a per-layer attribute that raises
# when read whole, as vLLM 0.26 reads it; the image has 5.17, so carry transformers 5.13.0 and the
# tokenizers it takes (0.22.2), which vLLM 0.26's requirements also admit.
# CLIENT_ARGS: more benchmark_serving.py flags for every row, e.g. "--warmup 64": 64 short requests
# that share no prefix with the measured ones, sent to each fresh server first, so that neither
# server's first-use compiles (vLLM's MXFP4 routing kernels, JIT-compiled in a gpt-oss burst's first
# seconds) fall in the measured burst.
set -uo pipefail

ROOT=$(pwd)
OUT=${OUT:-/tmp/peer_device_out}; mkdir -p "$OUT"
END=$((SECONDS + ${TOTAL_S:-570}))
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[[ -n ${NO_WHEELS:-} ]] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$ROOT"/.whl/*.whl || exit 1
if [[ -n ${VLLM_WHEELS:-} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vsite \
    "$VLLM_WHEELS"/*.whl || exit 1
fi
COMMIT=$(cat "$ROOT/.gpu/COMMIT" 2>/dev/null || git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
SERVER=
ROWS=()

. "$ROOT/test/benchmark/lib/gpu_lib.sh"  # healthy, wait_healthy, stop_server (DRY=0)
DRY=0
trap 'stop_server' EXIT

gpu_free() {  # until no process holds GPU memory (at most 60 s)
  command -v nvidia-smi > /dev/null || return 0
  local i; for i in $(seq 60); do
    [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null) ]] && return; sleep 1
  done
}

requests_file() { local f=$ROOT/.gpu/requests-$1.json; [[ -f $f ]] && echo "$f" || echo "$ROOT/.gpu/requests-2000.json"; }

row() {  # row ITEM
  local item=$1 server=${1%%:*} rest=${1#*:} model n rate=inf
  model=${rest%%:*}; n=${rest#"$model"}; n=${n#:}; n=${n:-1000}
  [[ $n == *@* ]] && { rate=${n#*@}; n=${n%@*}; }
  local kind=${server%%+*} extra=; [[ $server == *+* ]] && extra=${server#*+}; extra=${extra//,/ }
  local dir=$OUT/${item//[:\/@+,]/_}; mkdir -p "$dir"
  local need=${MIN_ROW_S:-150}; [[ $kind == vllm ]] && need=${MIN_VLLM_ROW_S:-330}
  if (($(left) < need)); then echo "$item: skipped, $(left) s left"; ROWS+=("| $server | $model | $n@$rate | skipped | | | | | |"); return; fi
  local port=$((20000 + RANDOM % 20000)) t0=$SECONDS
  if [[ $kind == vllm ]]; then
    (cd /tmp && exec env PYTHONPATH=/tmp/vsite setsid python3 -m vllm.entrypoints.openai.api_server \
      --model "$ROOT/.gpu/$model" --served-model-name "$model" --load-format dummy --dtype bfloat16 \
      --max-model-len "${VLLM_MAX_LEN:-8192}" --host 127.0.0.1 --port "$port" $extra) > "$dir/server.log" 2>&1 &
  else
    (cd "$ROOT" && exec env PYTHONPATH="$ROOT:/tmp/site" LIGHTLLM_COMMIT="$COMMIT" setsid python3 -m lightllm.server.api_server \
      --model_dir "$ROOT/.gpu/$model" --tp 1 --host 127.0.0.1 --port "$port" --load_format dummy \
      --data_type bfloat16 $extra) > "$dir/server.log" 2>&1 &
  fi
  SERVER=$!
  if ! wait_healthy "$port" $((END - 60)) "$dir/server.log"; then
    tail -5 "$dir/server.log" | cut -c1-300
    ROWS+=("| $server | $model | $n@$rate | not healthy after $((SECONDS - t0)) s | | | | | |"); gpu_free; return
  fi
  local start_s=$((SECONDS - t0)) t=$(($(left) - 45))
  echo "$item: healthy in $start_s s, $t s for the run"
  timeout -k 10 $((t + 20)) env PYTHONPATH="$ROOT:$ROOT/test:/tmp/site" python3 \
    "$ROOT/test/benchmark/serving/benchmark_serving.py" --base-url "http://127.0.0.1:$port" \
    --model "$ROOT/.gpu/$model" --requests "$(requests_file "$n")" --num-prompts "$n" --seed 0 --api completions \
    --request-rate "$rate" --timeout "$t" --no-progress --result-json "$dir/result.json" ${CLIENT_ARGS:-} \
    > "$dir/client.log" 2>&1
  echo "$item: client rc $?"
  stop_server; gpu_free
  ROWS+=("$(python3 - "$dir/result.json" "$server" "$model" "$n@$rate" "$start_s" <<'PY'
import json, sys
path, server, model, load, start = sys.argv[1:]
try:
    r = json.load(open(path))
except (OSError, ValueError):
    print(f"| {server} | {model} | {load} | no result | | | | | |"); raise SystemExit
g = lambda k: r.get(k) or 0.0
print(f"| {server} | {model} | {load} | {g('request_throughput'):.2f} | {g('output_throughput'):.0f} | "
      f"{g('median_ttft_ms'):.0f} / {g('p99_ttft_ms'):.0f} | {g('median_tpot_ms'):.2f} / {g('p99_tpot_ms'):.2f} | "
      f"{r.get('failed', 0)} | {start} |")
PY
)")
}

for item in "$@"; do row "$item"; done
{
  echo "commit $COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo CPU), $(date -u +%F)"
  echo
  echo "| server | model | requests@rate | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed | start s |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  printf '%s\n' "${ROWS[@]}"
} | tee "$OUT/peers.md"
