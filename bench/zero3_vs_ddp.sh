#!/usr/bin/env bash
# ZeRO-3 step time against DDP's on 2 local ranks (issue 29, item 2), with
# and without recomputation, alternating the runs (A B C A B C) so that a
# busy machine weighs on all of them alike. Prints the median step_ms of
# steps 3..N of each run and peak RSS (KiB) per run.
#
#   bench/zero3_vs_ddp.sh [PRESET] [STEPS] [MICRO]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-gpt-10m}; steps=${2:-20}; micro=${3:-2}
case $preset in llama-*) arch=llama ;; *) arch= ;; esac
BIN=${CARGO_TARGET_DIR:-target}/release/phalanx
[ -x "$BIN" ] || { echo "zero3_vs_ddp.sh: $BIN not found: build first (cargo build --release -p phalanx-cli)" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
lscpu | grep -E 'Model name|^CPU\(s\)'; git rev-parse --short HEAD
run() { # name, extra sets...
  local name=$1; shift
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  /usr/bin/time -f '%M' -o "$out/$name.rss" "$BIN" train --nproc-per-node 2 \
    --set model.preset="$preset" ${arch:+--set model.arch=$arch} --set train.steps="$steps" --set train.micro_batch_size="$micro" \
    --set train.eval_interval=0 --set log.plot='""' --set log.report='""' \
    --log-json "$out/$name.jsonl" ${sets[@]+"${sets[@]}"} > /dev/null
  python3 - "$out/$name.jsonl" "$name" "$(cat "$out/$name.rss")" <<'PY'
import json, sys, statistics
r = [json.loads(l) for l in open(sys.argv[1])]
ms = statistics.median(x["step_ms"] for x in r[3:])
print(f"{sys.argv[2]:<14} median step {ms:8.1f} ms  loss@last {r[-1]['loss']:.4f}  launcher peak RSS {sys.argv[3]} KiB")
PY
}
for round in 1 2; do
  run ddp
  run zero3 zero_optimization.stage=3
  run zero3-full zero_optimization.stage=3 'train.activation_checkpointing="full"'
  run zero3-reuse zero_optimization.stage=3 zero_optimization.stage3_max_reuse_distance=1e9
done
