#!/usr/bin/env bash
# The engine table (issues 14 and 29): `phalanx train` against the PyTorch
# peer with the same model, micro-batch, block size, threads per rank and
# precision, interleaved ROUNDS times. GPT-2 presets run against
# bench/peers/torch_ddp_gpt.py (micro-batch 8), llama-60m against
# transformers' LlamaForCausalLM in bench/peers/torch_ddp_llama.py
# (micro-batch 4, sdpa, fused AdamW); bf16 / fp16 are `train.precision`
# against `torch.autocast` in that dtype. Median tokens/s over the steps
# after 2 warm-up steps.
# Usage: bench/engine_compare.sh [preset...]   (default: gpt-tiny gpt-10m)
# Env: ROUNDS (1), STEPS (8), LAYOUTS ("1x2 2x1": ranks x threads),
#      PRECISIONS ("fp32"; e.g. "fp32 bf16"), PYTHON (python3: one with torch
#      and, for llama-60m, transformers).
# Output: one line per run on stdout (with Phalanx's MFU against the
# matmul peak it measures at start); `uptime` before each round.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-1}
STEPS=${STEPS:-8}
LAYOUTS=${LAYOUTS:-"1x2 2x1"}
PRECISIONS=${PRECISIONS:-fp32}
PY=${PYTHON:-python3}
P=${CARGO_TARGET_DIR:-target}/release/phalanx
PRESETS=${*:-gpt-tiny gpt-10m}
# Fail up front and say why: below, phalanx's and the peer's output go to
# files, so a missing binary or torch would otherwise end the run silently
# (or as a JSON traceback).
[ -x "$P" ] || { echo "engine_compare.sh: $P not found: build first (cargo build --release -p phalanx-cli)" >&2; exit 1; }
$PY -c 'import torch' 2>/dev/null || { echo "engine_compare.sh: PYTHON=$PY has no torch: see bench/peers/ (bench/peers/install_torch.sh, or bench/peers/README.md)" >&2; exit 1; }
case " $PRESETS " in *" llama-"*)
  $PY -c 'import transformers' 2>/dev/null || { echo "engine_compare.sh: PYTHON=$PY has no transformers, which llama presets need (pip install transformers; see bench/peers/README.md)" >&2; exit 1; } ;;
esac
grep -m1 "model name" /proc/cpuinfo
git rev-parse --short HEAD
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# A step that failed: name it and show the end of its output, then stop.
fail() { echo "engine_compare.sh: $1 failed; the end of its output:" >&2; tail -n 20 "$2" >&2; exit 1; }
med() { python3 -c 'import sys,statistics as s; v=[float(x) for x in sys.stdin.read().split()]; print(round(s.median(v)))'; }
# The peer's command for a preset (micro-batch $2, ranks $3, threads $4, autocast $5).
peer() {
  case $1 in
    llama-*) echo "bench/peers/torch_ddp_llama.py --preset $1 --micro-batch $2" ;;
    *)
      read -r L H C T <<<"$(python3 - "$1" <<'PY'
import sys
p = {"gpt-tiny": (4, 4, 128, 128), "gpt-10m": (6, 6, 384, 256), "gpt-50m": (8, 12, 768, 256)}
print(*p[sys.argv[1]])
PY
)"
      echo "bench/peers/torch_ddp_gpt.py --n-layer $L --n-head $H --n-embd $C --vocab 256 --block-size $T --micro-batch $2"
      ;;
  esac
}
for r in $(seq "$ROUNDS"); do
  echo "# round $r: $(uptime)"
  for preset in $PRESETS; do
    case $preset in llama-*) mb=4; arch=llama ;; *) mb=8; arch=gpt2 ;; esac
    for prec in $PRECISIONS; do
      ac=$([ "$prec" = fp32 ] && echo none || echo "$prec")
      for lay in $LAYOUTS; do
        n=${lay%x*}; th=${lay#*x}
        RAYON_NUM_THREADS=$th OMP_NUM_THREADS=$th "$P" train --nproc-per-node "$n" \
          --set model.arch="$arch" --set model.preset="$preset" --set train.micro_batch_size="$mb" \
          --set train.precision="$prec" --set train.steps="$STEPS" --set train.eval_interval=0 \
          --set log.plot= --set log.report= --log-json "$TMP/p.json" >"$TMP/p.log" 2>&1 || fail "phalanx train ($preset $prec ${n}x${th})" "$TMP/p.log"
        ph=$(python3 -c 'import json,sys; [print(json.loads(l)["tokens_per_s"]) for l in list(open(sys.argv[1]))[2:]]' "$TMP/p.json" | med)
        # MFU against the matmul peak phalanx probes at the start of the run.
        mfu=$(python3 -c 'import json,sys; [print(1000*json.loads(l)["mfu"]) for l in list(open(sys.argv[1]))[2:]]' "$TMP/p.json" | med)
        # shellcheck disable=SC2046
        $PY $(peer "$preset" "$mb") --steps "$STEPS" --nproc "$n" --threads "$th" \
          --grad-clip 1.0 --data data/corpus.txt --autocast "$ac" >"$TMP/t.out" 2>"$TMP/t.log" ||
          fail "the torch peer ($preset $prec ${n}x${th})" "$TMP/t.log"
        pt=$(tail -1 "$TMP/t.out" |
          python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(round(d.get("tokens_per_s_median", d["tokens_per_s"])))')
        echo "$preset $prec ${n}x${th} phalanx $ph torch $pt ratio $(python3 -c "print(round($ph/$pt,2))") phalanx_mfu $(python3 -c "print($mfu/10)")%"
      done
    done
  done
done
