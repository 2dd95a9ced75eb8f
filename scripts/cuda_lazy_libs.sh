#!/usr/bin/env bash
# scripts/cuda_lazy_libs.sh OUTDIR CUDARC_DIR MAJOR [LIBCUDART_SO]
#
# Writes the lazy-loading link libraries (scripts/cuda_lazy.py) a `cuda`
# build links in place of the CUDA libraries, into OUTDIR: libcuda.a,
# libcublas.a, libcublasLt.a, libcurand.a, libnvrtc.a, libcudart.a and
# libnccl.a, each opening the CUDA MAJOR library of its name (libcuda.so.1,
# libcublas.so.MAJOR, ...) on its first call. The functions are those of
# cudarc's bindings (CUDARC_DIR, cargo's registry copy), and for the CUDA
# runtime also its start-up registration calls: every export of
# LIBCUDART_SO when given, else the registration calls nvcc's host code
# makes.
set -euo pipefail
out=$1 reg=$2 major=$3 cudart=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The runtime's registration calls; __cudaRegisterFatBinary returns a handle.
if [ -n "$cudart" ]; then
    nm -D --defined-only "$cudart" | awk '$2 == "T" {print $3}' | sed 's/@.*//'
else
    printf '%s\n' __cudaRegisterFatBinary __cudaRegisterFatBinaryEnd __cudaUnregisterFatBinary \
        __cudaRegisterFunction __cudaRegisterVar __cudaRegisterManagedVar __cudaInitModule \
        __cudaPushCallConfiguration __cudaPopCallConfiguration __cudaGetKernel \
        __cudaLaunchKernel __cudaLaunchKernel_ptsz
fi | sed 's/^__cudaRegisterFatBinary$/& ptr/' >"$tmp/cudart.extra"
# name: cudarc sys module, soname, the code a call returns when the library
# is missing (CUDA_ERROR_STUB_LIBRARY, CUBLAS_STATUS_NOT_INITIALIZED,
# CURAND_STATUS_INITIALIZATION_FAILED, NVRTC_ERROR_BUILTIN_OPERATION_FAILURE,
# cudaErrorStubLibrary, ncclSystemError)
for spec in cuda:driver:libcuda.so.1:34 cublas:cublas:libcublas.so.$major:1 \
    cublasLt:cublaslt:libcublasLt.so.$major:1 curand:curand:libcurand.so.10:203 \
    nvrtc:nvrtc:libnvrtc.so.$major:7 cudart:runtime:libcudart.so.$major:34 \
    nccl:nccl:libnccl.so.2:2; do
    IFS=: read -r name sys soname code <<<"$spec"
    "$py" "$here/cuda_lazy.py" names "$reg/src/$sys/sys/mod.rs" >"$tmp/$name.names"
    extra=()
    [ -f "$tmp/$name.extra" ] && extra=("$tmp/$name.extra")
    "$py" "$here/cuda_lazy.py" "$soname" "$code" "$tmp/$name.c" "$tmp/$name.names" ${extra[@]+"${extra[@]}"}
    gcc -c -fPIC -O2 -o "$tmp/$name.o" "$tmp/$name.c"
    rm -f "$out/lib$name.a"
    ar rcs "$out/lib$name.a" "$tmp/$name.o"
done
