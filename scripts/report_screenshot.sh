#!/bin/bash
# Render a run report in headless Chromium, to check that it draws in a real
# browser (not only that the file exists). Trains a small 2-stage pipeline
# with a JSON log and a trace, writes the report, and screenshots it.
#
#   scripts/report_screenshot.sh [OUT_DIR]     (needs: apt-get install chromium)
set -euo pipefail
out=${1:-runs/report-check}
mkdir -p "$out"
cargo build --release -q -p phalanx-cli
./target/release/phalanx train --nproc-per-node 2 --set train.steps=30 --set parallel.pp=2 \
  --set model.n_layer=2 --set train.eval_interval=10 --set 'log.plot=""' \
  --log-json "$out/log.jsonl" --trace "$out/trace.json" --set "log.report=\"$out/report.html\"" >/dev/null
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$(mktemp -d)" --window-size=1300,2400 \
  --screenshot="$out/report.png" "file://$(realpath "$out/report.html")" 2>/dev/null
test -s "$out/report.png"
echo "screenshot: $out/report.png"
