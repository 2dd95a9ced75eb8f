#!/usr/bin/env bash
# Each row of the engine table as a fraction of its matrix-product ceiling
# (issue 29, item 4): `examples/gemm_ceiling` times every product of one
# step on one thread (the ceiling per core); `phalanx train` on 2 local
# ranks x 1 thread measures tokens/s (median of steps 3..N); the fraction
# is measured / (2 x the ceiling per core).
#
#   bench/ceiling_fraction.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
cargo build --release -q -p phalanx --example gemm_ceiling
cargo build --release -q -p phalanx-cli
lscpu | grep -E 'Model name|^CPU\(s\)'; git rev-parse --short HEAD
out=$(mktemp -d)
row() { # name micro ceiling-args... -- train sets...
  local name=$1 micro=$2; shift 2
  local cargs=()
  while [ "$1" != "--" ]; do cargs+=("$1"); shift; done; shift
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  local line ceil
  line=$(target/release/examples/gemm_ceiling "${cargs[@]}" 3)
  ceil=$(sed -n 's/.*ceiling \([0-9]*\) tokens.*/\1/p' <<<"$line")
  RAYON_NUM_THREADS=1 target/release/phalanx train --nproc-per-node 2 "${sets[@]}" \
    --set train.micro_batch_size="$micro" --set train.steps="$steps" \
    --set train.eval_interval=0 --set log.plot='""' --set log.report='""' \
    --log-json "$out/$name.jsonl" > /dev/null
  python3 - "$out/$name.jsonl" "$name" "$ceil" <<'PY'
import json, sys, statistics
r = [json.loads(l) for l in open(sys.argv[1])]
tps = statistics.median(x["tokens_per_s"] for x in r[3:])
ceil = 2 * int(sys.argv[3])
print(f"{sys.argv[2]:<10} measured {tps:8.0f} tokens/s, ceiling (2 cores) {ceil:8d}: {tps / ceil:.2f} of it")
PY
}
row gpt-50m 8 8 256 768 8 12 256 -- model.preset=gpt-50m
row llama-60m 4 llama 4 256 768 8 12 4 2560 256 -- model.arch=llama model.preset=llama-60m
rm -rf "$out"
