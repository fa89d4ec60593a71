#!/usr/bin/env bash
# The GPU fast path on one GPU host without package access: every `gpu` test of the engine
# (kernels against their references, the golden invariant on CUDA), then bench/engine.py on
# the real 35B-A3B architecture with random weights. Results under $OUT.
#   ../shared/tools/device-wheels.sh          # fills .whl/ (fla) on a machine with pip
#   OUT=/some/dir bash tools/gpu_fastpath_check.sh [extra bench/engine.py args]
set -u
OUT=${OUT:-/tmp/gpu_fastpath_check}; mkdir -p "$OUT"
if ls .whl/fla*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/fla_core*.whl .whl/flash_linear*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/target tests/workers \
  tests/cluster/test_gpu_cluster.py -k "not ray" 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
for dtype in float32 bfloat16; do  # the golden invariant on CUDA, 100 prompts
  timeout 240 python3 -m tools.golden_check --model tests/assets/tiny/target \
    --draft-model tests/assets/tiny/draft --device cuda --dtype $dtype --num-prompts 100 \
    --max-tokens 64 --block-size 16 --out "$OUT/golden_$dtype.json" 2>&1 | tail -12
done
timeout 420 python3 -m bench.engine --random-weights --preset qwen3.5-35b-a3b --device cuda \
  --batch-sizes 1 8 32 --block-sizes 8 16 --prompt-len 512 --iters 5 --warmup 2 \
  --out "$OUT/engine.json" "$@" 2>&1 | grep -v "falling back" | tail -8 | tee "$OUT/engine.txt"
# The same with FlexAttention for rounds (opt-in until this comparison picks it).
timeout 360 python3 -m bench.engine --random-weights --preset qwen3.5-35b-a3b --device cuda \
  --batch-sizes 1 8 32 --block-sizes 16 --prompt-len 512 --iters 5 --warmup 2 --no-baseline \
  --attention flex --draft-attention flex --out "$OUT/engine_flex.json" 2>&1 | grep -v "falling back" | tail -6 \
  | tee "$OUT/engine_flex.txt"
