#!/usr/bin/env bash
# scripts/cuda_toolchain.sh: a CUDA build toolchain from PyPI, for building
# Phalanx's `cuda` feature on a machine with no CUDA toolkit (and no GPU).
#
#   eval "$(scripts/cuda_toolchain.sh)"          # prints the exports to eval
#   cargo build --release -p phalanx-cli --features cuda,nccl
#
# What it sets up, under $PHALANX_CUDA_HOME (default ~/.cache/phalanx-cuda):
#   - nvcc, cicc, ptxas and the headers of CUDA 13.0 from NVIDIA's wheels
#     (nvidia-cuda-nvcc, -crt, nvidia-nvvm, nvidia-cuda-runtime,
#     nvidia-cuda-cccl; 130 MB of downloads): candle's kernels are compiled
#     by nvcc when the program is built. 13.0, not the newest: PTX from a
#     newer nvcc is refused by a driver older than it, and 13.0 is what a
#     CUDA 13 driver (580 and later) takes;
#   - link stubs for the libraries candle's `cuda` feature links when the
#     program is built (libcuda, cuBLAS, cuBLASLt, cuRAND, NVRTC, NCCL). Each
#     is generated from the function names of cudarc's bindings (cargo's
#     registry copy), every function returning CUDA_ERROR_STUB_LIBRARY (34),
#     under the soname the CUDA 13 libraries have, so the program runs
#     against the real libraries (the driver's libcuda.so.1, the wheels'
#     libcublas.so.13 ...) wherever they are on the library path, and against
#     the stubs (LD_LIBRARY_PATH=$PHALANX_CUDA_HOME/cu13/lib/stubs) on a
#     machine with none, where the stub driver then refuses cleanly;
#   - on x86-64, lazy-loading link libraries in their place (lib<name>.a in
#     $CUDA_HOME/lib, which the linker takes before the stubs; see
#     scripts/cuda_lazy.py): the program then names none of the CUDA
#     libraries among its dependencies, starts (and trains on the CPU) on a
#     machine without them, and opens them with dlopen on its first CUDA
#     call. PHALANX_CUDA_LINK=linked keeps the plain dynamic linking
#     (run `cargo clean -p phalanx-cli` after switching, so it relinks).
# CUDA_COMPUTE_CAP (default 90, Hopper) is the architecture candle's
# kernels are compiled for.
set -euo pipefail

home=${PHALANX_CUDA_HOME:-$HOME/.cache/phalanx-cuda}
py=${PYTHON:-python3}
ver=13.0.88
mkdir -p "$home"

if [ ! -x "$home/cu13/bin/nvcc" ]; then
    echo "cuda_toolchain: fetching nvcc $ver wheels into $home" >&2
    "$py" -m pip download -q --no-deps --only-binary=:all: \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
        --python-version 3.11 -d "$home/wheels" \
        nvidia-cuda-nvcc==$ver nvidia-cuda-crt==$ver nvidia-nvvm==$ver \
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 >&2
    tmp=$(mktemp -d "$home/unpack.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    for w in "$home"/wheels/*.whl; do
        "$py" -m zipfile -e "$w" "$tmp" >&2
    done
    chmod +x "$tmp"/nvidia/cu13/bin/* "$tmp"/nvidia/cu13/nvvm/bin/*
    rm -rf "$home/cu13"
    mv "$tmp/nvidia/cu13" "$home/cu13"
fi

# The link stubs, from the cudarc sources cargo fetched: the version
# Cargo.lock holds (else the newest fetched, in version order).
cudarc=$(awk '/^name = "cudarc"$/ { getline; sub(/^version = /, ""); gsub(/"/, ""); print; exit }' \
    "$(dirname "$0")/../Cargo.lock" 2>/dev/null || true)
pat=${cudarc:-0.19.*} # (unquoted below, so that the fallback's glob expands)
reg=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-$pat 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$reg" ]; then
    echo "cuda_toolchain: cudarc is not in cargo's registry; run \`cargo fetch\` first" >&2
    exit 1
fi
stubs="$home/cu13/lib/stubs" # cudarc searches $CUDA_HOME/lib/stubs
if [ ! -f "$stubs/.from" ] || [ "$(cat "$stubs/.from")" != "$reg" ]; then
    rm -rf "$stubs" && mkdir -p "$stubs"
    # lib: sys module, soname
    for spec in cuda:driver:libcuda.so.1 cublas:cublas:libcublas.so.13 \
        cublasLt:cublaslt:libcublasLt.so.13 curand:curand:libcurand.so.10 \
        nvrtc:nvrtc:libnvrtc.so.13 nccl:nccl:libnccl.so.2; do
        IFS=: read -r lib sys soname <<<"$spec"
        "$py" "$(dirname "$0")/cuda_lazy.py" names "$reg/src/$sys/sys/mod.rs" | awk '{print $1}' |
            sort -u | sed 's/.*/int &(void) { return 34; }/' >"$stubs/$lib.c"
        gcc -shared -fPIC -O0 -Wl,-soname,"$soname" -o "$stubs/$soname" "$stubs/$lib.c"
        ln -sf "$soname" "$stubs/lib$lib.so"
        rm "$stubs/$lib.c"
    done
    echo "$reg" >"$stubs/.from"
fi

# How the program links them: lazily (x86-64) or as DT_NEEDED libraries.
link=${PHALANX_CUDA_LINK:-$([ "$(uname -m)" = x86_64 ] && echo lazy || echo linked)}
lib="$home/cu13/lib"
here=$(cd "$(dirname "$0")" && pwd)
case $link in
lazy)
    from="$reg $(cat "$here/cuda_lazy.py" "$here/cuda_lazy_libs.sh" | cksum)"
    if [ "$(cat "$lib/.lazy-from" 2>/dev/null)" != "$from" ]; then
        rm -f "$lib/libcudart.so"
        "$here/cuda_lazy_libs.sh" "$lib" "$reg" 13 "$lib/libcudart.so.13" >&2
        echo "$from" >"$lib/.lazy-from"
    fi
    ;;
linked)
    rm -f "$lib"/lib{cuda,cublas,cublasLt,curand,nvrtc,cudart,nccl}.a "$lib/.lazy-from"
    ln -sf libcudart.so.13 "$lib/libcudart.so"
    ;;
*)
    echo "cuda_toolchain: PHALANX_CUDA_LINK must be lazy or linked, not $link" >&2
    exit 1
    ;;
esac

cat <<EOF
export PATH="$home/cu13/bin:\$PATH"
export CUDA_HOME="$home/cu13"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
EOF
