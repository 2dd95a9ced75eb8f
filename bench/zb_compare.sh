#!/usr/bin/env bash
# Issue 14: zero-bubble ZB-H1 against 1F1B, p = 2 stages on 2 ranks
# (1 thread each), m = 8 micro-batches, interleaved ROUNDS times.
# Prints the median step time (ms) and tokens/s of steps 3.., each rank's
# measured bubble and peak RSS as `phalanx train` reports them.
# Usage: bench/zb_compare.sh [preset]   (default gpt-10m)
# Env: ROUNDS (2), STEPS (6), MICRO (4: micro-batch size), BIN (phalanx binary).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-6}
MICRO=${MICRO:-4}
PRESET=${1:-gpt-10m}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release/phalanx}
# phalanx's output goes to a file the EXIT trap removes: say up front what is missing.
[ -x "$BIN" ] || { echo "zb_compare.sh: $BIN not found: build first (cargo build --release -p phalanx-cli)" >&2; exit 1; }
grep -m1 "model name" /proc/cpuinfo
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for r in $(seq "$ROUNDS"); do
  echo "# round $r: $(uptime)"
  for s in 1f1b zb-h1; do
    RAYON_NUM_THREADS=1 "$BIN" train --nproc-per-node 2 --set model.preset="$PRESET" \
      --set parallel.pp=2 --set parallel.pp_schedule="$s" --set train.grad_accum_steps=8 \
      --set train.micro_batch_size="$MICRO" --set train.steps="$STEPS" --set train.eval_interval=0 \
      --set log.plot= --set log.report= --log-json "$TMP/l.json" >"$TMP/out" 2>&1 ||
      { echo "zb_compare.sh: phalanx train ($s) failed; the end of its output:" >&2; tail -n 20 "$TMP/out" >&2; exit 1; }
    bubble=$(grep -o "measured bubble per rank \[[^]]*\]" "$TMP/out" | sed 's/measured bubble per rank //')
    python3 - "$TMP/l.json" "$s" "$bubble" <<'PY'
import json, statistics as st, sys
every = [json.loads(l) for l in open(sys.argv[1])]
rows = every[2:]
tps = st.median(r["tokens_per_s"] for r in rows)
ms = st.median(r["step_ms"] for r in rows)
mem = next((r["memory"] for r in reversed(every) if "memory" in r), [])
rss = [round(m["peak_rss"] / 2**20) for m in mem]
print(f"{sys.argv[2]:6} tokens/s {tps:8.0f}  step_ms {ms:8.1f}  bubble {sys.argv[3]}  peak_rss_MiB {rss}")
PY
  done
done
