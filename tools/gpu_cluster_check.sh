#!/usr/bin/env bash
# The cluster path on one GPU host without package access (e.g. the lent H200): GPU tests of
# the engine/cluster/aux ring, the control plane's hop timings, and `dflash-serve serve` end
# to end.
#   pip download --no-deps -d .whl …   # the wheels of fla, Ray Serve (see tools/device_env.sh)
#   OUT=/some/dir bash tools/gpu_cluster_check.sh
set -u
OUT=${OUT:-/tmp/gpu_cluster_check}; mkdir -p "$OUT"
. tools/device_env.sh  # .whl/ → /tmp/site, PYTHONPATH
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, ray, fla; print('torch', torch.__version__, 'ray', ray.__version__)" \
  | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/cluster/test_gpu_cluster.py \
  tests/workers/test_aux_transport.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
timeout 200 python3 -m bench.control_plane --model tests/assets/tiny/target \
  --draft tests/assets/tiny/draft --tp 1 --device cuda --iters 200 \
  --out "$OUT/control_plane_h200.json" > "$OUT/control_plane.log" 2>&1 \
  || tail -30 "$OUT/control_plane.log"
. tools/serve_smoke.sh
serve_smoke 1 serve_gpu \
  "^dflash_(spec_decode|draft_time_per_round_seconds_(sum|count)|verify_time_per_round_seconds_(sum|count)|kv_cache)"
