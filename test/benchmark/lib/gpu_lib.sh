# Shell pieces shared by the one-call device scripts (serving/device_serving.sh, serving/multi_gpu.sh);
# source it. The caller sets ROOT, DRY, END (SECONDS at which its budget ends) and SERVER (empty).
# What the calls carry and the GPU machine lacks (.whl/, .gpu/) is made by test/benchmark/prepare_device.py.

do_or_say() { if ((DRY)); then echo "+ $*"; else "$@"; fi; }
left() { echo $((END - SECONDS - 10)); }

install_kit() {  # the wheels the GPU image lacks into /tmp/site (unless NO_WHEELS)
  [[ -n ${NO_WHEELS:-} ]] || do_or_say python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site "$ROOT"/.whl/*.whl
}

tree_path() {  # tree_path TREE: the PYTHONPATH that runs TREE's server (TREE first: it is the cwd too)
  # This tree and any commit from 9c4255f on import the kernels as lightllm.kernels, which
  # lightllm/__init__.py finds in the checkout. A commit before 9c4255f imports them as
  # lightllm_kernels, through a tracked symlink that a git archive brought here may lack: for such
  # an old tree only, a copy of its kernels/ under that name, in TREE-kernels.
  local tree=$1
  if grep -rqs --include='*.py' lightllm_kernels "$tree/lightllm"; then
    ((DRY)) || { rm -rf "$tree-kernels" && mkdir -p "$tree-kernels" && cp -r "$tree/kernels" "$tree-kernels/lightllm_kernels"; }
    echo "$tree:$tree-kernels:/tmp/site"
  else
    echo "$tree:/tmp/site"
  fi
}

healthy() {  # healthy PORT: GET /health answers 200 (bash's /dev/tcp: no client needed)
  local status=
  { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 1
  printf 'GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  read -r -t 10 status <&3 || true
  exec 3>&-
  [[ $status == *" 200 "* ]]
}

wait_healthy() {  # wait_healthy PORT DEADLINE LOG: until $SERVER answers; stops it and fails if it dies or DEADLINE passes
  until healthy "$1"; do
    if ! kill -0 "$SERVER" 2>/dev/null || ((SECONDS > $2)); then
      echo "server not healthy in time or dead: see $3"; stop_server; return 1
    fi
    sleep 1
  done
}

stop_server() {  # SIGTERM to the server alone (it drains, then ends its processes); its session's rest
  [[ -n $SERVER ]] || return 0  # gets SIGKILL after 40 s
  kill -TERM "$SERVER" 2>/dev/null || true
  local i; for i in $(seq 40); do kill -0 -- "-$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true; SERVER=
}
