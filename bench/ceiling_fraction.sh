#!/usr/bin/env bash
# Each row of the engine table as a fraction of its matrix-product ceiling
# (issue 29, item 4): `examples/gemm_ceiling` times every product of one
# step on one thread; `phalanx train` on 2 local ranks x 1 thread measures
# tokens/s (median of steps 3..N).
#
# The ceiling of the 2-core step is taken the way the step runs: two
# gemm_ceiling processes at once, one per core, their tokens/s added (they
# share the L3, the memory bandwidth and the clock budget, as the two ranks
# do). The older "one core alone, times 2" ceiling is printed beside it.
# The machine's speed drifts between minutes, so each round measures a
# ceiling right before and right after its run and takes their mean; the
# fraction reported is the median over ROUNDS rounds.
#
#   ROUNDS=3 bench/ceiling_fraction.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
rounds=${ROUNDS:-3}
cargo build --release -q -p phalanx --example gemm_ceiling
cargo build --release -q -p phalanx-cli
lscpu | grep -E 'Model name|^CPU\(s\)'; git rev-parse --short HEAD
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
tokens() { sed -n 's/.*ceiling \([0-9]*\) tokens.*/\1/p'; }
# "<both cores at once> <one core alone x 2>" tokens/s.
ceiling() {
  local g=target/release/examples/gemm_ceiling
  "$g" "$@" 3 | tokens > "$out/c0" & "$g" "$@" 3 | tokens > "$out/c1"; wait
  local alone; alone=$("$g" "$@" 3 | tokens)
  echo "$(( $(cat "$out/c0") + $(cat "$out/c1") )) $(( 2 * alone ))"
}
row() { # name micro ceiling-args... -- train sets...
  local name=$1 micro=$2; shift 2
  local cargs=()
  while [ "$1" != "--" ]; do cargs+=("$1"); shift; done; shift
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  : > "$out/$name.rounds"
  for r in $(seq "$rounds"); do
    local before after
    before=$(ceiling "${cargs[@]}")
    RAYON_NUM_THREADS=1 target/release/phalanx train --nproc-per-node 2 "${sets[@]}" \
      --set train.micro_batch_size="$micro" --set train.steps="$steps" \
      --set train.eval_interval=0 --set log.plot='""' --set log.report='""' \
      --log-json "$out/$name.jsonl" > /dev/null
    after=$(ceiling "${cargs[@]}")
    echo "$before $after" >> "$out/$name.rounds"
    python3 - "$out/$name.jsonl" "$out/$name.rounds" "$name" <<'PY'
import json, sys, statistics
r = [json.loads(l) for l in open(sys.argv[1])]
tps = statistics.median(x["tokens_per_s"] for x in r[3:])
rounds = [list(map(int, l.split())) for l in open(sys.argv[2])]
b0, a0, b1, a1 = rounds[-1]
both, alone = (b0 + b1) / 2, (a0 + a1) / 2
print(f"{sys.argv[3]:<10} round {len(rounds)}: measured {tps:6.0f} tokens/s; ceiling, both cores at once "
      f"{both:6.0f}: {tps / both:.2f}; one core x 2 {alone:6.0f}: {tps / alone:.2f}", flush=True)
with open(sys.argv[2] + ".frac", "a") as f:
    f.write(f"{tps / both} {tps / alone}\n")
PY
  done
  python3 - "$out/$name.rounds.frac" "$name" <<'PY'
import sys, statistics
fr = [list(map(float, l.split())) for l in open(sys.argv[1])]
both = sorted(f[0] for f in fr); alone = sorted(f[1] for f in fr)
print(f"{sys.argv[2]:<10} median of {len(fr)} rounds: {statistics.median(both):.2f} of the both-cores ceiling "
      f"(range {both[0]:.2f}-{both[-1]:.2f}); {statistics.median(alone):.2f} of one core x 2 "
      f"(range {alone[0]:.2f}-{alone[-1]:.2f})")
PY
}
row gpt-50m 8 8 256 768 8 12 256 -- model.preset=gpt-50m
row llama-60m 4 llama 4 256 768 8 12 4 2560 256 -- model.arch=llama model.preset=llama-60m
