#!/usr/bin/env bash
# An A/B of two trees on one GPU host: the working tree ("new") against another commit
# ("base"), their runs alternating on the same machine, so that the machine-to-machine spread
# (0.2–0.4 ms of a decode step between GPUs of one model) does not pass for an effect.
#   bash tools/gpu/ab_tree.sh prepare COMMIT      # .ab_base/ = COMMIT's Python packages
#   (copy .ab_base/ and .whl/ to the GPU host with the working tree)
#   OUT=/some/dir ROUNDS=2 bash tools/gpu/ab_tree.sh run -- ARGS…   # base, new, base, new…
# `run` passes ARGS to `python3 -m bench.engine` (e.g. --random-weights --preset
# qwen3.5-35b-a3b --device cuda --batch-sizes 1 --block-sizes 16 --prompt-len 512 --iters 10
# --warmup 3 --no-baseline), writes $OUT/ab_{base,new}_ROUND.json and prints each run's
# table rows prefixed with its tree and round. Each run's limit: AB_TIMEOUT seconds. AB_BASE
# names another directory for the base tree (both commands). Each run starts in its tree's
# directory: relative paths in ARGS resolve there (the base tree has no tests/assets).
set -u
PACKAGES="bench cluster configs deploy draft target tools workers"
BASE=${AB_BASE:-.ab_base}
case $BASE in ""|.|./|/) echo "AB_BASE must name a directory of its own" >&2; exit 2 ;; esac
case ${1:-} in
prepare)
  commit=${2:?usage: tools/gpu/ab_tree.sh prepare COMMIT}
  rm -rf "$BASE" && mkdir -p "$BASE"
  # shellcheck disable=SC2086  # the package list splits into paths
  git archive "$commit" $PACKAGES | tar -x -C "$BASE"
  git rev-parse "$commit" > "$BASE/COMMIT"
  echo "$BASE: $(cat "$BASE/COMMIT") ($(du -sh "$BASE" | cut -f1))" ;;
run)
  shift; [ "${1:-}" = -- ] && shift
  [ -f "$BASE/COMMIT" ] || { echo "no $BASE: run 'prepare COMMIT' first" >&2; exit 2; }
  OUT=${OUT:-/tmp/ab_tree}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
  # on a GPU host without package access: .whl/ → /tmp/site, PYTHONPATH
  command -v nvidia-smi > /dev/null && . tools/gpu/env.sh
  site=${PYTHONPATH:+:$PYTHONPATH}
  for round in $(seq "${ROUNDS:-2}"); do
    for tree in base new; do
      dir=$PWD; [ $tree = base ] && dir=$BASE
      # the tree's own packages first on the path, then the wheels and the rest
      (cd "$dir" && PYTHONPATH="$PWD$site" timeout "${AB_TIMEOUT:-150}" \
        python3 -m bench.engine "$@" --out "$OUT/ab_${tree}_$round.json" 2>&1 \
        | grep -E "^\| |Error" | grep -v "^| variant" | sed "s/^/$tree $round /")
    done
  done ;;
*)
  echo "usage: tools/gpu/ab_tree.sh prepare COMMIT | run -- BENCH_ENGINE_ARGS…" >&2; exit 2 ;;
esac
