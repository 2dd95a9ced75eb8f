#!/usr/bin/env bash
# `phalanx tokenize --encoding gpt2` against tiktoken (PyPI) on one generated
# JSONL corpus: wall time and peak memory (/usr/bin/time -v) of
#   1. phalanx tokenize --threads 1 and --threads $THREADS (llm.c shards),
#   2. tiktoken `encode_ordinary`, one thread, and
#   3. tiktoken `encode_ordinary_batch(num_threads=$THREADS)`,
# each writing the same stream (<|endoftext|> before every document, uint16,
# as llm.c's fineweb.py does), then checks that the streams are identical.
#
# The corpus is data/corpus.txt repeated until SIZE_MB, each repetition cut
# into documents of 1-60 lines, half of them with their lines shuffled,
# each tagged with its repetition (so no two are alike). It goes under
# $WORK, never into the repository. tiktoken downloads its ranks from the
# internet; here it reads them from a file on disk, checked against
# tiktoken's sha256: RANKS if given, else the tiktoken-rs crate's
# assets/r50k_base.tiktoken (the file compiled into phalanx) that cargo
# unpacked under ${CARGO_HOME:-~/.cargo}/registry/src when it built phalanx.
#
# Usage: PY=~/.cache/phalanx-ci/torch-venv/bin/python SIZE_MB=300 \
#        [RANKS=path/to/r50k_base.tiktoken] bench/tokenize_throughput.sh [PHALANX_BIN]
# (the Python needs `pip install tiktoken`.)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(realpath -m "${1:-target/release/phalanx}")
# phalanx's output goes to files under $WORK: say up front if the binary is missing.
[ -x "$BIN" ] || { echo "tokenize_throughput.sh: $BIN not found: build first (cargo build --release -p phalanx-cli)" >&2; exit 1; }
PY=${PY:-python3}
SIZE_MB=${SIZE_MB:-300}
THREADS=${THREADS:-$(nproc)}
WORK=${WORK:-/tmp/phalanx-tokenize-bench}
REG=${CARGO_HOME:-$HOME/.cargo}/registry/src
if [ -n "${RANKS:-}" ]; then
  [ -f "$RANKS" ] || { echo "tokenize_throughput.sh: RANKS=$RANKS is not a file" >&2; exit 1; }
else
  RANKS=$(find "$REG" -path '*tiktoken-rs-*/assets/r50k_base.tiktoken' 2>/dev/null | head -1 || true)
  [ -n "$RANKS" ] || { echo "tokenize_throughput.sh: no tiktoken-rs r50k_base.tiktoken under $REG: set RANKS=path/to/r50k_base.tiktoken" >&2; exit 1; }
fi
mkdir -p "$WORK"
lscpu | grep -E "Model name|^CPU\(s\)"
"$PY" -c "import tiktoken; print('tiktoken', tiktoken.__version__)"

CORPUS=$WORK/corpus-${SIZE_MB}mb.jsonl
if [ ! -s "$CORPUS" ]; then
  "$PY" - "$CORPUS" "$SIZE_MB" <<'EOF'
import json, random, sys
dst, target = sys.argv[1], int(sys.argv[2]) * 10**6
lines = open("data/corpus.txt", encoding="utf-8").read().split("\n")
rng, n, rep = random.Random(1234), 0, 0
with open(dst + ".tmp", "w", encoding="utf-8") as f:
    while n < target:
        rep += 1
        i = 0
        while i < len(lines) and n < target:
            k = rng.randint(1, 60)
            doc = lines[i:i + k]
            i += k
            if rng.random() < 0.5:
                rng.shuffle(doc)
            rec = json.dumps({"id": f"{rep}-{i}", "text": f"[{rep}.{i}] " + "\n".join(doc)},
                             ensure_ascii=False) + "\n"
            f.write(rec)
            n += len(rec.encode())
import os; os.rename(dst + ".tmp", dst)
EOF
fi
ls -l "$CORPUS"

cat > "$WORK/tiktoken_run.py" <<'EOF'
# tiktoken on a JSONL file: <|endoftext|> then encode_ordinary(text) per
# document, uint16, written as it goes. argv: ranks src dst threads (0: one
# thread, encode_ordinary; N: encode_ordinary_batch with N threads).
import array, json, sys
import tiktoken, tiktoken.load
from tiktoken_ext.openai_public import r50k_pat_str
ranks, src, dst, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
mr = tiktoken.load.load_tiktoken_bpe(
    ranks, expected_hash="306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930")
enc = tiktoken.Encoding("r50k_base", pat_str=r50k_pat_str, mergeable_ranks=mr,
                        special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)
out, total = array.array("H"), 0
with open(src, "rb") as f, open(dst, "wb") as g:
    def emit(tokens):
        global out, total
        out.append(50256)
        out.extend(tokens)
        if len(out) > 1 << 24:
            total += len(out); out.tofile(g); out = array.array("H")
    batch = []
    for line in f:
        if not line.strip():
            continue
        text = json.loads(line)["text"]
        if threads == 0:
            emit(enc.encode_ordinary(text))
            continue
        batch.append(text)
        if len(batch) == 4096:
            for t in enc.encode_ordinary_batch(batch, num_threads=threads):
                emit(t)
            batch = []
    for t in enc.encode_ordinary_batch(batch, num_threads=max(threads, 1)):
        emit(t)
    total += len(out); out.tofile(g)
print("tokens", total)
EOF

timed() { # name command... -> "name wall_s peak_MiB"
  local name=$1; shift
  /usr/bin/time -v "$@" >"$WORK/$name.out" 2>"$WORK/$name.time"
  awk -v n="$name" '/Elapsed \(wall clock\)/ {split($NF,a,":"); w=(length(a)==3)?a[1]*3600+a[2]*60+a[3]:a[1]*60+a[2]}
    /Maximum resident/ {m=$NF/1024} END {printf "%-24s wall %8.2f s  peak %7.0f MiB\n", n, w, m}' "$WORK/$name.time"
}
ROUNDS=${ROUNDS:-1}
for r in $(seq "$ROUNDS"); do
  echo "# round $r: $(uptime)"
  for t in 1 "$THREADS"; do
    rm -rf "$WORK/shards-$t"
    timed "phalanx-threads-$t" "$BIN" tokenize --encoding gpt2 --threads "$t" \
      --output-dir "$WORK/shards-$t" "$CORPUS"
  done
  timed tiktoken-single "$PY" "$WORK/tiktoken_run.py" "$RANKS" "$CORPUS" "$WORK/tiktoken-single.u16" 0
  timed "tiktoken-batch-$THREADS" "$PY" "$WORK/tiktoken_run.py" "$RANKS" "$CORPUS" \
    "$WORK/tiktoken-batch.u16" "$THREADS"
done
tail -n1 "$WORK/phalanx-threads-$THREADS.out"

# The same tokens: phalanx's shards (headers dropped) against tiktoken's stream.
"$PY" - "$WORK/shards-$THREADS" "$WORK/tiktoken-single.u16" "$WORK/tiktoken-batch.u16" "$WORK/shards-1" <<'EOF'
import glob, os, sys
def phalanx(d):
    for p in sorted(glob.glob(os.path.join(d, "data_*.bin"))):
        with open(p, "rb") as f:
            f.seek(1024)
            while b := f.read(1 << 24):
                yield b
ref = b"".join(phalanx(sys.argv[1]))
for other in sys.argv[2:]:
    got = b"".join(phalanx(other)) if os.path.isdir(other) else open(other, "rb").read()
    print(f"{other}: {'identical' if got == ref else 'DIFFERENT'} ({len(got) // 2} tokens)")
    if got != ref:
        sys.exit(1)
EOF
