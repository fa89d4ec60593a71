#!/usr/bin/env bash
# One device call: the gpu tests, the golden check (fp32 and bf16, 100 prompts) and a profile
# of the decode / verify / draft steps at batch 1 and 8 on the 35B-A3B architecture. $OUT.
set -u
OUT=${OUT:-/tmp/gpu_profile}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/fla_core*.whl .whl/flash_linear*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x -m gpu tests/target tests/workers tests/draft \
  tests/cluster/test_gpu_cluster.py -k "not ray" 2>&1 | tail -25 > "$OUT/gpu_tests.txt"
tail -3 "$OUT/gpu_tests.txt"
for dtype in float32 bfloat16; do
  timeout 100 python3 -m tools.golden_check --model tests/assets/tiny/target \
    --draft-model tests/assets/tiny/draft --device cuda --dtype $dtype --num-prompts 100 \
    --max-tokens 64 --block-size 16 --out "$OUT/golden_$dtype.json" 2>&1 | tail -4
done
for b in 1 8; do
  timeout 150 python3 -m bench.profile_step --device cuda --batch $b --block-size 16 \
    --out-dir "$OUT/prof" ${PROFILE_ARGS:-} 2>&1 | grep '^{' 
done
