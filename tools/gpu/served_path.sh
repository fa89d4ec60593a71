#!/usr/bin/env bash
# The served path against the engine on one GPU host, in parts (default: all), results under $OUT:
#   tests    the GPU tests of the cluster path (CUDA-IPC ring with its release counter, the
#            engine on Ray actors over the control channel), the CUDA graph runners, the channel
#   inproc   bench/engine.py in process: batch 1 and 8, B = 16, real 35B-A3B shapes, dummy weights
#   inproc_torch  the same with --attention torch (the paged attention's baseline)
#   cluster  the same through the cluster path (--tp 1: Ray actors, step loops, the channel)
#   serve    `dflash-serve serve --load-format dummy` on the 35B-A3B architecture (the tiny
#            demo's tokenizer), without a draft (AR) and with one (DFlash, B = 16), each measured
#            by bench/serving.py at concurrency 1 and 8 (512-token prompts, 128 tokens)
#   acceptance  bench/engine.py --acceptance: plain decoding, DFlash (B = 16) and the adaptive
#            draft length at acceptance lengths $TAUS (default 1 3 6.3; the draft's proposals
#            replayed from the target's recorded output), batch 1, 8, 32, in process
#   spec_served  three servers, plain, DFlash B = 16 and adaptive, the two with the draft's
#            proposals replayed at acceptance $TAU (default 6.3; --acceptance-replay), each
#            measured by bench/serving.py --record-first at concurrency $SPEC_LEVELS
#            (default 1 4 8 16 32; --max-num-seqs in SERVE_ARGS must reach the highest)
#   prefix_inproc  bench/prefix.py: the multi-turn conversation in process (35B-A3B shapes,
#            random weights), with and without the prefix cache, per-turn TTFT and prefill steps
#   prefix   the same DFlash server with and without the prefix cache, each measured by
#            bench/serving.py's multi-turn (a 16k history, 8 turns of +512 / 256 tokens) and
#            shared-prefix (32 requests, a 32k prefix, 256-token questions, concurrency 8)
#            workloads (needs --max-model-len ≥ 33,300 in SERVE_ARGS; PREFIX_MODES=on or off
#            runs one of the two servers)
# Needs: fla, Ray Serve and the openai client importable, or their wheels in .whl/ on a host
#        without package access (pip download --no-deps; tools/gpu/env.sh installs them);
#        bench/serving.py needs the client's own: openai, httpx2, httpcore2, truststore,
#        jiter, sniffio, h11, distro, prometheus_client
#        OUT=/some/dir bash tools/gpu/served_path.sh [tests inproc inproc_torch cluster serve]
# (timeouts: TESTS_TIMEOUT, BENCH_TIMEOUT, SERVE_TIMEOUT (each bench/serving.py run) and
#  SERVER_TIMEOUT (each server's whole life) seconds; BENCH_ITERS, SERVE_PROMPTS;
#  SERVE_ONLY=spec skips the AR server; SERVE_ARGS adds serve flags: on an 80 GB H100 the 35B-A3B
#  pair's weights (64.6 + 2.8 GiB) leave no KV pages at the defaults, so there
#  SERVE_ARGS="--max-model-len 32768 --max-num-seqs 8 --gpu-memory-utilization 0.97")
set -u
OUT=${OUT:-/tmp/gpu_served_path}; mkdir -p "$OUT"
. tools/gpu/env.sh  # .whl/ → /tmp/site, PYTHONPATH
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, ray, fla; print('torch', torch.__version__, 'ray', ray.__version__)" \
  | tee -a "$OUT/gpu.txt"
nproc | tee -a "$OUT/gpu.txt"
ITERS=${BENCH_ITERS:-20}
BENCH="--random-weights --preset qwen3.5-35b-a3b --device cuda --batch-sizes 1 8 --block-sizes 16
  --prompt-len 512 --iters $ITERS --warmup 3 --no-baseline"

PORT=8123
start_server() {  # name, extra serve flags; status 1 (after its errors) where it did not start
  local name=$1; shift
  local dirs=/tmp/dummy_35b
  python3 -m configs.presets qwen3.5-35b-a3b $dirs --tokenizer-from tests/assets/tiny/target \
    > /dev/null
  local t0=$SECONDS
  timeout ${SERVER_TIMEOUT:-1200} python3 -m deploy.cli serve --model $dirs/target "$@" \
    --load-format dummy --tp 1 --device cuda --port $PORT --served-model-name dummy ${SERVE_ARGS:-} \
    > "$OUT/serve_$name.log" 2>&1 &
  for _ in $(seq 300); do sleep 1; grep -q "Ctrl-C\|Error\|error:" "$OUT/serve_$name.log" && break; done
  if ! grep -q "Ctrl-C" "$OUT/serve_$name.log"; then
    echo "$name: did not start ($((SECONDS - t0)) s):" | tee -a "$OUT/serve_times.txt"
    grep -E "Error|error:" "$OUT/serve_$name.log" | tail -2 | cut -c1-600
    stop_server 10
    return 1
  fi
  echo "$name: ready after $((SECONDS - t0)) s" | tee -a "$OUT/serve_times.txt"
}

serve_and_measure() {  # name, extra serve flags
  local name=$1 port=$PORT
  start_server "$@" || return
  timeout ${SERVE_TIMEOUT:-420} python3 -m bench.serving --base-url http://127.0.0.1:$port \
    --concurrency 1 8 --num-prompts ${SERVE_PROMPTS:-16} --prompt-len 512 --output-len 128 \
    --out-dir "$OUT/serving_$name" 2>&1 | tail -8
  curl -s localhost:$port/metrics | grep -E "^dflash_(draft|verify)_time_per_round_seconds_(sum|count)" \
    > "$OUT/metrics_$name.txt"
  stop_server 10
  grep -v "NCCL INFO" "$OUT/serve_$name.log" | grep -iE "warm-up|error|Traceback" | tail -3
}

parts=${*:-tests inproc cluster serve}
for part in $parts; do case $part in
tests)
  gpu_pytest ${TESTS_TIMEOUT:-300} -q -p no:cacheprovider -rfE --tb=short \
    tests/cluster/test_gpu_cluster.py tests/workers/test_aux_transport.py \
    tests/workers/test_cuda_graphs.py tests/workers/test_channel.py > "$OUT/gpu_tests.txt" 2>&1
  tail -6 "$OUT/gpu_tests.txt" ;;
inproc)
  timeout ${BENCH_TIMEOUT:-300} python3 -m bench.engine $BENCH --out "$OUT/engine_inproc.json" \
    2>&1 | tee "$OUT/bench_inproc.log" | grep -v "falling back" | tail -4 ;;
inproc_torch)  # the same with the torch attention (gathered pages): the kernel's baseline
  timeout ${BENCH_TIMEOUT:-300} python3 -m bench.engine $BENCH --attention torch \
    --out "$OUT/engine_inproc_torch.json" 2>&1 | grep -v "falling back" | tail -4 ;;
cluster)
  timeout ${BENCH_TIMEOUT:-300} python3 -m bench.engine $BENCH --tp 1 \
    --out "$OUT/engine_tp1.json" 2>&1 | tee "$OUT/bench_tp1.log" | grep -v "falling back" \
    | tail -5 ;;
serve)
  [ "${SERVE_ONLY:-}" = spec ] || serve_and_measure ar
  serve_and_measure spec --draft-model /tmp/dummy_35b/draft --speculative-dflash-block-size 16 ;;
spec_served)  # the same over HTTP at one acceptance: plain, DFlash B = 16, adaptive servers
  tau=${TAU:-6.3}
  for mode in plain fixed adaptive; do
    flags=(--no-enable-prefix-caching)  # the measured pass prefills as the recording did
    [ $mode != plain ] && flags+=(--draft-model /tmp/dummy_35b/draft
      --speculative-dflash-block-size 16 --acceptance-replay "$tau")
    [ $mode = adaptive ] && flags+=(--speculative-adaptive)
    start_server spec_$mode "${flags[@]}" || continue
    timeout ${SERVE_TIMEOUT:-420} python3 -m bench.serving --base-url http://127.0.0.1:$PORT \
      --concurrency ${SPEC_LEVELS:-1 4 8 16 32} --num-prompts ${SERVE_PROMPTS:-32} \
      --prompt-len 512 --output-len 128 --record-first --out-dir "$OUT/spec_$mode" 2>&1 \
      | tail -${SPEC_TAIL:-9}
    grep -E "adaptive speculation|memory plan" "$OUT/serve_spec_$mode.log" | cut -c1-400
    stop_server 10
  done ;;
acceptance)  # plain decoding, DFlash B = 16 and adaptive at chosen acceptances, in process
  timeout ${BENCH_TIMEOUT:-300} python3 -m bench.engine --random-weights \
    --preset qwen3.5-35b-a3b --device cuda --acceptance ${TAUS:-1 3 6.3} --adaptive \
    --batch-sizes ${ACCEPTANCE_BATCHES:-1 8 32} --block-sizes 16 --prompt-len 512 \
    --output-len 128 --gpu-memory-utilization 0.97 --out "$OUT/acceptance.json" 2>&1 \
    | grep -vE "falling back|NCCL INFO" | tail -16 ;;
prefix_inproc)  # the multi-turn conversation in process, with and without the cache
  timeout ${BENCH_TIMEOUT:-300} python3 -m bench.prefix --preset qwen3.5-35b-a3b --device cuda \
    --max-model-len 32768 --max-num-seqs 8 --gpu-memory-utilization 0.97 \
    --out "$OUT/prefix_inproc.json" 2>&1 | grep -vE "falling back|NCCL INFO" | tail -12 ;;
prefix)  # the prefix cache's workloads, with the cache (on) and without it (off)
  for mode in ${PREFIX_MODES:-on off}; do
    flags=(--draft-model /tmp/dummy_35b/draft --speculative-dflash-block-size 16)
    [ $mode = off ] && flags+=(--no-enable-prefix-caching)
    start_server prefix_$mode "${flags[@]}" || continue
    url=http://127.0.0.1:$PORT
    timeout ${SERVE_TIMEOUT:-420} python3 -m bench.serving --base-url $url --workload multi-turn \
      --history-len 16384 --turns 8 --turn-len 512 --output-len 256 \
      --out-dir "$OUT/prefix_$mode" 2>&1 | grep -E "^turn|Error" | cut -c1-300
    timeout ${SERVE_TIMEOUT:-420} python3 -m bench.serving --base-url $url \
      --workload shared-prefix --num-prompts 32 --shared-len 32768 --question-len 256 \
      --concurrency 8 --output-len 128 --out-dir "$OUT/prefix_$mode" 2>&1 \
      | grep -E "^shared|Error" | cut -c1-300
    curl -s $url/metrics | grep -E "^dflash_(prefix_cache|draft_time|verify_time)" \
      > "$OUT/metrics_prefix_$mode.txt"
    grep -E "prefix cache|snapshots" "$OUT/serve_prefix_$mode.log" | head -2 | cut -c1-300
    stop_server 10
  done ;;
esac; done
