#!/usr/bin/env bash
# DDP on 2 local ranks, two `phalanx` binaries side by side (A: after, B:
# before a change), interleaved: the median tokens/s of the steps after the
# first two, per round. Used for the named-mesh-axes change (the dp axis over
# the world is the world group, so gradients take the in-place shared-memory
# all-reduce). Usage: ROUNDS=3 bench/ddp_world_group.sh NEW_BIN OLD_BIN [presets]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: ROUNDS=3 bench/ddp_world_group.sh NEW_BIN OLD_BIN [presets]" >&2; exit 2; }
A=$1; B=$2; shift 2
# phalanx's output goes to a log file below: say up front which binary is missing.
for bin in "$A" "$B"; do
  [ -x "$bin" ] || { echo "ddp_world_group.sh: $bin not found: build first (cargo build --release -p phalanx-cli)" >&2; exit 1; }
done
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-12}
PRESETS=${*:-gpt-tiny gpt-10m}
grep -m1 "model name" /proc/cpuinfo
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
run() { # bin preset -> median tokens/s
  RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 "$1" train --nproc-per-node 2 \
    --set model.preset="$2" --set train.steps="$STEPS" --set train.eval_interval=0 \
    --set log.plot= --set log.report= --log-json "$TMP/p.json" >"$TMP/p.log" 2>&1 ||
    { echo "ddp_world_group.sh: $1 train ($2) failed; the end of its output:" >&2; tail -n 20 "$TMP/p.log" >&2; exit 1; }
  python3 -c 'import json,sys,statistics as s; v=[json.loads(l)["tokens_per_s"] for l in list(open(sys.argv[1]))[2:]]; print(round(s.median(v)))' "$TMP/p.json"
  rm -f "$TMP/p.json"
}
for r in $(seq "$ROUNDS"); do
  echo "# round $r: $(uptime)"
  for p in $PRESETS; do
    a=$(run "$A" "$p"); b=$(run "$B" "$p")
    echo "$p 2x1 new $a old $b ratio $(python3 -c "print(round($a/$b,3))")"
  done
done
