#!/usr/bin/env bash
# The data loader alone against what training consumes (issue 28).
#
#   bench/loader_throughput.sh [OUT_DIR]
#
# OUT_DIR (default $TMPDIR or /tmp) is only where to work: the script makes
# a fresh directory inside it and removes that at exit, so nothing already
# there is ever deleted.
#
# 1. `examples/loader_throughput`: tokens/s served (global batches of 32)
#    from JSONL (tokenized while serving) and from llm.c shards of the same
#    text, with the byte tokenizer at T=128 (gpt-tiny), T=256 (gpt-50m) and
#    the gpt2 tokenizer at T=1024.
# 2. `phalanx train` on 2 local ranks: the tokens/s gpt-tiny and gpt-50m
#    consume, read from the JSON log (the mean of steps 5..N).
# 3. Peak RSS of a run over a 10 GiB glob of llm.c shards (sparse files:
#    holes read as token 0) against a 64 MiB one.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-${TMPDIR:-/tmp}}
mkdir -p "$base"
out=$(mktemp -d "$base/phalanx-loader-bench.XXXXXX")
trap 'rm -rf "$out"' EXIT
cargo build --release -q -p phalanx --example loader_throughput
cargo build --release -q -p phalanx-cli
lscpu | grep -E 'Model name|^CPU\(s\)'
git rev-parse --short HEAD

for spec in "byte 128" "byte 256" "gpt2 1024"; do
  set -- $spec
  target/release/examples/loader_throughput "$out/lt-$1-$2" 200 "$1" "$2"
  rm -rf "$out/lt-$1-$2"
done

consume() { # preset steps
  local log="$out/train-$1.jsonl"
  target/release/phalanx train --nproc-per-node 2 --set model.preset="$1" \
    --set train.steps="$2" --set train.eval_interval=0 --set log.plot='""' \
    --set log.report='""' --log-json "$log" > /dev/null
  python3 - "$log" "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tps = [r["tokens_per_s"] for r in rows[5:]]
print(json.dumps({"train": sys.argv[2], "ranks": 2, "steps": len(rows),
                  "tokens_per_s": round(sum(tps) / len(tps))}))
PY
}
consume gpt-tiny 60
consume gpt-50m 12

sparse() { # dir shards tokens
  mkdir -p "$1"
  for j in $(seq 0 $(($2 - 1))); do
    f=$(printf "%s/train_%06d.bin" "$1" "$j")
    python3 -c "import struct,sys; h=[0]*256; h[0]=20240520; h[1]=1; h[2]=$3; open(sys.argv[1],'wb').write(struct.pack('<256i',*h))" "$f"
    truncate -s $((1024 + 2 * $3)) "$f"
  done
}
rss() { # glob
  /usr/bin/time -f '%M' target/release/phalanx train --nproc-per-node 1 \
    --set model.preset=gpt-tiny --set train.steps=50 --set train.eval_interval=0 \
    --set log.plot='""' --set log.report='""' --set data.path="\"$1\"" 2>&1 >/dev/null | tail -1
}
sparse "$out/small" 4 8388608
sparse "$out/big" 640 8388608
echo "{\"peak_rss_kib_64MiB\": $(rss "$out/small/train_*.bin"), \"peak_rss_kib_10GiB\": $(rss "$out/big/train_*.bin")}"
