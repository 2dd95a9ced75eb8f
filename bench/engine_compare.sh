#!/usr/bin/env bash
# Issue 14's table: `phalanx train` against bench/peers/torch_ddp_gpt.py,
# same model, micro-batch 8, block size and threads per rank, interleaved
# ROUNDS times. Median tokens/s over the steps after 2 warm-up steps.
# Usage: bench/engine_compare.sh [preset...]   (default: gpt-tiny gpt-10m)
# Env: ROUNDS (1), STEPS (8), LAYOUTS ("1x2 2x1": ranks x threads).
# Output: one line per run on stdout (with Phalanx's MFU against the
# matmul peak it measures at start); `uptime` before each round.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-1}
STEPS=${STEPS:-8}
LAYOUTS=${LAYOUTS:-"1x2 2x1"}
P=${CARGO_TARGET_DIR:-target}/release/phalanx
PRESETS=${*:-gpt-tiny gpt-10m}
grep -m1 "model name" /proc/cpuinfo
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
med() { python3 -c 'import sys,statistics as s; v=[float(x) for x in sys.stdin.read().split()]; print(round(s.median(v)))'; }
for r in $(seq "$ROUNDS"); do
  echo "# round $r: $(uptime)"
  for preset in $PRESETS; do
    read -r L H C T <<<"$(python3 - "$preset" <<'PY'
import sys
p = {"gpt-tiny": (4, 4, 128, 128), "gpt-10m": (6, 6, 384, 256), "gpt-50m": (8, 12, 768, 256)}
print(*p[sys.argv[1]])
PY
)"
    for lay in $LAYOUTS; do
      n=${lay%x*}; th=${lay#*x}
      RAYON_NUM_THREADS=$th OMP_NUM_THREADS=$th "$P" train --nproc-per-node "$n" \
        --set model.preset="$preset" --set train.steps="$STEPS" --set train.eval_interval=0 \
        --set log.plot= --set log.report= --log-json "$TMP/p.json" >/dev/null 2>&1
      ph=$(python3 -c 'import json,sys; [print(json.loads(l)["tokens_per_s"]) for l in list(open(sys.argv[1]))[2:]]' "$TMP/p.json" | med)
      # MFU against the matmul peak phalanx probes at the start of the run.
      mfu=$(python3 -c 'import json,sys; [print(1000*json.loads(l)["mfu"]) for l in list(open(sys.argv[1]))[2:]]' "$TMP/p.json" | med)
      pt=$(python3 bench/peers/torch_ddp_gpt.py --n-layer "$L" --n-head "$H" --n-embd "$C" --vocab 256 \
        --block-size "$T" --micro-batch 8 --steps "$STEPS" --nproc "$n" --threads "$th" \
        --grad-clip 1.0 --data data/corpus.txt 2>/dev/null | tail -1 |
        python3 -c 'import json,sys; print(round(json.loads(sys.stdin.read())["tokens_per_s"]))')
      echo "$preset ${n}x${th} phalanx $ph torch $pt ratio $(python3 -c "print(round($ph/$pt,2))") phalanx_mfu $(python3 -c "print($mfu/10)")%"
    done
  done
done
