#!/usr/bin/env bash
# One device call: GPU correctness checks, and serving throughput of the old main (its tree in
# .gpu/old) against this working tree, on the same saved ShareGPT requests. From the repo root:
#
#   bash test/benchmark/serving/device_serving.sh [dry] ITEM...      ("serve" and quoted lists are accepted)
#   ITEM = check | model | api | profile | moe | fp8gemm | single[:VARIANT] | VARIANT:N[@RATE] | VARIANT/WORKLOAD[,WORKLOAD...]
#   profile: test/benchmark/engine/profile_step.py on MODEL (decode steps at batch 1 and 256 kernel by
#   kernel against their floor, eager steps' host time), its tables in $OUT/profile.md.
#   model: tests/gpu/test_gpu_model.py and test_gpu_graphs.py alone ($GPU_CHECK_ARGS: pytest flags,
#   e.g. -k mixtral; check runs them too).
#   moe: test/benchmark/kernels/moe_bench.py $MOE_ARGS (the fused MoE layer against its floors), its table in $OUT/moe.md.
#   fp8gemm: test/benchmark/kernels/fp8_gemm_bench.py $FP8_ARGS (bf16 against fp8 projection GEMMs), its table in $OUT/fp8_gemm.md.
#   single[:VARIANT]: the new server (or VARIANT's; with --step_trace), test/benchmark/serving/single_request.py (256 tokens, 5 requests one by one).
#   VARIANT new-trace: new with --step_trace $WORK/steps.jsonl (summarise: test/benchmark/engine/step_trace.py).
#   sweep:VARIANT: one server of VARIANT (prefix cache off), test/benchmark/serving/rate_sweep.py over the Poisson
#   rates $SWEEP_RATES (5,10,20,30,40) with the first $SWEEP_N (500) saved requests; $OUT/sweep-VARIANT.{json,png}.
#   api: tests/gpu/test_gpu_api.py: a new server on MODEL, its API checked (logprobs, n, seed,
#   logit_bias, min_tokens, stop_token_ids, echo, /generate details, /metrics), one line per test.
#   VARIANT = old | old+--flag,value,... | base (.gpu/base: a git archive of HEAD) | new
#           | new-nooverlap (--disable_overlap) | new-nocache (--disable_prefix_cache)
#           | new-cSIZE (--chunked_prefill_size SIZE) | new-fp8 (--quantization fp8) | new-fp8-trace | new-fp8-cSIZE
#           | new-fp8-awSTEPS (--admission_wait_steps STEPS) | new-kv8, new-fp8-kv8 (--kv_cache_dtype fp8_e4m3)
#           | new-fcfs, new-fcfs-cSIZE (--schedule_policy fcfs) | new-eager (--disable_cuda_graph)
#           | new+--flag,value,... (any server flags, commas for spaces);
#   VARIANT:N[@RATE]: test/benchmark/serving/compare.py, that one server variant on N prompts from .gpu/requests-N.json
#   (else the first N of requests-2000.json); RATE = Poisson req/s (default: all at once);
#   CLIENT_PROCS client processes (default 1; more where one client process would be what is measured).
#   VARIANT/WORKLOADS: one server, test/benchmark/serving/benchmark_serving.py once per workload in turn (all at once,
#   streamed, hit rate from /metrics), after a warm-up of unrelated text and before a greedy probe
#   whose tokens the table compares between servers (cache on against off);
#   WORKLOAD = sharegpt-N (the saved requests, as above) | shared-prefix (32 groups x 32,
#   1024-token prefix, 128-token questions) | multi-turn (32 conversations x 4 turns of 128
#   tokens); both 256 output tokens, their text from .gpu/sharegpt-2000rec.json.
#
# Needs (carried, git-ignored): .whl/ (the wheels the image lacks), .gpu/old (git archive of the
# old commit; its PYTHONPATH comes from gpu_lib.sh's tree_path), .gpu/bench-8b,
# .gpu/requests-{1000,2000}.json, .gpu/sharegpt-2000rec.json (the first 2000 ShareGPT records,
# messages cut to the workloads' 4000 characters). Everything stays within BUDGET_S (570 s) of
# the start; logs go to $OUT/device_serving.tar.gz (from $WORK, default /tmp/device_serving, emptied first; a repeated
# item's folder is NAME-2, NAME-3, ...), the table to $OUT/summary.md and, last, to stdout.
# SERVER_ARGS="--flag value ..." go to every server of the call, after its variant's flags.
# `dry` prints the commands; MODEL=DIR NO_WHEELS=1 BUDGET_S=... run the plumbing elsewhere
# (CPU: MODEL=a tiny model, N=8; SHARED_PREFIX/MULTI_TURN=benchmark_serving flags shrink those).
set -euo pipefail

ROOT=$(pwd)
DRY=0; [[ ${1:-} == dry ]] && { DRY=1; shift; }
OUT=${OUT:-/tmp/device_serving_out}; WORK=${WORK:-/tmp/device_serving}; MODEL=${MODEL:-$ROOT/.gpu/bench-8b}
DATASET=${DATASET:-$ROOT/.gpu/sharegpt-2000rec.json}
SHARED_PREFIX=${SHARED_PREFIX:-}; MULTI_TURN=${MULTI_TURN:-}  # extra flags for those workloads
END=$((SECONDS + ${BUDGET_S:-570}))
read -r -a ITEMS <<< "$*"
mkdir -p "$OUT" "$WORK"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
NEW_PATH=$ROOT:/tmp/site  # lightllm/__init__.py finds kernels/ as lightllm.kernels
ENTRIES=() RUNS=() CHECKS=() SERVER=
declare -A TAKEN=()  # names of this call's result folders: a repeated item gets NAME-2, NAME-3, ...
trap 'stop_server; save' EXIT  # logs come back whatever happens; no server outlives the call

. "$ROOT/test/benchmark/lib/gpu_lib.sh"  # do_or_say, left, install_kit, healthy, wait_healthy, stop_server
unique() {  # unique NAME: sets UNIQUE to NAME, or to NAME-K if this call already has it (no subshell)
  local k=2; UNIQUE=$1; while [[ -n ${TAKEN[$UNIQUE]:-} ]]; do UNIQUE=$1-$((k++)); done
  TAKEN[$UNIQUE]=1
}
save() { ((DRY)) || tar -czf "$OUT/device_serving.tar.gz" -C "$WORK" --exclude=requests.json --exclude=compare.png . || true; }

setup() {
  ((DRY)) || find "$WORK" -mindepth 1 -maxdepth 1 -exec rm -rf {} +  # logs of this call only
  install_kit
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
  step pytest 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_fused_moe.py tests/test_sampling.py \
    tests/test_decode_buckets.py
  gpu_model
  step bench_kernels 90 python3 test/benchmark/kernels/bench_kernels.py --out "$WORK/check/kernels.json"
}

gpu_model() {  # the engine's GPU tests: greedy tokens against transformers, graphs against eager steps
  step gpu_model 330 python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/gpu/test_gpu_model.py \
    tests/gpu/test_gpu_graphs.py ${GPU_CHECK_ARGS:-}
}

api() {  # tests/gpu/test_gpu_api.py (it starts a server on MODEL): one CHECKS line per test
  local line
  step api 330 env LIGHTLLM_GPU_MODEL="$MODEL" python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/gpu/test_gpu_api.py
  [[ -f $WORK/check/api.log ]] || return 0
  while IFS= read -r line; do CHECKS+=("api: $line"); done < <(grep -E '^(PASSED|FAILED|ERROR) ' "$WORK/check/api.log")
  free_gpu
}

single() {  # single[:VARIANT]: one server (new unless named) alone, one request at a time: batch-1 TTFT and TPOT through every process
  local variant=${1:-new} path tree extra url rc=0 dir
  unique "single-$variant"; dir=$WORK/$UNIQUE
  flags_of "$variant"; mkdir -p "$dir"; extra="$extra --step_trace $dir/steps.jsonl"
  echo "== single ($variant): server, then single_request.py"
  if ((DRY)); then echo "+ single_request.py --url URL --max-new-tokens 256 --repeat 5 > $dir/single.log"; return; fi
  if (($(left) < 120)); then CHECKS+=("single: skipped (no time left)"); echo "${CHECKS[-1]}"; return; fi
  if start_server "$dir" $(( $(left) < 200 ? $(left) : 200 )); then
    timeout -k 10 120 env PYTHONPATH="$NEW_PATH" python3 "$ROOT/test/benchmark/serving/single_request.py" --url "$url" \
      --max-new-tokens 256 --repeat 5 > "$dir/single.log" 2>&1 || rc=$?
    CHECKS+=("single $variant: $( ((rc == 0)) && echo PASS || echo "FAIL (rc $rc)"): $(grep -E '^\| median' "$dir/single.log" || true)")
  else
    CHECKS+=("single: FAIL: server not healthy or dead")
  fi
  echo "${CHECKS[-1]}"
  stop_server; free_gpu; save
}

sweep() {  # sweep:VARIANT: one server (prefix cache off: every rate replays the same prompts),
  # rate_sweep.py over $SWEEP_RATES with the first $SWEEP_N saved requests; JSON and plot to $OUT
  local variant=${1#sweep:} path tree extra url rc=0 dir t n=${SWEEP_N:-500}
  unique "sweep-$variant"; dir=$WORK/$UNIQUE
  flags_of "$variant"; mkdir -p "$dir"; extra+=" --disable_prefix_cache"
  echo "== $UNIQUE: server, then rate_sweep.py"
  local cmd=(python3 "$ROOT/test/benchmark/serving/rate_sweep.py" --base-url URL --model "$MODEL"
    --requests "$(requests_file 1000)" --num-prompts "$n" --rates "${SWEEP_RATES:-5,10,20,30,40}" --warmup 8
    --label "$variant" --out-json "$OUT/$UNIQUE.json" --plot "$OUT/$UNIQUE.png")
  if ((DRY)); then echo "+ ${cmd[*]} > $dir/sweep.log"; return; fi
  if (($(left) < 150)); then CHECKS+=("$UNIQUE: skipped (no time left)"); echo "${CHECKS[-1]}"; return; fi
  if start_server "$dir" $(( $(left) < 200 ? $(left) : 200 )); then
    cmd[3]=$url; t=$(( $(left) - 50 ))  # room for the server's stop
    timeout -k 10 "$t" env PYTHONPATH="$NEW_PATH" "${cmd[@]}" > "$dir/sweep.log" 2>&1 || rc=$?
    CHECKS+=("$UNIQUE: $( ((rc == 0)) && echo PASS || echo "FAIL (rc $rc)")")
    cat "$dir/sweep.log" | grep -E '^\|' || true
  else
    CHECKS+=("$UNIQUE: FAIL: server not healthy or dead")
  fi
  echo "${CHECKS[-1]}"
  stop_server; free_gpu; save
}

free_gpu() {  # wait for the last server's processes to leave the GPU; kill, by pid, any that stay
  local pids i
  for i in $(seq 30); do
    pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' || true)
    [[ -z $pids ]] && return; sleep 1
  done
  echo "GPU still held by $pids: killing them"; kill -9 $pids 2>/dev/null || true; sleep 3
}

flags_of() {  # flags_of VARIANT: sets path, tree and extra (the server's flags) of the caller
  path=$NEW_PATH tree=$ROOT extra=""
  case $1 in
    old) tree=$ROOT/.gpu/old; path=$(tree_path "$tree") ;;  # cwd too: `python -m` puts it first on sys.path
    old+*) tree=$ROOT/.gpu/old; path=$(tree_path "$tree"); extra=${1#old+}; extra=${extra//,/ } ;;
    new) ;;
    base) tree=$ROOT/.gpu/base; path=$(tree_path "$tree") ;;  # git archive of HEAD
    new-nooverlap) extra=--disable_overlap ;;
    new-nocache) extra=--disable_prefix_cache ;;
    new-trace) extra="--step_trace $WORK/steps.jsonl" ;;  # the device's per-step timeline
    new-c[0-9]*) extra="--chunked_prefill_size ${1#new-c}" ;;
    new-fcfs) extra="--schedule_policy fcfs" ;;
    new-fcfs-c[0-9]*) extra="--schedule_policy fcfs --chunked_prefill_size ${1#new-fcfs-c}" ;;
    new-eager) extra=--disable_cuda_graph ;;
    new+*) extra=${1#new+}; extra=${extra//,/ } ;;  # new+--flag,value,...: any server flags, commas for spaces
    base+*) tree=$ROOT/.gpu/base; path=$(tree_path "$tree"); extra=${1#base+}; extra=${extra//,/ } ;;
    new-fp8) extra="--quantization fp8" ;;
    new-fp8-trace) extra="--quantization fp8 --step_trace $WORK/steps.jsonl" ;;
    new-fp8-c[0-9]*) extra="--quantization fp8 --chunked_prefill_size ${1#new-fp8-c}" ;;
    new-fp8-aw[0-9]*) extra="--quantization fp8 --admission_wait_steps ${1#new-fp8-aw}" ;;
    new-kv8) extra="--kv_cache_dtype fp8_e4m3" ;;
    new-fp8-kv8) extra="--quantization fp8 --kv_cache_dtype fp8_e4m3" ;;
    *) echo "unknown variant: $1" >&2; exit 2 ;;
  esac
  extra+=" ${SERVER_ARGS:-}"  # flags every server of the call takes (paths included: no commas to split)
}

serve() {  # serve VARIANT:N[@RATE]
  local variant=${1%%:*} rest=${1#*:} rate=inf path tree extra rc=0
  local n=${rest%%@*}; [[ $rest == *@* ]] && rate=${rest#*@}
  flags_of "$variant"
  local requests=$ROOT/.gpu/requests-$n.json; [[ -f $requests ]] || requests=$ROOT/.gpu/requests-2000.json
  local name=$variant-$n; [[ $rate != inf ]] && name+=-r$rate
  unique "$name"; name=$UNIQUE
  local dir=$WORK/$name; mkdir -p "$dir"; ENTRIES+=("$name|$variant|$n|$rate")
  # ~60 s start (dummy weights, graph capture) + ~35 s per 1000 requests at once + arrivals, with room.
  local t; t=$(awk -v n="$n" -v r="$rate" -v l="$(left)" \
    'BEGIN { c = 110 + n * 0.06 + (r == "inf" ? 0 : n / r); printf "%d", (c < l ? c : l) }')
  if ((t < 90)); then echo "$name: skipped, $t s left" | tee "$dir/run.log"; return; fi
  # compare.py runs from this tree; an old variant's server from its own (server@PYTHONPATH)
  local server=server; [[ $tree == "$ROOT" ]] || server=server@$path
  local cmd=(timeout -k 15 $((t + 25)) env PYTHONPATH="$NEW_PATH" python3 "$ROOT/test/benchmark/serving/compare.py"
    --model "$MODEL" --requests "$requests" --num-prompts "$n" --out-dir "$dir"
    --total-timeout "$t" --bench-timeout "$t" --request-rate "$rate" --client-procs "${CLIENT_PROCS:-1}"
    "--server-args=--tp 1 --load_format dummy --data_type bfloat16" "--variant=$variant=$server $extra")
  echo "== $name: ${t} s at most"
  if ((DRY)); then echo "+ ${cmd[*]@Q} > $dir/run.log"; return; fi
  $(command -v stdbuf > /dev/null && echo stdbuf -oL) nvidia-smi --query-gpu=timestamp,utilization.gpu \
    --format=csv,noheader,nounits -lms 200 > "$dir/gpu.csv" 2> /dev/null &  # line-buffered: killed below
  local smi=$!
  "${cmd[@]}" > "$dir/run.log" 2>&1 || rc=$?
  kill "$smi" 2>/dev/null || true; wait "$smi" 2>/dev/null || true
  echo "$name: rc $rc; $(grep -m1 'server healthy' "$dir/run.log" | sed 's/.*: //' || true)"
  free_gpu; save
}

requests_file() { local f=$ROOT/.gpu/requests-$1.json; [[ -f $f ]] && echo "$f" || echo "$ROOT/.gpu/requests-2000.json"; }

start_server() {  # start_server DIR SECONDS: the caller's variant in a session of its own; sets SERVER, url
  local port=$((20000 + RANDOM % 20000)) deadline=$((SECONDS + $2))
  url=http://127.0.0.1:$port
  # No job control here, so setsid execs in place: $! is the server's pid and its session's id.
  (cd "$tree" && exec env PYTHONPATH="$path" setsid python3 -m lightllm.server.api_server --model_dir "$MODEL" \
    --tp 1 --host 127.0.0.1 --port "$port" --load_format dummy --data_type bfloat16 $extra) > "$1/server.log" 2>&1 &
  SERVER=$!
  wait_healthy "$port" "$deadline" "$1/server.log"
}

workload() {  # workload DIR TAG WORKLOAD: benchmark_serving.py against $url; DIR/TAG.{json,log,window}
  local args=(--base-url "$url" --model "$MODEL" --stream --no-progress) t rc=0
  case $3 in
    sharegpt-[0-9]*) args+=(--requests "$(requests_file "${3#sharegpt-}")" --num-prompts "${3#sharegpt-}" --seed 0)
      t=$((40 + ${3#sharegpt-} * 6 / 100)) ;;
    shared-prefix) args+=(--workload shared-prefix --dataset "$DATASET" --seed 0 $SHARED_PREFIX); t=150 ;;
    multi-turn) args+=(--workload multi-turn --turn-len 128 --dataset "$DATASET" --seed 0 $MULTI_TURN); t=120 ;;
    warm-up) args+=(--workload shared-prefix --dataset "$DATASET" --seed 99 --prefix-groups 2 --prefix-group-size 8
      --prefix-len 256 --question-len 64 --output-len 32); t=60 ;;  # unrelated text: nothing the runs hit
    *) echo "unknown workload: $3" >&2; exit 2 ;;
  esac
  t=$(( t < $(left) - 30 ? t : $(left) - 30 ))
  if ((t < 20)); then echo "$2: skipped (no time left)" | tee "$1/$2.log"; return; fi
  [[ $3 == warm-up ]] || RUNS+=("$variant|$3|$1/$2")  # $variant: the caller's
  date +%s.%N > "$1/$2.window"
  timeout -k 10 $((t + 30)) env PYTHONPATH="$NEW_PATH" python3 "$ROOT/test/benchmark/serving/benchmark_serving.py" \
    "${args[@]}" --timeout "$t" --result-json "$1/$2.json" > "$1/$2.log" 2>&1 || rc=$?
  date +%s.%N >> "$1/$2.window"
  echo "$2: rc $rc; $(grep -E '^(Request throughput|Failed requests|Cache hit rate)' "$1/$2.log" | tr -s ' ' | paste -sd';' || true)"
}

probe() {  # probe DIR: greedy tokens of a long prompt and of 4 continuations of it, all sent twice, one by one
  timeout -k 5 100 env PYTHONPATH="$NEW_PATH" python3 - "$url" "$(requests_file 1000)" "$1/probe.json" \
    > "$1/probe.log" 2>&1 <<'PY' || echo "probe failed: see probe.log"
import json, re, sys, urllib.request
url, requests_path, out = sys.argv[1:]
sample = json.load(open(requests_path))[:100]
long = max((r for r in sample if len(r["prompt_ids"]) <= 900), key=lambda r: len(r["prompt_ids"]))["prompt"]
tails = [r["prompt"] for r in sorted(sample, key=lambda r: len(r["prompt_ids"]))[:4]]
prompts = [long] + [f"{long}\n\n{tail}" for tail in tails]

def hit_tokens():
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    found = re.search(r"^lightllm:prefix_cache_hits_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else float("nan")

def generate(prompt):
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 32, "ignore_eos": True, "do_sample": False}}
    request = urllib.request.Request(f"{url}/generate_stream", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    ids, logprobs = [], []
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:
            text = raw.decode().strip()
            if text.startswith("data:") and text[5:].strip() != "[DONE]":
                event = json.loads(text[5:])
                if event.get("error"):
                    raise RuntimeError(event["error"])
                ids.append(event["token"]["id"])
                logprobs.append(event["token"]["logprob"])
    return {"ids": ids, "logprobs": logprobs}

before = hit_tokens()
passes = [[generate(p) for p in prompts] for _ in range(2)]
hits = hit_tokens() - before
json.dump({"passes": passes, "hit_tokens": hits}, open(out, "w"))
print(f"probe: {len(prompts)} prompts x 2 passes of 32 tokens; {hits:.0f} prompt tokens hit the cache")
PY
}

bench() {  # bench VARIANT/WORKLOAD[,WORKLOAD...]: one server, a warm-up, the workloads in turn, the probe
  local variant=${1%%/*} path tree extra url wl i=0 smi
  local name=${1//\//-}; name=${name//,/+}; unique "$name"; name=$UNIQUE
  local dir=$WORK/$name wls; mkdir -p "$dir"
  IFS=, read -r -a wls <<< "${1#*/}"
  flags_of "$variant"
  echo "== $name: server $extra, then warm-up ${wls[*]} probe"
  if ((DRY)); then echo "+ (cd $tree && PYTHONPATH=$path setsid python3 -m lightllm.server.api_server ... $extra)"; return; fi
  if (($(left) < 150)); then echo "$name: skipped, $(left) s left" | tee "$dir/server.log"; return; fi
  $(command -v stdbuf > /dev/null && echo stdbuf -oL) nvidia-smi --query-gpu=timestamp,utilization.gpu \
    --format=csv,noheader,nounits -lms 200 > "$dir/gpu.csv" 2> /dev/null &
  smi=$!
  local t0=$SECONDS
  if start_server "$dir" $(( $(left) < 200 ? $(left) : 200 )); then
    echo "$name: healthy after $((SECONDS - t0)) s"
    workload "$dir" warm-up warm-up
    for wl in "${wls[@]}"; do workload "$dir" "$((i++))-$wl" "$wl"; done
    probe "$dir"
  fi
  stop_server
  kill "$smi" 2>/dev/null || true; wait "$smi" 2>/dev/null || true
  free_gpu; save
}

table() {  # markdown: compare.py rows, workload rows, cache on/off ratios, the probe's comparison
  python3 - "$WORK" "${ENTRIES[@]/#/serve|}" "${RUNS[@]/#/bench|}" <<'PY'
import json, re, statistics, sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, "test")  # `benchmark.*` (never test/benchmark: its kernels/ would shadow PyPI's `kernels`)
from benchmark.lib.serving_metrics import slowest_first_tokens

def stamp(text, fmt):
    try:
        return datetime.strptime(text, fmt).timestamp()
    except ValueError:
        return None

def num(summary, key, spec="{:.2f}"):
    value = summary.get(key)
    return spec.format(value) if isinstance(value, (int, float)) else "-"

def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}

def busy(gpu_csv, start, end):  # mean nvidia-smi utilisation between two epoch times
    samples = []
    if gpu_csv.exists() and start and end:
        for row in gpu_csv.read_text().splitlines():
            parts = [p.strip() for p in row.split(",")]
            when = stamp(parts[0], "%Y/%m/%d %H:%M:%S.%f") if len(parts) == 2 else None
            if when and start <= when <= end and parts[1].isdigit():
                samples.append(int(parts[1]))
    return f"{statistics.mean(samples):.1f} ({len(samples)} samples)" if samples else "-"

def serve_rows(entries):
    print("| variant | requests | req/s | output tok/s | median TTFT ms | P99 TTFT ms | median TPOT ms | P99 TPOT ms | GPU busy % |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    tails = []
    for name, variant, n, rate in entries:
        d = work / name
        s = next(iter(load(d / "compare.json").get("results", {}).get("requests", {}).values()), {})
        requests = n if rate == "inf" else f"{n} @ {rate} req/s"
        requests += f" ({s['failed']} failed)" if s.get("failed") else "" if s else " (no result: see run.log)"
        log = (d / "run.log").read_text(errors="replace") if (d / "run.log").exists() else ""
        window = []  # from the end of the warm-up to the server's stop: the measured run
        for pattern in ("warm-up: ", "stopping the server"):
            m = re.search(r"^(\S+ \S+) .*" + pattern, log, re.M)
            window.append(m and stamp(m.group(1), "%Y-%m-%d %H:%M:%S,%f"))
        print(f"| {variant} | {requests} | {num(s, 'request_throughput')} | {num(s, 'output_throughput')} | "
              f"{num(s, 'median_ttft_ms')} | {num(s, 'p99_ttft_ms')} | {num(s, 'median_tpot_ms')} | "
              f"{num(s, 'p99_tpot_ms')} | {busy(d / 'gpu.csv', *window)} |")
        if s.get("per_request"):
            tails.append(f"- {name}, the slowest first tokens: {slowest_first_tokens(s['per_request'])}")
    print("", *tails, sep="\n")

def bench_rows(runs):
    print("| variant | workload | requests | req/s | output tok/s | median TTFT ms | median TPOT ms | P99 TPOT ms "
          "| hit rate % | GPU busy % |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for variant, workload, base in runs:
        s, base = load(Path(base + ".json")), Path(base)
        requests = f"{s['completed']}" + (f" ({s['failed']} failed)" if s["failed"] else "") if s else "no result"
        rate = s.get("prefix_cache_hit_rate")
        window = [float(t) for t in base.with_suffix(".window").read_text().split()] if base.with_suffix(".window").exists() else []
        print(f"| {variant} | {workload} | {requests} | {num(s, 'request_throughput')} | {num(s, 'output_throughput')} | "
              f"{num(s, 'median_ttft_ms')} | {num(s, 'median_tpot_ms')} | {num(s, 'p99_tpot_ms')} | "
              f"{'-' if rate is None else f'{100 * rate:.1f}'} | {busy(base.parent / 'gpu.csv', *(window + [None, None])[:2])} |")

def ratio_rows(runs):  # the first run of each workload with the cache on against off
    first = {}
    for variant, workload, base in runs:
        first.setdefault((variant, workload), load(Path(base + ".json")))
    pairs = [(w, first[("new", w)], first[("new-nocache", w)]) for v, w in first if v == "new" and ("new-nocache", w) in first]
    if not pairs:
        return
    keys = ("request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms")
    print("\n| cache on / off | req/s | output tok/s | median TTFT | median TPOT |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for workload, on, off in pairs:
        cells = [f"{on[k] / off[k]:.3f}" if on.get(k) and off.get(k) else "-" for k in keys]
        print(f"| {workload} | " + " | ".join(cells) + " |")

def agree(a, b):  # leading tokens equal, and the largest logprob difference over them
    same = next((i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), min(len(a["ids"]), len(b["ids"])))
    gap = max((abs(x - y) for x, y in zip(a["logprobs"][:same], b["logprobs"][:same])), default=0.0)
    return same, len(a["ids"]) == len(b["ids"]) == same, gap

def probe_lines(runs):  # greedy tokens: cache on against off, and the cache's second pass against its first
    probes = {}
    for variant, _, base in runs:
        probes.setdefault(variant, load(Path(base).parent / "probe.json"))
    on, off = probes.get("new"), probes.get("new-nocache")
    comparisons = []
    if on and off:
        comparisons += [(f"pass {p + 1}, cache on vs off", on["passes"][p], off["passes"][p]) for p in (0, 1)]
    if on:
        comparisons.append(("cache on, pass 2 vs pass 1", on["passes"][1], on["passes"][0]))
    if not comparisons:
        return
    print()
    for label, a, b in comparisons:
        results = [agree(x, y) for x, y in zip(a, b)]
        equal = sum(whole for _, whole, _ in results)
        print(f"- probe, {label}: {equal}/{len(results)} requests with all 32 greedy tokens equal "
              f"(equal leading tokens: {[same for same, _, _ in results]}; largest logprob difference over them "
              f"{max(gap for _, _, gap in results):.4f})")
    print(f"- probe, prompt tokens hit: " + ", ".join(f"{v} {p.get('hit_tokens', float('nan')):.0f}" for v, p in probes.items() if p))

work = Path(sys.argv[1])
entries = [a.split("|") for a in sys.argv[2:]]
serve = [e[1:] for e in entries if e[0] == "serve"]
runs = [e[1:] for e in entries if e[0] == "bench"]
if serve:
    serve_rows(serve)
if runs:
    print() if serve else None
    bench_rows(runs)
    ratio_rows(runs)
    probe_lines(runs)
PY
}

setup
for item in "${ITEMS[@]}"; do
  case $item in
    serve) ;;
    check) check ;;
    api) api ;;
    single) single ;;
    single:*) single "${item#single:}" ;;
    sweep:*) sweep "$item" ;;
    profile) step profile 330 python3 test/benchmark/engine/profile_step.py --model "$MODEL" --out-md "$OUT/profile.md" $PROFILE_ARGS ;;
    model) gpu_model ;;
    moe) step moe_bench 330 python3 test/benchmark/kernels/moe_bench.py --out-md "$OUT/moe.md" ${MOE_ARGS:-} ;;
    fp8gemm) step fp8_gemm 330 python3 test/benchmark/kernels/fp8_gemm_bench.py --out-md "$OUT/fp8_gemm.md" ${FP8_ARGS:-} ;;
    */*) bench "$item" ;;
    *:*) serve "$item" ;;
    *) echo "unknown item: $item" >&2; exit 2 ;;
  esac
done
{
  echo "new = this working tree, old = .gpu/old; $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo 'no GPU')"
  if ((${#CHECKS[@]})); then printf -- '- %s\n' "${CHECKS[@]}"; echo; fi
  if ((${#ENTRIES[@]} + ${#RUNS[@]})); then table; fi
} | tee "$OUT/summary.md"
