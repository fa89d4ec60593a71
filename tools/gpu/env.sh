# Sourced by the GPU check scripts, from the repository root. On a GPU host without package
# access, put the wheels the checks need in .whl/ (`pip download --no-deps -d .whl …` on a
# machine with pip; `python -m tools.gpu.slim_wheel .whl/ray-*.whl` drops the parts of Ray's
# wheel a check never imports, where the copy to the host is limited in size): they are
# installed into /tmp/site and put on PYTHONPATH with the repository. Then the helpers below
# that the scripts share.
# REQUIRE_GPU=NAME (e.g. H200): stop at once, status 3, where no GPU's name holds NAME, before
# the wheels or any work (figures meant for one card are not taken on another).
if [ -n "${REQUIRE_GPU:-}" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null \
    | grep -q -- "$REQUIRE_GPU"; then
  echo "REQUIRE_GPU=$REQUIRE_GPU: this machine has $(nvidia-smi -L 2>/dev/null || echo 'no GPU')" >&2
  exit 3
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" | tail -2
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
fi

# Ctrl-C for the `dflash-serve serve` a check script started under `timeout`: the server
# alone (a graceful drain), not its timeout wrapper, which would pass a second SIGINT on
# (stop at once). Then its seconds to drain and shut down.
stop_server() {
  pkill -INT -f "^python3 -m deploy.cli serve"; sleep "${1:-8}"
}

# pytest under a time limit that stops it with SIGINT (then SIGKILL 30 s later), so that its
# report, failures and tracebacks included, is written before it ends: gpu_pytest LIMIT ARGS…
gpu_pytest() {
  local limit=$1; shift
  timeout -s INT -k 30 "$limit" python3 -m pytest "$@"
}
