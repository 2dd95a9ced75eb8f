#!/usr/bin/env bash
# scripts/gpu_check.sh: check Phalanx's NCCL backend on a machine with one or
# more NVIDIA GPUs, in one command (a few minutes; every step under `timeout`).
#
#   scripts/gpu_check.sh            # from the repository root
#
# Status: written and syntax-checked on CPU machines; NOT YET RUN ON GPU
# HARDWARE. The CUDA engine (`train.device = "cuda"`, `--features cuda`) is
# not built yet, so this checks the NCCL backend only (collectives of host
# buffers staged through the GPU), not training on the GPU.
#
# Steps:
#   1. the driver and GPUs (`nvidia-smi -L`);
#   2. `cargo build --release -p phalanx-cli --features nccl`;
#   3. `phalanx bench collectives --backend nccl --op all --check` at world 1,
#      and at world 2 where `nvidia-smi -L` lists 2+ GPUs;
#   4. all-reduce bus bandwidth at 1 MB / 64 MB / 1 GB (the largest world).
#      These times include the host<->device staging of every call (the
#      backend works on host buffers), so they understate NCCL's own busbw.
# The last line reads `N passed, M failed`; the exit status is 0 when none
# failed.
#
# Environment: PHALANX_NCCL_LIBRARY (a libnccl file or directory, e.g. the
# PyPI wheel's site-packages/nvidia/nccl/lib) when libnccl is not on the
# system's library path; CARGO_TARGET_DIR as for cargo.

set -u
cd "$(dirname "$0")/.."

passed=0
failed=0
step() { # step NAME SECONDS CMD...: run CMD under a timeout and count it
    local name=$1 secs=$2
    shift 2
    echo "=== $name (timeout ${secs}s)"
    local t0=$SECONDS
    timeout "$secs" "$@"
    local rc=$?
    if [ $rc -eq 0 ]; then
        passed=$((passed + 1))
        echo "--- PASS $name ($((SECONDS - t0))s)"
    else
        failed=$((failed + 1))
        [ $rc -eq 124 ] && echo "--- timed out after ${secs}s"
        echo "--- FAIL $name (exit $rc, $((SECONDS - t0))s)"
    fi
    return $rc
}
finish() {
    echo "$passed passed, $failed failed"
    [ "$failed" -eq 0 ]
    exit $?
}

gpus=0
if step "driver and GPUs (nvidia-smi -L)" 30 nvidia-smi -L; then
    gpus=$(timeout 30 nvidia-smi -L | grep -c '^GPU')
fi
echo "GPUs: $gpus"

if ! step "build (cargo build --release -p phalanx-cli --features nccl)" 900 \
    cargo build --release -p phalanx-cli --features nccl; then
    finish
fi
bin="${CARGO_TARGET_DIR:-target}/release/phalanx"

worlds="1"
[ "$gpus" -ge 2 ] && worlds="1 2"
for n in $worlds; do
    step "NCCL collectives --check, world $n" 300 \
        "$bin" bench collectives --backend nccl --nproc "$n" --op all \
        --sizes 8:64M --factor 8 --iters 3 --warmup 1 --check
done

n=${worlds##* }
step "NCCL all-reduce bus bandwidth at 1 MB / 64 MB / 1 GB, world $n" 300 \
    "$bin" bench collectives --backend nccl --nproc "$n" --op all_reduce \
    --sizes 1M,64M,1G --iters 10 --warmup 3

finish
