#!/usr/bin/env bash
# One device call on a machine of several GPUs (docs/multi_gpu.md): tensor parallelism checked
# against one GPU, and measured. From the repo root:
#
#   bash test/benchmark/serving/multi_gpu.sh [dry] ITEM...          (a quoted list is accepted)
#   ITEM = check-tpN | allreduce | profile-tpN | serve-tpN[-nccl|-unfused][-graphT][-trace]:REQUESTS[@RATE] | serve-dpN[-graphT][-trace]:REQUESTS[@RATE] | single-tpN[-nccl|-unfused]
#   check-tpN: tests/test_allreduce.py and tests/test_tp.py on the GPUs, then the greedy tokens of
#     16 prompts (32 tokens each, sent together) from a --tp N server against a --tp 1 server, on
#     a tiny model in fp32 (bench_model's presets in CHECK_PRESETS, default "tiny"; e.g. "tiny
#     tiny-qwen3-moe tiny-mixtral": seeded random weights, written here).
#   allreduce: allreduce_bench.py over the largest group of 2, 4 or 8 GPUs here: us per call by
#     message size, NCCL / one-shot / two-shot / chosen, eager and in CUDA graphs; sums against NCCL;
#     then the fused all-reduce + add + RMSNorm against the two apart, by size (CUDA).
#   profile-tpN: allreduce_bench.py's decode profile of MODEL (batch 1, 64, 256; context 1024): tp 1
#     (not for bench-70b; kernels from torch's profiler), tp N through NCCL only, tp N with the
#     all-reduce and the norm after it apart (unfused), tp N as served (the all-reduce's time by
#     subtraction: the graph replayed with it an identity).
#   serve-tpN[-nccl]:R: compare.py, one server at --tp N, R ShareGPT requests from
#     .gpu/requests-R.json (else the first R of requests-2000.json), all at once, streamed;
#     GPU busy: nvidia-smi's utilisation over GPUs 0..N-1 during the measured run.
#   serve-dpN:R: the same with --dp N --tp 1 (N replicas, one GPU each, one HTTP endpoint).
#   :R@RATE (serve items): Poisson arrivals at RATE req/s instead of all at once (name ...-R-rRATE).
#   -graphT (serve items, before :R): the server with --cuda_graph_max_tokens T.
#   -trace (serve items, last before :R): the server with --step_trace (a file per rank and
#     replica), each summarised by test/benchmark/engine/step_trace.py into the item's directory; rank 0's
#     (replica 0's) summary is printed too.
#   single-tpN[-nccl]: a --tp N server, single_request.py (5 requests of 256 tokens, one by one):
#     batch-1 TTFT and TPOT, and TPOT's floor: MODEL's weight bytes per GPU over the copy bandwidth.
#   SERVER_FLAGS (serve items): more server flags, e.g. "--quantization fp8".
#   -nccl: every all-reduce through NCCL (LIGHTLLM_SYMM_MEM_ALL_REDUCE=0), the "before".
#   -unfused: symmetric memory, but the all-reduce and the RMSNorm after it as two kernels
#     (LIGHTLLM_FUSED_ALL_REDUCE_NORM=0, kernels/allreduce_norm.py's "before").
#
# MODEL = bench-8b (.gpu/bench-8b, the default) | bench-70b (written to /tmp/bench-70b here by
# lightllm.tools.bench_model: config and tokenizer, dummy weights) | a model directory.
# Needs (carried, git-ignored): .whl/ (the wheels the image lacks), .gpu/bench-8b (also the
# tokenizer of the models written here), .gpu/requests-1000.json. Everything stays within
# BUDGET_S (570 s) of the start; logs go to $OUT/multi_gpu.tar.gz (from $WORK, default
# /tmp/multi_gpu, emptied first), the tables to $OUT/summary.md and, last, to stdout.
# `dry` prints the commands. On the CPU (the plumbing, tiny model, gloo): NO_WHEELS=1 MODEL=DIR
# DEVICE=cpu GPUS=2 CHECK_TESTS=0 (skip check's pytest), SINGLE_TOKENS=16.
set -euo pipefail

ROOT=$(pwd)
DRY=0; [[ ${1:-} == dry ]] && { DRY=1; shift; }
OUT=${OUT:-/tmp/multi_gpu_out}; WORK=${WORK:-/tmp/multi_gpu}; MODEL=${MODEL:-bench-8b}
DEVICE=${DEVICE:-cuda}; SINGLE_TOKENS=${SINGLE_TOKENS:-256}
END=$((SECONDS + ${BUDGET_S:-570}))
read -r -a ITEMS <<< "$*"
mkdir -p "$OUT" "$WORK"
# NVLink multicast stays off: on the shared hosts it can take every GPU down (KINDS.md). No
# item uses it; set here too, since each server and test starts from this environment.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$ROOT:/tmp/site  # lightllm/__init__.py finds kernels/ as lightllm.kernels
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l || true)}
CHECKS=() ROWS=() SERVER= MODEL_DIR=
trap 'stop_server; save' EXIT  # logs come back whatever happens; no server outlives the call

. "$ROOT/test/benchmark/lib/gpu_lib.sh"  # do_or_say, left, install_kit, healthy, wait_healthy, stop_server
save() { ((DRY)) || tar -czf "$OUT/multi_gpu.tar.gz" -C "$WORK" --exclude=requests.json --exclude=tiny . || true; }
note() { CHECKS+=("$1"); echo "$1"; }

setup() {
  ((DRY)) || find "$WORK" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
  install_kit
  case $MODEL in
    bench-8b) MODEL_DIR=$ROOT/.gpu/bench-8b ;;
    bench-70b) MODEL_DIR=/tmp/bench-70b
      do_or_say python3 -m lightllm.tools.bench_model --out "$MODEL_DIR" --preset 70b --tokenizer "$ROOT/.gpu/bench-8b" ;;
    *) MODEL_DIR=$MODEL ;;
  esac
  if ((DRY)) || [[ $DEVICE != cuda ]]; then return; fi
  nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader || true
  nvidia-smi topo -m > "$WORK/topo.txt" 2>&1 || true  # how the GPUs are linked (NV18: NVLink)
  python3 - > "$WORK/bandwidth.txt" <<'PY' || true
import sys, torch
sys.path.insert(0, "test")  # `benchmark.*` (never test/benchmark: its kernels/ would shadow PyPI's `kernels`)
from benchmark.engine.static_benchmark import copy_bandwidth
print(copy_bandwidth(torch.device("cuda", 0), 1 << 30) / 1e9)  # GB/s, read + write
PY
}

step() {  # step NAME SECONDS CMD...: one check, time-bounded, its log in $WORK/check
  local name=$1 t=$2 rc=0; shift 2
  t=$(( t < $(left) ? t : $(left) ))
  mkdir -p "$WORK/check"
  if ((DRY)); then echo "+ timeout -k 10 $t $* > $WORK/check/$name.log"; return; fi
  if ((t < 20)); then note "$name: skipped (no time left)"; return; fi
  timeout -k 10 "$t" "$@" > "$WORK/check/$name.log" 2>&1 || rc=$?
  note "$name: $( ((rc == 0)) && echo PASS || echo "FAIL (rc $rc)"): $(grep -v '^\s*$' "$WORK/check/$name.log" | tail -1 || true)"
  save
}

enough_gpus() {  # enough_gpus N ITEM: false (and a note) when this machine has fewer than N GPUs
  ((DRY || $1 <= GPUS)) && return
  note "$2: skipped ($1 GPUs needed, $GPUS here)"; return 1
}

start_server() {  # start_server DIR TP SECONDS ENV FLAGS...: a server in a session of its own; sets SERVER, url
  local dir=$1 tp=$2 deadline=$((SECONDS + $3)) env=$4 port=$((20000 + RANDOM % 20000)); shift 4
  url=http://127.0.0.1:$port
  if ((DRY)); then echo "+ env $env setsid python3 -m lightllm.server.api_server --tp $tp --port $port $* > $dir/server.log"; return; fi
  # No job control here, so setsid execs in place: $! is the server's pid and its session's id.
  env $env setsid python3 -m lightllm.server.api_server --tp "$tp" --host 127.0.0.1 --port "$port" "$@" \
    > "$dir/server.log" 2>&1 &
  SERVER=$!
  wait_healthy "$port" "$deadline" "$dir/server.log"
}

gpu_log() {  # gpu_log FILE: nvidia-smi's utilisation of every GPU every 200 ms, until killed; echoes its pid
  [[ $DEVICE == cuda ]] || { echo ""; return; }
  $(command -v stdbuf > /dev/null && echo stdbuf -oL) nvidia-smi --query-gpu=timestamp,index,utilization.gpu \
    --format=csv,noheader,nounits -lms 200 > "$1" 2> /dev/null &
  echo $!
}

parse() {  # parse ITEM: sets tp, dp, gpus, env (NCCL-only for -nccl, no fused norm for -unfused), graph (-graphT), trace (-trace) and name from NAME-tpN[-nccl|-unfused][-graphT][-trace][:R] or NAME-dpN[-graphT][-trace][:R]
  local head=${1%%:*}
  name=$head env=LIGHTLLM_SYMM_MEM_ALL_REDUCE=1 dp=1 graph= trace=0
  if [[ $head == *-trace ]]; then trace=1; head=${head%-trace}; fi
  if [[ $head == *-graph* ]]; then graph=${head##*-graph}; head=${head%-graph*}; fi
  if [[ $head == *-dp* ]]; then tp=1 dp=${head#*-dp}; else tp=${head#*-tp}; tp=${tp%-nccl}; tp=${tp%-unfused}; fi
  [[ $head == *-nccl ]] && env=LIGHTLLM_SYMM_MEM_ALL_REDUCE=0
  [[ $head == *-unfused ]] && env=LIGHTLLM_FUSED_ALL_REDUCE_NORM=0
  [[ $tp =~ ^[0-9]+$ && $dp =~ ^[0-9]+$ && $graph =~ ^[0-9]*$ ]] || { echo "bad item $1: no tensor- or data-parallel degree" >&2; exit 2; }
  gpus=$((tp * dp))
}

check() {  # check-tpN: unit tests on the GPUs, then greedy tokens of --tp N against --tp 1, per CHECK_PRESETS
  local tp dp gpus env graph trace name dir tiny preset
  parse "$1"; enough_gpus "$tp" "$name" || return 0
  [[ ${CHECK_TESTS:-1} == 0 ]] || step "$name-pytest" 300 python3 -m pytest -q -p no:cacheprovider \
    tests/test_allreduce.py tests/test_tp.py -k "not 70b"  # the 70b test needs the default model (network)
  for preset in ${CHECK_PRESETS:-tiny}; do
    dir=$WORK/$name/$preset; tiny=$WORK/tiny/$preset; mkdir -p "$dir"
    do_or_say python3 -m lightllm.tools.bench_model --out "$tiny" --preset "$preset" --tokenizer "$ROOT/.gpu/bench-8b"
    ((DRY)) || python3 - "$dir/prompts.json" <<'PY'
import json, random, sys
words = "the a model token cache batch river stone light runs over under 你好 café".split()
rng = random.Random()  # fresh prompts each call; both servers get the same ones
json.dump([" ".join(rng.choices(words, k=rng.randrange(1, 40))) for _ in range(16)], open(sys.argv[1], "w"))
PY
    greedy "$dir" 1 "$tiny" && greedy "$dir" "$tp" "$tiny" \
      || { note "$name ($preset): FAIL: a server did not answer (see $dir)"; continue; }
    ((DRY)) && continue
    note "$name ($preset): $(python3 - "$dir" "$tp" "$preset" <<'PY'
import json, sys
d, tp, preset = sys.argv[1:]
one, many = (json.load(open(f"{d}/tokens-tp{n}.json")) for n in ("1", tp))
same = sum(a == b for a, b in zip(one, many))
print(f"{'PASS' if same == len(one) == len(many) else 'FAIL'}: greedy tokens of --tp {tp} equal --tp 1's "
      f"for {same}/{len(one)} prompts ({preset} model, fp32, 32 tokens each, sent together)")
PY
)"
  done
}

greedy() {  # greedy DIR TP MODEL: the tokens of DIR/prompts.json from a --tp TP server, into DIR/tokens-tpTP.json
  local dir=$1 url rc=0
  mkdir -p "$dir/tp$2"
  start_server "$dir/tp$2" "$2" 150 LIGHTLLM_SYMM_MEM_ALL_REDUCE=1 --model_dir "$3" --data_type float32 || return 1
  ((DRY)) && return
  timeout -k 5 100 python3 - "$url" "$dir/prompts.json" "$dir/tokens-tp$2.json" > "$dir/tp$2/client.log" 2>&1 <<'PY' || rc=$?
import json, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
url, prompts, out = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]

def tokens(prompt):
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 32, "do_sample": False, "ignore_eos": True, "details": True}}
    request = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    answer = json.load(urllib.request.urlopen(request, timeout=60))
    return [token["id"] for token in answer["details"]["tokens"]]

with ThreadPoolExecutor(len(prompts)) as pool:
    json.dump(list(pool.map(tokens, prompts)), open(out, "w"))
PY
  stop_server
  return $rc
}

serve() {  # serve-tpN[-nccl]:R[@RATE], serve-dpN:R[@RATE]: compare.py, one server variant
  local tp dp gpus env graph trace name n=${1#*:} smi rc=0 server_args= rate=inf
  [[ $n == *@* ]] && { rate=${n#*@}; n=${n%@*}; }
  [[ $n =~ ^[0-9]+$ && $rate =~ ^(inf|[0-9]+([.][0-9]+)?)$ ]] || { echo "bad item $1: R[@RATE] wanted" >&2; exit 2; }
  parse "$1"; name+=-$n; [[ $rate == inf ]] || name+=-r$rate
  enough_gpus "$gpus" "$name" || return 0
  local requests=$ROOT/.gpu/requests-$n.json; [[ -f $requests ]] || requests=$ROOT/.gpu/requests-2000.json
  local dir=$WORK/$name; mkdir -p "$dir"; ROWS+=("serve|$name|$gpus")
  # start (dummy weights, graph capture: ~20 s for bench-8b, more for 70B) + ~35 s per 1000 requests at once.
  local t; t=$(( 150 + n * 15 / 100 ))
  [[ $rate == inf ]] || t=$(( 150 + ${n}0 / ${rate%.*}0 ))  # the arrivals' span, then the start and the tail
  t=$(( t < $(left) ? t : $(left) ))
  if ((t < 90)); then echo "$name: skipped, $t s left" | tee "$dir/run.log"; return; fi
  local cmd=(timeout -k 15 $((t + 25)) env "$env" python3 "$ROOT/test/benchmark/serving/compare.py" --model "$MODEL_DIR"
    --requests "$requests" --num-prompts "$n" --out-dir "$dir" --start-timeout 240
    --total-timeout "$t" --bench-timeout "$t" --request-rate "$rate" "--variant=$name=server" ${SERVE_ARGS:-})
  server_args="--tp $tp --load_format dummy --data_type bfloat16 ${SERVER_FLAGS:-}"  # SERVER_FLAGS: e.g. "--quantization fp8"
  ((dp == 1)) || server_args+=" --dp $dp"
  [[ -z $graph ]] || server_args+=" --cuda_graph_max_tokens $graph"
  ((trace == 0)) || server_args+=" --step_trace $dir/steps.jsonl"
  [[ $DEVICE == cuda ]] || { server_args+=" --data_type float32"; cmd+=(--device cpu); }  # the later flag wins
  cmd+=("--server-args=$server_args")
  echo "== $name: ${t} s at most"
  if ((DRY)); then echo "+ ${cmd[*]@Q} > $dir/run.log"; return; fi
  smi=$(gpu_log "$dir/gpu.csv")
  "${cmd[@]}" > "$dir/run.log" 2>&1 || rc=$?
  [[ -z $smi ]] || { kill "$smi" 2>/dev/null || true; wait "$smi" 2>/dev/null || true; }
  echo "$name: rc $rc; $(grep -m1 'server healthy' "$dir/run.log" | sed 's/.*: //' || true)"
  ((trace == 0)) || summarise_traces "$dir"
  save
}

summarise_traces() {  # DIR: step_trace.py's tables of each trace file there; the first one's printed
  local file first=1
  for file in "$1"/steps.jsonl*; do
    [[ -s $file ]] || continue
    python3 "$ROOT/test/benchmark/engine/step_trace.py" "$file" > "$file.md" 2>&1 || true
    if ((first)); then echo "-- $(basename "$file")"; cat "$file.md"; first=0; fi
  done
}

single() {  # single-tpN[-nccl]: batch-1 latency through every process
  local tp dp gpus env graph trace name dir url rc=0 flags=(--load_format dummy --data_type bfloat16)
  parse "$1"; dir=$WORK/$name; mkdir -p "$dir"
  enough_gpus "$tp" "$name" || return 0
  [[ $DEVICE == cuda ]] || flags=(--data_type float32)
  ROWS+=("single|$name|$tp")
  echo "== $name: server, then single_request.py"
  if ((!DRY && $(left) < 120)); then note "$name: skipped (no time left)"; return; fi
  if start_server "$dir" "$tp" 240 "$env" --model_dir "$MODEL_DIR" "${flags[@]}"; then
    if ((DRY)); then echo "+ single_request.py --url $url --max-new-tokens $SINGLE_TOKENS --repeat 5 > $dir/single.log"; return; fi
    timeout -k 10 150 python3 "$ROOT/test/benchmark/serving/single_request.py" --url "$url" \
      --max-new-tokens "$SINGLE_TOKENS" --repeat 5 > "$dir/single.log" 2>&1 || rc=$?
    note "$name: $( ((rc == 0)) && echo PASS || echo "FAIL (rc $rc)"): $(grep -E '^\| median' "$dir/single.log" || true)"
  else
    note "$name: FAIL: server not healthy or dead"
  fi
  stop_server; save
}

profile() {  # profile-tpN: allreduce_bench.py's decode profile
  local tp dp gpus env graph trace name modes=tp1,nccl,unfused,symmetric
  parse "$1"; enough_gpus "$tp" "$name" || return 0
  [[ $MODEL == bench-70b ]] && modes=nccl,unfused,symmetric  # 141 GB of weights: not on one GPU
  step "$name" 420 python3 test/benchmark/kernels/allreduce_bench.py --device "$DEVICE" --world-size "$tp" --sizes '' \
    --profile-model "$MODEL_DIR" --profile-modes "${PROFILE_MODES:-$modes}" --out-md "$WORK/$name.md" \
    --stacks-after 300 ${PROFILE_ARGS:-}  # where the ranks wait, should a run stop (two H200s, 2026-11-28, df839b2; docs/multi_gpu.md)
}

allreduce() {
  local n; for n in 8 4 2; do ((n <= GPUS)) && break; done
  enough_gpus "$n" allreduce || return 0
  local norm=(); [[ $DEVICE == cuda ]] && norm=(--norm-sizes 8K,512K,1M,2M,4M,8M,16M,32M,64M)
  step allreduce 240 python3 test/benchmark/kernels/allreduce_bench.py --device "$DEVICE" --world-size "$n" \
    "${norm[@]}" --out-md "$WORK/allreduce.md" ${ALLREDUCE_ARGS:-}
}

table() {  # markdown: serve and single rows, the ratios the issues ask for
  python3 - "$WORK" "$MODEL_DIR" "${ROWS[@]}" <<'PY'
import json, re, statistics, sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, "test")  # `benchmark.*` (never test/benchmark: its kernels/ would shadow PyPI's `kernels`)
work, model_dir, rows = Path(sys.argv[1]), sys.argv[2], [r.split("|") for r in sys.argv[3:]]

def stamp(text, fmt):
    try:
        return datetime.strptime(text, fmt).timestamp()
    except ValueError:
        return None

def busy(d, tp):  # mean utilisation of GPUs 0..tp-1, from the warm-up's end to the server's stop
    log = (d / "run.log").read_text(errors="replace") if (d / "run.log").exists() else ""
    window = []
    for pattern in ("warm-up: ", "stopping the server"):
        m = re.search(r"^(\S+ \S+) .*" + pattern, log, re.M)
        window.append(m and stamp(m.group(1), "%Y-%m-%d %H:%M:%S,%f"))
    samples = []
    if (d / "gpu.csv").exists() and all(window):
        for line in (d / "gpu.csv").read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            when = len(parts) == 3 and stamp(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            if when and window[0] <= when <= window[1] and parts[1].isdigit() and int(parts[1]) < tp and parts[2].isdigit():
                samples.append(int(parts[2]))
    return f"{statistics.mean(samples):.1f}" if samples else "-"

def floor_ms(tp):  # batch-1 TPOT's floor: this GPU's share of the weights over the copy bandwidth
    try:
        from benchmark.engine.static_benchmark import weight_bytes
        from lightllm.models import read_config
        gbs = float((work / "bandwidth.txt").read_text().split()[-1])
        return weight_bytes(read_config(model_dir), 2) / tp / (gbs * 1e9) * 1e3
    except Exception:
        return None

def fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)

serve, single = {}, {}
for kind, name, tp in rows:
    d = work / name
    if kind == "serve":
        try:
            s = next(iter(json.loads((d / "compare.json").read_text())["results"]["requests"].values()))
        except (OSError, ValueError, KeyError, StopIteration):
            s = {}
        serve[name] = (int(tp), s, busy(d, int(tp)))
    else:
        m = (d / "single.log").exists() and re.search(r"^\| median \| ([\d.]+) \| ([\d.]+) \|", (d / "single.log").read_text(), re.M)
        single[name] = (int(tp), float(m.group(1)) if m else None, float(m.group(2)) if m else None)

if serve:
    print("| server | req/s | output tok/s | median TTFT ms | P99 TTFT ms | median TPOT ms | P99 TPOT ms | failed | GPU busy % |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (tp, s, b) in serve.items():
        print(f"| {name} | {fmt(s.get('request_throughput'))} | {fmt(s.get('output_throughput'), '.0f')} | "
              f"{fmt(s.get('median_ttft_ms'))} | {fmt(s.get('p99_ttft_ms'))} | {fmt(s.get('median_tpot_ms'))} | "
              f"{fmt(s.get('p99_tpot_ms'))} | "
              f"{s.get('failed', '-')} | {b} |")
    print()
    from benchmark.lib.serving_metrics import slowest_first_tokens
    for name, (tp, s, b) in serve.items():  # which requests make the TTFT tail, and when they were sent
        if s.get("per_request"):
            print(f"- {name}, the slowest first tokens: {slowest_first_tokens(s['per_request'])}")
    print()
if single:
    print("| server | batch-1 TTFT ms | batch-1 TPOT ms | TPOT floor ms (weights per GPU / copy bandwidth) | floor / TPOT |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (tp, ttft, tpot) in single.items():
        f = floor_ms(tp)
        print(f"| {name} | {fmt(ttft, '.1f')} | {fmt(tpot)} | {fmt(f)} | {fmt(f / tpot if f and tpot else None)} |")
    print()

def ratios(table, key, label):
    """Each row against the same item on the group's fewest GPUs (the tp 1 or tp 4 row), each row
    against its -nccl twin (the all-reduce's own gain), and each dp row against the tp row on as
    many GPUs (which way to use them)."""
    groups = {}
    for name, entry in table.items():
        groups.setdefault(re.sub(r"(tp|dp)\d+(-nccl|-unfused)?", "", name), []).append((name, entry))
    for members in groups.values():
        base_name, base = min(members, key=lambda m: (m[1][0], "-nccl" in m[0] or "-unfused" in m[0], "-dp" in m[0]))
        for name, entry in members:
            pairs = [(base_name, base)] if entry[0] > base[0] else []
            if "-tp" in name:
                for twin in ("-nccl", "-unfused"):
                    twin_name = name.replace(f"tp{entry[0]}", f"tp{entry[0]}{twin}", 1)
                    pairs += [(twin_name, table[twin_name])] if twin_name != name and twin_name in table else []
            else:
                pairs += [(n, e) for n, e in members if "-tp" in n and "-nccl" not in n and "-unfused" not in n
                          and e[0] == entry[0]]
            for other_name, other in pairs:
                if key(entry) and key(other):
                    print(f"- {label}: {name} / {other_name} = {key(entry) / key(other):.3f}")


ratios(serve, lambda e: e[1].get("request_throughput"), "req/s")
ratios(serve, lambda e: e[1].get("output_throughput"), "output tok/s")
ratios(single, lambda e: e[2], "batch-1 TPOT")
PY
}

setup
for item in "${ITEMS[@]}"; do
  case $item in
    check-tp*) check "$item" ;;
    allreduce) allreduce ;;
    profile-tp*) profile "$item" ;;
    serve-tp*:*|serve-dp*:*) serve "$item" ;;
    single-tp*) single "$item" ;;
    *) echo "unknown item: $item" >&2; exit 2 ;;
  esac
done
((DRY)) && exit 0
names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs || true)
{
  echo "this working tree on ${names:-no GPU}; MODEL $MODEL"
  [[ -s $WORK/topo.txt ]] && { echo; echo '```'; cat "$WORK/topo.txt"; echo '```'; }
  [[ -s $WORK/bandwidth.txt ]] && echo "GPU 0 copy bandwidth (read + write): $(tail -1 "$WORK/bandwidth.txt") GB/s"
  echo
  if ((${#CHECKS[@]})); then printf -- '- %s\n' "${CHECKS[@]}"; echo; fi
  for md in "$WORK"/allreduce.md "$WORK"/profile-tp*.md; do [[ -f $md ]] && cat "$md"; done
  if ((${#ROWS[@]})); then table; fi
} | tee "$OUT/summary.md"
