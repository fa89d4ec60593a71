#!/usr/bin/env bash
# Long context on one GPU host (an H200's memory holds the 252k-token prompt), in parts
# (default: all), results under $OUT:
#   tests   the GPU tests of tests/target/test_long_context.py (the flash path with its
#           log-sum-exp on CUDA, a prompt in chunks against one piece through fla)
#   kernels the Triton split-keys attention's GPU tests; bench/round_attention.py (gathered
#           against triton at 8k, 32k and 128k keys)
#   bench   bench/engine.py at 8k, 32k and 128k tokens of context (prefill in the server's
#           8192-token chunks; decode, verify, proposal and round at that context), batch 1
#   serve   `dflash-serve serve --load-format dummy` on the 35B-A3B architecture with the
#           draft, --max-model-len 262144 --max-num-seqs 8, then bench/long_prompts.py: 32k,
#           128k and 252k-token prompts one after the other, then a 128k one with 4 short
#           streams beside it
# Needs: fla, Ray Serve and the openai client importable, or their wheels in .whl/ on a host
#        without package access (pip download --no-deps; tools/gpu/env.sh installs them)
#        OUT=/some/dir bash tools/gpu/long_context.sh [tests bench serve]
set -u
OUT=${OUT:-/tmp/gpu_long_context}; mkdir -p "$OUT"
. tools/gpu/env.sh
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
parts=${*:-kernels tests bench serve}
for part in $parts; do case $part in
kernels)
  gpu_pytest ${TESTS_TIMEOUT:-150} -q -p no:cacheprovider -rfE --tb=short \
    tests/target/test_attention_triton.py > "$OUT/gpu_triton_tests.txt" 2>&1
  tail -3 "$OUT/gpu_triton_tests.txt"
  timeout ${ROUND_TIMEOUT:-240} python3 -m bench.round_attention --keys 8192 32768 131072 \
    --out "$OUT/round_attention.json" 2>&1 | tail -12 ;;
tests)
  gpu_pytest ${TESTS_TIMEOUT:-150} -q -p no:cacheprovider -rfE --tb=short -m gpu \
    tests/target/test_long_context.py > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt" ;;
bench)
  timeout ${BENCH_TIMEOUT:-440} python3 -m bench.engine --random-weights \
    --preset qwen3.5-35b-a3b --device cuda --batch-sizes 1 --block-sizes 16 \
    --prompt-len 8192 32768 131072 --iters 5 --warmup 2 --no-baseline \
    --out "$OUT/long_context.json" > "$OUT/bench.log" 2>&1
  grep -v "falling back" "$OUT/bench.log" | tail -5 ;;
serve)
  dirs=/tmp/dummy_35b port=8123
  python3 -m configs.presets qwen3.5-35b-a3b $dirs --tokenizer-from tests/assets/tiny/target \
    > /dev/null
  t0=$SECONDS
  timeout ${SERVE_TIMEOUT:-400} python3 -m deploy.cli serve --model $dirs/target \
    --draft-model $dirs/draft --load-format dummy --tp 1 --device cuda --port $port \
    --served-model-name dummy --max-model-len 262144 --max-num-seqs 8 \
    > "$OUT/serve.log" 2>&1 &
  for _ in $(seq 300); do sleep 1; grep -q "Ctrl-C\|Error\|error:" "$OUT/serve.log" && break; done
  echo "ready after $((SECONDS - t0)) s"
  grep -v "NCCL INFO" "$OUT/serve.log" | grep -iE "kv pages|pool|warm-up|attention" | tail -4
  timeout ${PROMPTS_TIMEOUT:-240} python3 -m bench.long_prompts --base-url http://127.0.0.1:$port \
    --lengths 32768 131072 258048 --max-tokens 16 --vocab 248320 --out "$OUT/long_prompts.json"
  timeout ${PROMPTS_TIMEOUT:-240} python3 -m bench.long_prompts --base-url http://127.0.0.1:$port \
    --lengths 131072 --max-tokens 16 --vocab 248320 --with-short 4 \
    --out "$OUT/long_prompts_mixed.json"
  curl -s localhost:$port/metrics | grep -E "^dflash_(kv|cache|num_requests)" | head -8
  stop_server 8
  grep -v "NCCL INFO" "$OUT/serve.log" | grep -iE "error|Traceback|OutOfMemory" | tail -5 ;;
esac; done
