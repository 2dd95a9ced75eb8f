#!/usr/bin/env bash
# scripts/test_cuda_build.sh BIN: checks a `--features cuda,nccl` binary
# linked with the lazy-loading CUDA libraries (scripts/cuda_lazy_libs.sh) on
# a machine without a GPU or CUDA libraries, as CI builds one (with the
# stand-in nvcc, whose kernels are empty: nothing here runs on a GPU):
#   1. it names no CUDA library among its dependencies;
#   2. it starts and trains on the CPU;
#   3. `train.device = "cuda"` is refused within seconds,
#      naming the missing driver library, with exit status 1 (no panic);
#   4. `--backend nccl` is refused, naming the driver.
set -uo pipefail
bin=$(realpath "$1")
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
fail=0
check() { # check WHAT CONDITION...: count one check
    local what=$1
    shift
    if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fail=1; fi
}
if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
    echo "this machine has libcuda.so.1: the refusal checks need a machine without it"
    exit 1
fi

needed=$(readelf -d "$bin" | grep NEEDED)
echo "$needed"
check "the binary's dependencies were read (libc among them)" grep -q 'libc\.so' <<<"$needed"
check "no CUDA library among the binary's dependencies" \
    bash -c "! grep -Eq 'libcuda|libcudart|libcublas|libcurand|libnvrtc|libnccl' <<<\"\$0\"" "$needed"

(cd "$t" && timeout 120 "$bin" train --set train.steps=2 --nproc-per-node 2 >cpu.out 2>&1)
rc=$?
tail -1 "$t/cpu.out"
check "trains on the CPU (exit $rc)" test $rc = 0

start=$SECONDS
(cd "$t" && timeout 60 "$bin" train --set train.steps=2 --set train.device=cuda --nproc-per-node 2 >cuda.out 2>&1)
rc=$?
cat "$t/cuda.out"
check "train.device = \"cuda\" exits with status 1 (got $rc)" test $rc = 1
check "within 10 s ($((SECONDS - start)) s)" test $((SECONDS - start)) -le 10
# (The launcher stops the other rank when the first fails: it may not get
# to say so.)
check "the failing rank names the missing libcuda.so.1" \
    grep -q '^\[rank [01]\] phalanx: libcuda.so.1: cannot open' "$t/cuda.out"
check "and says the driver did not start" grep -q 'the NVIDIA driver did not start' "$t/cuda.out"
check "no panic" bash -c "! grep -q panicked '$t/cuda.out'"

(cd "$t" && timeout 60 "$bin" bench collectives --backend nccl --nproc 1 --op all_reduce \
    --sizes 8:64 --iters 1 >nccl.out 2>&1)
rc=$?
tail -2 "$t/nccl.out"
check "--backend nccl is refused (exit $rc, not a signal), naming the driver library" \
    bash -c "[ $rc != 0 ] && [ $rc -lt 124 ] && grep -q 'libcuda.so.1' '$t/nccl.out'"
check "no panic" bash -c "! grep -q panicked '$t/nccl.out'"

[ $fail = 0 ] && echo "cuda build: all checks passed"
exit $fail
