#!/usr/bin/env bash
# scripts/gpu_prepare.sh: build, on a machine with Rust and the package
# registries (no GPU needed), the `cuda,nccl` binary that
# scripts/gpu_check.sh runs on a GPU machine with neither:
#
#   scripts/gpu_prepare.sh        # writes target/gpu/phalanx.gz
#   PHALANX_BIN=target/gpu/phalanx.gz DEADLINE=540 scripts/gpu_check.sh   # there
#
# nvcc and the link libraries come from scripts/cuda_toolchain.sh (NVIDIA's
# wheels from PyPI, CUDA 13.0: a driver of 580 or later), the kernels are
# compiled for CUDA_COMPUTE_CAP (default 90: H100, H200). It builds in its
# own target directory (target/gpu-build), so the CPU build in
# target/release is left as it is; about 8 minutes of nvcc on 2 cores
# for candle's kernels, then the Rust build. The binary is stripped and
# gzipped (about 19 MB: it fits a 64 MiB copy limit) and written whole.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/gpu/phalanx.gz}
command -v cargo >/dev/null || { echo "gpu_prepare: no cargo here" >&2; exit 1; }
mkdir -p "$(dirname "$out")"

cargo fetch --quiet # the link stubs are made from cudarc's sources
# (Captured first: `eval "$(...)"` would go on after a failure.)
tc=$(scripts/cuda_toolchain.sh) || { echo "gpu_prepare: scripts/cuda_toolchain.sh failed" >&2; exit 1; }
eval "$tc"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CARGO_TARGET_DIR=${PHALANX_GPU_TARGET:-target/gpu-build}
echo "gpu_prepare: cargo build --release -p phalanx-cli --features cuda,nccl (CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP, in $CARGO_TARGET_DIR)" >&2
start=$SECONDS
cargo build --release -p phalanx-cli --features cuda,nccl
echo "gpu_prepare: built in $((SECONDS - start)) s" >&2

tmp=$(mktemp "$out.XXXXXX")
trap 'rm -f "$tmp" "$tmp.bin"' EXIT
strip -o "$tmp.bin" "$CARGO_TARGET_DIR/release/phalanx"
gzip -9 -c "$tmp.bin" >"$tmp"
chmod 644 "$tmp"
mv "$tmp" "$out"
ls -l "$out" >&2
echo "gpu_prepare: carry $out to the GPU machine and run there:" >&2
echo "  PHALANX_BIN=$out DEADLINE=540 scripts/gpu_check.sh" >&2
