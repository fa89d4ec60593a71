# Sourced by the GPU check scripts. serve_smoke TP NAME METRICS_REGEX: `dflash-serve serve` on
# the tiny pair with --tp TP on CUDA (bf16), one completion and the /metrics lines matching
# METRICS_REGEX into $OUT/NAME.txt (server log $OUT/NAME.log), then SIGINT.
serve_smoke() {
  local tp=$1 name=$2 metrics=$3 port=8123
  timeout 200 python3 -m deploy.cli serve --model tests/assets/tiny/target \
    --draft-model tests/assets/tiny/draft --tp "$tp" --device cuda --dtype bfloat16 \
    --port $port > "$OUT/$name.log" 2>&1 &
  for _ in $(seq 90); do sleep 2; grep -q "Ctrl-C\|Error" "$OUT/$name.log" && break; done
  {
    curl -s localhost:$port/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "target", "prompt": "The quick brown fox", "max_tokens": 48, "ignore_eos": true}'
    echo
    curl -s localhost:$port/metrics | grep -E "$metrics"
  } | tee "$OUT/$name.txt"
  stop_server 8
  grep -v "NCCL INFO" "$OUT/$name.log" | tail -3
}
