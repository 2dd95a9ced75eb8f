#!/usr/bin/env bash
# Side-by-side figures of bench/README.md ("RPC, parameter server and
# reinforcement learning"): Phalanx rpc_sync vs torch.distributed.rpc,
# interleaved, `ROUNDS` times each; parameter-server throughput with 1 and 2
# servers; cart-pole environment steps/s with 1, 2 and 4 observers.
# Output: JSON lines on stdout.
# Env: ROUNDS (3), PYTHON (python3: one with torch).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
PY=${PYTHON:-python3}
# Check the peer's torch before the build, rather than fail a round in.
$PY -c 'import torch' 2>/dev/null || { echo "rpc_compare.sh: PYTHON=$PY has no torch: see bench/peers/ (bench/peers/install_torch.sh, or bench/peers/README.md)" >&2; exit 1; }
T=${CARGO_TARGET_DIR:-target}/release/examples
cargo build --release -p phalanx-rpc --example rpc_bench --example parameter_server --example rl_cartpole >&2
grep -m1 "model name" /proc/cpuinfo >&2
for r in $(seq "$ROUNDS"); do
  echo "# round $r" >&2
  "$T/rpc_bench"
  $PY bench/peers/torch_rpc.py
  for k in 1 2; do
    for s in 0 async; do
      "$T/parameter_server" --trainers 2 --servers "$k" --staleness "$s" --steps 1000 | tail -1
    done
  done
  for o in 1 2 4; do
    "$T/rl_cartpole" --observers "$o" --no-stop --max-episodes 3000 | tail -1
  done
done
