#!/usr/bin/env bash
# One device call: GPU correctness checks, and serving throughput of the old main (its tree in
# .gpu/old) against this working tree, on the same saved ShareGPT requests. From the repo root:
#
#   bash test/benchmark/h100_serving.sh [dry] ITEM...      ("serve" and quoted lists are accepted)
#   ITEM = check | VARIANT:N[@RATE]
#   VARIANT = old | new | new-nooverlap (--disable_overlap) | new-cSIZE (--chunked_prefill_size SIZE);
#   N prompts from .gpu/requests-N.json
#   (else the first N of requests-2000.json); RATE = Poisson req/s (default: all at once)
#
# Needs (carried, git-ignored): .whl/ (the wheels the image lacks), .gpu/old (git archive of the
# old commit), .gpu/old_path/lightllm_kernels (copy of its kernels/), .gpu/bench-8b,
# .gpu/requests-{1000,2000}.json. Everything stays within BUDGET_S (570 s) of the start; logs go
# to $OUT/h100.tar.gz, the table to $OUT/summary.md and, last, to stdout. `dry` prints the commands;
# MODEL=DIR NO_WHEELS=1 BUDGET_S=... run the plumbing elsewhere (CPU: MODEL=a tiny model, N=8).
set -euo pipefail

ROOT=$(pwd)
DRY=0; [[ ${1:-} == dry ]] && { DRY=1; shift; }
OUT=${OUT:-/tmp/h100_out}; WORK=${WORK:-/tmp/h100}; MODEL=${MODEL:-$ROOT/.gpu/bench-8b}
END=$((SECONDS + ${BUDGET_S:-570}))
read -r -a ITEMS <<< "$*"
mkdir -p "$OUT" "$WORK"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
NEW_PATH=$ROOT:$ROOT/.gpu/new_path:/tmp/site
OLD_PATH=$ROOT/.gpu/old:$ROOT/.gpu/old_path:/tmp/site
ENTRIES=() CHECKS=()
trap save EXIT  # logs come back whatever happens

do_or_say() { if ((DRY)); then echo "+ $*"; else "$@"; fi; }
left() { echo $((END - SECONDS - 10)); }
save() { ((DRY)) || tar -czf "$OUT/h100.tar.gz" -C "$WORK" --exclude=requests.json --exclude=compare.png . || true; }

setup() {
  [[ -n ${NO_WHEELS:-} ]] || do_or_say python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$ROOT"/.whl/*.whl
  do_or_say rm -rf "$ROOT/.gpu/new_path"
  do_or_say mkdir -p "$ROOT/.gpu/new_path"
  do_or_say cp -r "$ROOT/kernels" "$ROOT/.gpu/new_path/lightllm_kernels"  # imported as lightllm_kernels
  ((DRY)) || { nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || true; }
}

step() {  # step NAME SECONDS CMD...: one check, time-bounded, its log in $WORK/check
  local name=$1 t=$2 rc=0; shift 2
  t=$(( t < $(left) ? t : $(left) ))
  if ((t < 20)); then CHECKS+=("$name: skipped (no time left)"); return; fi
  mkdir -p "$WORK/check"
  if ((DRY)); then echo "+ timeout -k 10 $t env PYTHONPATH=$NEW_PATH $* > $WORK/check/$name.log"; return; fi
  timeout -k 10 "$t" env PYTHONPATH="$NEW_PATH" "$@" > "$WORK/check/$name.log" 2>&1 || rc=$?
  CHECKS+=("$name: $( ((rc == 0)) && echo PASS || echo "FAIL (rc $rc)"): $(grep -v '^\s*$' "$WORK/check/$name.log" | tail -1 || true)")
  echo "${CHECKS[-1]}"; save
}

check() {
  step pytest 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_sampling.py \
    tests/test_decode_buckets.py
  step gpu_check_model 120 python3 test/benchmark/gpu_check_model.py
  step bench_kernels 90 python3 test/benchmark/bench_kernels.py --out "$WORK/check/kernels.json"
}

free_gpu() {  # wait for the last server's processes to leave the GPU; kill, by pid, any that stay
  local pids i
  for i in $(seq 30); do
    pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' || true)
    [[ -z $pids ]] && return; sleep 1
  done
  echo "GPU still held by $pids: killing them"; kill -9 $pids 2>/dev/null || true; sleep 3
}

serve() {  # serve VARIANT:N[@RATE]
  local variant=${1%%:*} rest=${1#*:} rate=inf path=$NEW_PATH tree=$ROOT extra="" rc=0
  local n=${rest%%@*}; [[ $rest == *@* ]] && rate=${rest#*@}
  case $variant in
    old) path=$OLD_PATH; tree=$ROOT/.gpu/old ;;  # cwd too: `python -m` puts it first on sys.path
    new) ;;
    new-nooverlap) extra=--disable_overlap ;;
    new-c[0-9]*) extra="--chunked_prefill_size ${variant#new-c}" ;;
    *) echo "unknown variant in $1" >&2; exit 2 ;;
  esac
  local requests=$ROOT/.gpu/requests-$n.json; [[ -f $requests ]] || requests=$ROOT/.gpu/requests-2000.json
  local name=$variant-$n; [[ $rate != inf ]] && name+=-r$rate
  local dir=$WORK/$name; mkdir -p "$dir"; ENTRIES+=("$name|$variant|$n|$rate")
  # ~60 s start (dummy weights, graph capture) + ~35 s per 1000 requests at once + arrivals, with room.
  local t; t=$(awk -v n="$n" -v r="$rate" -v l="$(left)" \
    'BEGIN { c = 110 + n * 0.06 + (r == "inf" ? 0 : n / r); printf "%d", (c < l ? c : l) }')
  if ((t < 90)); then echo "$name: skipped, $t s left" | tee "$dir/run.log"; return; fi
  local cmd=(timeout -k 15 $((t + 25)) env PYTHONPATH="$path" python3 "$ROOT/test/benchmark/gpu_compare.py"
    --model "$MODEL" --requests "$requests" --num-prompts "$n" --skip-transformers --out-dir "$dir"
    --total-timeout "$t" --bench-timeout "$t" --request-rate "$rate" "--server-args=$extra")
  echo "== $name: ${t} s at most"
  if ((DRY)); then echo "+ (cd $tree && ${cmd[*]@Q}) > $dir/run.log"; return; fi
  $(command -v stdbuf > /dev/null && echo stdbuf -oL) nvidia-smi --query-gpu=timestamp,utilization.gpu \
    --format=csv,noheader,nounits -lms 200 > "$dir/gpu.csv" 2> /dev/null &  # line-buffered: killed below
  local smi=$!
  (cd "$tree" && "${cmd[@]}") > "$dir/run.log" 2>&1 || rc=$?
  kill "$smi" 2>/dev/null || true; wait "$smi" 2>/dev/null || true
  echo "$name: rc $rc; $(grep -m1 'server healthy' "$dir/run.log" | sed 's/.*: //' || true)"
  free_gpu; save
}

table() {  # one markdown row per entry: figures from compare.json, GPU busy over the benchmark window
  python3 - "$WORK" "${ENTRIES[@]}" <<'PY'
import json, re, sys
from datetime import datetime
from pathlib import Path

def stamp(text, fmt):
    try:
        return datetime.strptime(text, fmt).timestamp()
    except ValueError:
        return None

def num(summary, key):
    value = summary.get(key)
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"

print("| variant | requests | req/s | output tok/s | median TTFT ms | median TPOT ms | P99 TPOT ms | GPU busy % |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for entry in sys.argv[2:]:
    name, variant, n, rate = entry.split("|")
    d = Path(sys.argv[1]) / name
    try:
        s = json.loads((d / "compare.json").read_text())["lightllm"]
    except (OSError, ValueError, KeyError):
        s = {}
    requests = n if rate == "inf" else f"{n} @ {rate} req/s"
    requests += f" ({s['failed']} failed)" if s.get("failed") else "" if s else " (no result: see run.log)"
    log = (d / "run.log").read_text(errors="replace") if (d / "run.log").exists() else ""
    window = []  # from the end of the warm-up to the server's stop: the measured run
    for pattern in ("warm-up: ", "stopping the server"):
        m = re.search(r"^(\S+ \S+) .*" + pattern, log, re.M)
        window.append(m and stamp(m.group(1), "%Y-%m-%d %H:%M:%S,%f"))
    busy = []
    if (d / "gpu.csv").exists() and all(window):
        for row in (d / "gpu.csv").read_text().splitlines():
            parts = [p.strip() for p in row.split(",")]
            when = stamp(parts[0], "%Y/%m/%d %H:%M:%S.%f") if len(parts) == 2 else None
            if when and window[0] <= when <= window[1] and parts[1].isdigit():
                busy.append(int(parts[1]))
    gpu = f"{sum(busy) / len(busy):.1f} ({len(busy)} samples)" if busy else "-"
    print(f"| {variant} | {requests} | {num(s, 'request_throughput')} | {num(s, 'output_throughput')} | "
          f"{num(s, 'median_ttft_ms')} | {num(s, 'median_tpot_ms')} | {num(s, 'p99_tpot_ms')} | {gpu} |")
PY
}

setup
for item in "${ITEMS[@]}"; do
  case $item in
    serve) ;;
    check) check ;;
    *:*) serve "$item" ;;
    *) echo "unknown item: $item" >&2; exit 2 ;;
  esac
done
{
  echo "new = this working tree, old = .gpu/old; $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo 'no GPU')"
  if ((${#CHECKS[@]})); then printf -- '- %s\n' "${CHECKS[@]}"; echo; fi
  if ((${#ENTRIES[@]})); then table; fi
} | tee "$OUT/summary.md"
