#!/usr/bin/env bash
# The GPU fast path on one GPU host, in parts (default: tests profile golden bench), results
# under $OUT:
#   tests    every `gpu` test of the engine (kernels against their references, CUDA graphs,
#            bench.engine's device share of a step)
#   kernels  the Triton kernels' interpreter tests, here on CUDA (against their references; the
#            bits: a token alone = in a batch, a block = its tokens one by one, the pair
#            GEMVs' prefetch = none)
#   moetests the routed-expert and routing tests alone, and the pair / sorted kernels' bf16
#            consistency at real sizes (alone vs batched; against grouped / pairs)
#   profile  bench/profile_step.py at batch 1 (CUDA graphs; PROFILE_VARIANT: KernelConfig fields
#            over the defaults, e.g. "gdn_prologue=triton", written to profile_b1_variant.txt;
#            PROFILE_ARGS: more arguments, e.g. "--prompt-len 131072 --kinds decode verify
#            --steps 10 --repeats 3": three runs' kernels, each over fresh caches and graphs)
#   golden   the golden invariant on CUDA with graphs on (fp32 and bf16, 100 prompts;
#            GOLDEN_KERNELS: kernel overrides, field=value[,…], e.g. pdl=off)
#   bench    bench/engine.py on the real 35B-A3B architecture with random weights, batch 1, 8
#            and 32, B = 8 and 16, 512 tokens of context, against the floors and transformers
#   variants bench/engine.py in one process: the default kernels, then each of VARIANTS
#            (KernelConfig fields, e.g. "pdl=off pdl=on"; the defaults again give the
#            same-run spread), at LENS tokens of context (default 512) and BATCHES (default
#            1 8), B = 16; a second table gives each run's clocks, temperature, power and
#            the caching allocator's state, before and after its timings
#   moe      bench/moe_kernel.py: the pair GEMVs and the sorted-pair block GEMMs against the
#            grouped GEMMs, 1-128 tokens (MOE_ARGS: more arguments, e.g. "--kinds pair")
#   linear   bench/linear_kernel.py: each dense projection, and each group that reads the same
#            input as one GEMM, 1-16 rows
#   gdn      bench/gdn_kernel.py: the GDN recurrence by slot, and the torch / Triton prologue
#            and output norm, at decode and a B = 16 verify and its commit, 1 and 8 sequences
#   attention bench/round_attention.py: the Triton split-keys attention against the gathered
#            pages at 512 to 128k keys, 1 and 8 sequences, 1 and 16 queries
# Needs: a CUDA GPU; fla (flash-linear-attention, fla-core), dflash==0.1.0 (the tests'
# reference draft) and nvidia-ml-py (bench.engine's clock readings) importable, or their wheels
# in .whl/ on a host without package access (tools/gpu/env.sh installs them).
#        OUT=/some/dir bash tools/gpu/fastpath.sh [PART…]
# (each part's timeout: TESTS_TIMEOUT, PROFILE_TIMEOUT, GOLDEN_TIMEOUT, BENCH_TIMEOUT seconds)
set -u
OUT=${OUT:-/tmp/gpu_fastpath}; mkdir -p "$OUT"
. tools/gpu/env.sh  # .whl/ → /tmp/site, PYTHONPATH
python3 -c "import fla" 2>/dev/null || echo "WARNING: fla missing: GDN runs the torch reference"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
parts=${*:-tests profile golden bench}

for part in $parts; do case $part in
tests)
  gpu_pytest ${TESTS_TIMEOUT:-360} -q -p no:cacheprovider -p no:logging -rfE \
    --tb=short --continue-on-collection-errors -m gpu tests/target tests/workers tests/draft \
    tests/cluster/test_gpu_cluster.py tests/tools/test_bench_engine.py -k "not ray" \
    > "$OUT/gpu_tests.txt" 2>&1
  tail -12 "$OUT/gpu_tests.txt" ;;
kernels)  # the Triton kernels' tests that run in the interpreter on CPU, here on CUDA: each
  # kernel against its reference, and the bits (alone = in a batch, a block = its tokens
  # decoded one by one, the pairs' prefetch = none) at the real dtypes, where launch shapes
  # set the order
  gpu_pytest ${TESTS_TIMEOUT:-360} -q -p no:cacheprovider -p no:logging -rfE \
    --tb=short -m "not gpu" tests/target/test_attention_triton.py \
    tests/target/test_gdn_slots.py tests/target/test_gdn_prologue.py \
    tests/target/test_qk_rope_triton.py tests/target/test_moe_triton.py \
    tests/target/test_moe_sorted.py tests/target/test_moe_route.py \
    > "$OUT/gpu_kernel_tests.txt" 2>&1
  tail -4 "$OUT/gpu_kernel_tests.txt" ;;
moetests)
  gpu_pytest ${TESTS_TIMEOUT:-240} -q -p no:cacheprovider -p no:logging -rfE \
    --tb=short -m gpu tests/target/test_moe_triton.py tests/target/test_moe_kernel.py \
    tests/target/test_moe_sorted.py tests/target/test_moe_route.py \
    > "$OUT/gpu_moe_tests.txt" 2>&1
  tail -4 "$OUT/gpu_moe_tests.txt"
  PYTHONPATH=tests/target:$PYTHONPATH timeout ${TESTS_TIMEOUT:-240} python3 -c "
import json
import test_moe_sorted, test_moe_triton
print(json.dumps({name: {t: m.consistency('cuda', t, 8, 256, 2048, 512) for t in (1, 16, 40)}
                  for name, m in (('pairs', test_moe_triton), ('sorted', test_moe_sorted))}))" \
    | tee "$OUT/moe_consistency.json" ;;
profile)  # batch 1, CUDA graphs
  timeout ${PROFILE_TIMEOUT:-150} python3 -m bench.profile_step --device cuda --batch 1 \
    --block-size 16 --out "$OUT/profile_b1${PROFILE_VARIANT:+_variant}.txt" \
    ${PROFILE_VARIANT:+--variant $PROFILE_VARIANT} ${PROFILE_ARGS:-} 2>&1 \
    | grep -E '^\{|Error|error' | tail -12 ;;
golden)
  for dtype in ${GOLDEN_DTYPES:-float32 bfloat16}; do
    timeout ${GOLDEN_TIMEOUT:-150} python3 -m tools.golden_check --model tests/assets/tiny/target \
      --draft-model tests/assets/tiny/draft --device cuda --dtype $dtype --num-prompts 100 \
      --max-tokens 64 --block-size 16 --kernel-overrides "${GOLDEN_KERNELS:-}" \
      --out "$OUT/golden_$dtype.json" 2>&1 | tail -6
  done ;;
bench)
  timeout ${BENCH_TIMEOUT:-420} python3 -m bench.engine --random-weights \
    --preset qwen3.5-35b-a3b --device cuda --batch-sizes 1 8 32 --block-sizes 8 16 \
    --prompt-len 512 --iters 10 --warmup 3 --out "$OUT/engine.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log" | grep -v "falling back" | tail -8 ;;
moe)
  timeout ${MOE_TIMEOUT:-240} python3 -m bench.moe_kernel --device cuda --out "$OUT/moe_kernel.json" \
    ${MOE_ARGS:-} 2>&1 | tee "$OUT/moe_kernel.log" | tail -40 ;;
linear)
  timeout ${LINEAR_TIMEOUT:-180} python3 -m bench.linear_kernel --device cuda --iters 10 \
    --out "$OUT/linear_kernel.json" 2>&1 | tee "$OUT/linear_kernel.log" \
    | grep -E "^device|(2048×4096|2048×512).*\| (1|16) \|" ;;
gdn)
  timeout ${GDN_TIMEOUT:-240} python3 -m bench.gdn_kernel --device cuda \
    --out "$OUT/gdn_kernel.json" 2>&1 | tee "$OUT/gdn_kernel.log" | tail -40 ;;
variants)
  timeout ${BENCH_TIMEOUT:-420} python3 -m bench.engine --random-weights \
    --preset qwen3.5-35b-a3b --device cuda --batch-sizes ${BATCHES:-1 8} --block-sizes 16 \
    --no-baseline --prompt-len ${LENS:-512} --iters ${ITERS:-10} --warmup 3 \
    --variants ${VARIANTS:?VARIANTS: KernelConfig fields, e.g. "pdl=off pdl=on"} \
    --out "$OUT/engine_variants.json" 2>&1 | tee "$OUT/engine_variants.log" \
    | grep -v "falling back" | grep "^|" ;;
attention)
  timeout ${ATTN_TIMEOUT:-300} python3 -m bench.round_attention \
    --keys 512 2048 8192 32768 131072 --seqs 1 8 --widths 1 16 \
    --out "$OUT/round_attention.json" 2>&1 | tee "$OUT/round_attention.log" | tail -20 ;;
esac; done
