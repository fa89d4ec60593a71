#!/usr/bin/env bash
# The GPU fast path on one GPU host without package access, in parts (default: all), results
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
#   bench    bench/engine.py on the real 35B-A3B architecture with random weights
#   nofuse   the same without the compiled elementwise chains (--no-fuse), B = 16, no baseline
#   moe      bench/moe_kernel.py: the pair GEMVs and the sorted-pair block GEMMs (a few launch
#            shapes each, the pairs' with and without prefetch) against the grouped GEMMs,
#            1-128 tokens (MOE_ARGS: more arguments, e.g. "--kinds pair --tokens 1 2 4")
#   linear   bench/linear_kernel.py: each dense projection, and each group that reads the same
#            input as one GEMM, 1-16 rows
#   longab   bench/engine.py at batch 1, B = 16, at 512 and 131,072 tokens of context (AB_LENS:
#            others, in the order given), in one process: the defaults, then each of
#            AB_VARIANTS (KernelConfig fields; by default PDL off and on alternately, pdl=off
#            pdl=on (the defaults again) pdl=off: a process's later contexts ran up to 0.19 ms
#            slower than its first on an H100, so an A/B alternates; a second table gives each
#            run's SM and memory clocks, temperature, power and the caching allocator's
#            reserved GiB and segments, before and after its timings)
#   procs    bench/engine.py with the defaults alone at batch 1, B = 16, at AB_LENS (default
#            131,072), PROCS separate processes in turn (default 3), 20 steps each: a
#            figure from each process's first run, the one a server's start gives, and each
#            step's ms in the JSON (the spread within a run against the spread between runs;
#            PROCS_ENV: environment for them, e.g.
#            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"; PROCS_TAG: in the files'
#            names, so that a second set does not overwrite the first)
#   gdn      bench/gdn_kernel.py: the GDN recurrence by slot at five launch shapes, and the
#            torch / Triton prologue and output norm, at decode and a B = 16 verify and its
#            commit, 1 and 8 sequences
#   attnsweep bench/round_attention.py: the Triton attention with the engine's adaptive splits
#            (split² ≥ 4 · keys, at most 256), at most 128 and 32 splits alone, and the fixed
#            split, at 512 to 128k keys, 1 and 8 sequences, 1 and 16 queries (CUDA-graph replays)
#   attnlong bench/round_attention.py at 32k and 128k keys, 1 and 8 sequences, 1 and 16
#            queries: the engine's launch (16-row tiles for the launches whose rows fit, a
#            decode's; 32-row mma.sync tiles for the rest, a verify block's) against 32-row
#            tiles for all, and against 64- and 128-row tiles in 8 warps for the rest (wgmma
#            on sm90; the fifteenth session's sweep of one-field changes is in
#            docs/BENCHMARKS.md)
#   midctx   bench/engine.py at 8,192 tokens of context, batch 1 and 8, B = 16, in one process:
#            the defaults twice (the same-run spread), where the attention's split rule and the
#            draft's context attention weigh more than at 512
#   variants bench/engine.py at batch 1 and 8, B = 16, in one process: the default kernels, then
#            each kernel variant (VARIANTS, KernelConfig fields; by default the two Triton
#            prologues taken back: both, then each alone), then the defaults again (the spread)
# Usage: pip download --no-deps -d .whl flash-linear-attention fla-core   (on a machine with pip)
#        pip download --no-deps dflash==0.1.0 -d .whl   (the tests' reference draft)
#        pip download --no-deps nvidia-ml-py -d .whl   (NVML for bench.engine's gpu_state)
#        OUT=/some/dir bash tools/gpu_fastpath_check.sh [tests profile golden bench]
# (each part's timeout: TESTS_TIMEOUT, PROFILE_TIMEOUT, GOLDEN_TIMEOUT, BENCH_TIMEOUT seconds)
# (the device tool: carry .whl)
set -u
OUT=${OUT:-/tmp/gpu_fastpath_check}; mkdir -p "$OUT"
. tools/device_env.sh  # .whl/ → /tmp/site, PYTHONPATH
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
nofuse)
  timeout ${BENCH_TIMEOUT:-420} python3 -m bench.engine --random-weights --no-fuse \
    --preset qwen3.5-35b-a3b --device cuda --batch-sizes 1 8 32 --block-sizes 16 --no-baseline \
    --prompt-len 512 --iters 10 --warmup 3 --out "$OUT/engine_nofuse.json" 2>&1 \
    | tee "$OUT/bench_nofuse.log" | grep -v "falling back" | tail -6 ;;
moe)
  timeout ${MOE_TIMEOUT:-240} python3 -m bench.moe_kernel --device cuda --out "$OUT/moe_kernel.json" \
    ${MOE_ARGS:-} 2>&1 | tee "$OUT/moe_kernel.log" | tail -40 ;;
linear)
  timeout ${LINEAR_TIMEOUT:-180} python3 -m bench.linear_kernel --device cuda --iters 10 \
    --out "$OUT/linear_kernel.json" 2>&1 | tee "$OUT/linear_kernel.log" \
    | grep -E "^device|(2048×4096|2048×512).*\| (1|16) \|" ;;
longab)
  timeout ${BENCH_TIMEOUT:-540} python3 -m bench.engine --random-weights \
    --preset qwen3.5-35b-a3b --device cuda --batch-sizes 1 --block-sizes 16 --no-baseline \
    --prompt-len ${AB_LENS:-512 131072} --iters 5 --warmup 2 \
    --variants ${AB_VARIANTS:-pdl=off pdl=on pdl=off} \
    --out "$OUT/engine_longab.json" 2>&1 | tee "$OUT/engine_longab.log" \
    | grep -v "falling back" | grep "^|" ;;
procs)
  for i in $(seq 1 ${PROCS:-3}); do
    env ${PROCS_ENV:-} timeout ${BENCH_TIMEOUT:-200} python3 -m bench.engine --random-weights \
      --preset qwen3.5-35b-a3b --device cuda --batch-sizes 1 --block-sizes 16 --no-baseline \
      --prompt-len ${AB_LENS:-131072} --iters 20 --warmup 3 \
      --out "$OUT/engine_proc${PROCS_TAG:-}$i.json" 2>&1 \
      | tee "$OUT/engine_proc${PROCS_TAG:-}$i.log" \
      | grep -v "falling back" | grep "^| baseline"
  done ;;
gdn)
  timeout ${GDN_TIMEOUT:-240} python3 -m bench.gdn_kernel --device cuda \
    --out "$OUT/gdn_kernel.json" 2>&1 | tee "$OUT/gdn_kernel.log" | tail -40 ;;
attnsweep)  # "triton" is the engine's launch (adaptive splits); the --launch fields end in
  # max_splits (0: the fixed 1024-key split) and split_ratio (0: none)
  timeout ${ATTN_TIMEOUT:-300} python3 -m bench.round_attention \
    --keys 512 2048 8192 32768 131072 --seqs 1 8 --widths 1 16 --forms triton \
    --launch 1024,32,64,4,2,32,0,0 1024,32,64,4,2,32,128,0 1024,32,64,4,2,32,32,0 \
    --out "$OUT/round_attention.json" 2>&1 | tee "$OUT/round_attention.log" | tail -20 ;;
attnlong)  # the --launch fields: split, rows, keys per step, warps, stages, merge chunk,
  # max_splits, split_ratio, small_rows (the engine's: 1024,32,64,4,2,32,256,4,16)
  timeout ${ATTN_TIMEOUT:-300} python3 -m bench.round_attention \
    --keys 32768 131072 --seqs 1 8 --widths 1 16 --forms triton \
    --launch 1024,32,64,4,2,32,256,4,0 1024,64,64,8,2,32,256,4,16 \
    1024,128,64,8,2,32,256,4,16 \
    --out "$OUT/round_attention_long.json" 2>&1 | tee "$OUT/round_attention_long.log" | tail -20 ;;
midctx)
  timeout ${BENCH_TIMEOUT:-420} python3 -m bench.engine --random-weights \
    --preset qwen3.5-35b-a3b --device cuda --batch-sizes 1 8 --block-sizes 16 --no-baseline \
    --prompt-len 8192 --iters 5 --warmup 2 --variants moe=auto \
    --out "$OUT/engine_midctx.json" 2>&1 | tee "$OUT/engine_midctx.log" \
    | grep -v "falling back" | tail -8 ;;
variants)
  timeout ${BENCH_TIMEOUT:-420} python3 -m bench.engine --random-weights \
    --preset qwen3.5-35b-a3b --device cuda --batch-sizes 1 8 --block-sizes 16 --no-baseline \
    --prompt-len 512 --iters 10 --warmup 3 \
    --variants ${VARIANTS:-attention_prologue=torch,gdn_prologue=torch attention_prologue=torch gdn_prologue=torch moe=auto} \
    --out "$OUT/engine_variants.json" 2>&1 | tee "$OUT/engine_variants.log" \
    | grep -v "falling back" | tail -12 ;;
esac; done
