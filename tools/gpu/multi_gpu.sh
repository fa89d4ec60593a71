#!/usr/bin/env bash
# Tensor parallelism and a separate draft on one host with several GPUs, in parts (default: all), results under $OUT:
#   tests   the GPU cluster tests: TP 2/4 over NCCL and a draft on its own GPU give target-only
#           greedy tokens (fp32, tiny pair), and the aux transports
#   tpcheck tools/tp_check: TP-N logits against TP 1 on the real 35B-A3B architecture (bf16)
#   bench   bench/engine.py --tp 1/2/4 through the cluster path (decode, verify, draft, round,
#           all-reduce per call against the bus bandwidth), and TP 1 with the draft on its own GPU
#   hops    bench/aux_transport.py: the CUDA-IPC ring against the NCCL pair (reader on cuda:1)
#   serve   `dflash-serve serve --tp 2` on the tiny pair, one completion and the metrics
# Needs: fla and Ray Serve importable, or their wheels in .whl/ (tools/gpu/env.sh)
#        OUT=/some/dir bash tools/gpu/multi_gpu.sh [tests tpcheck bench hops serve]
# (each part's timeout: TESTS_TIMEOUT, TPCHECK_TIMEOUT, BENCH_TIMEOUT, HOPS_TIMEOUT seconds)
set -u
OUT=${OUT:-/tmp/gpu_multi}; mkdir -p "$OUT"
. tools/gpu/env.sh  # .whl/ → /tmp/site, PYTHONPATH
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
# NVLink multicast off: on hosts whose GPUs are shared, a program using it can take the GPUs
# out of service; the engine's all-reduces do not need it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT}  # transports
ngpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
sizes=$(for t in 2 4 8; do [ "$t" -le "$ngpu" ] && printf '%s ' "$t"; done)
parts=${*:-tests tpcheck bench hops serve}
. tools/gpu/serve_smoke.sh

for part in $parts; do case $part in
tests)
  timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/cluster/test_gpu_cluster.py tests/workers/test_aux_transport.py \
    > "$OUT/multi_gpu_tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|FAILED|ERROR" "$OUT/multi_gpu_tests.txt" | tail -15 ;;
tpcheck)
  timeout ${TPCHECK_TIMEOUT:-400} python3 -m tools.tp_check --preset qwen3.5-35b-a3b \
    --device cuda --dtype bfloat16 --tp $sizes --out "$OUT/tp_check.json" \
    > "$OUT/tp_check.log" 2>&1
  grep -v "NCCL INFO" "$OUT/tp_check.log" | tail -12 ;;
bench)
  for tp in 1 $sizes; do
    [ "$tp" -gt 4 ] && continue
    timeout ${BENCH_TIMEOUT:-300} python3 -m bench.engine --random-weights \
      --preset qwen3.5-35b-a3b --device cuda --tp $tp --batch-sizes 1 8 32 --block-sizes 16 \
      --prompt-len 512 --iters 10 --warmup 3 --out "$OUT/engine_tp$tp.json" \
      > "$OUT/engine_tp$tp.log" 2>&1
    grep -E "^\|" "$OUT/engine_tp$tp.log" | tail -5
  done
  if [ "$ngpu" -ge 2 ]; then
    timeout ${BENCH_TIMEOUT:-300} python3 -m bench.engine --random-weights \
      --preset qwen3.5-35b-a3b --device cuda --tp 1 --draft-placement separate \
      --batch-sizes 1 8 32 --block-sizes 16 --prompt-len 512 --iters 10 --warmup 3 \
      --out "$OUT/engine_tp1_separate.json" > "$OUT/engine_tp1_separate.log" 2>&1
    grep -E "^\|" "$OUT/engine_tp1_separate.log" | tail -5
  fi ;;
hops)
  timeout ${HOPS_TIMEOUT:-200} python3 -m bench.aux_transport --device cuda:0 \
    --pair-device cuda:1 --out "$OUT/aux_pair.json" 2>&1 | grep -v "NCCL INFO" | tail -6 ;;
serve)
  serve_smoke 2 serve_tp2 "^dflash_(spec_decode|requests_total)" ;;
esac; done
