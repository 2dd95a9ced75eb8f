#!/usr/bin/env bash
# scripts/gpu_check.sh: check Phalanx on a machine with one or more NVIDIA
# GPUs, in one command (the checks under 10 minutes on one GPU, every step
# under `timeout`; the build before them takes longer: candle's kernels
# are about 8 minutes of nvcc on 2 cores, so on a machine lent for minutes
# build elsewhere and give PHALANX_BIN).
#
#   scripts/gpu_check.sh                          # build with cuda,nccl, then check
#   PHALANX_BIN=/path/to/phalanx scripts/gpu_check.sh   # a binary built elsewhere
#   DEVICE=cpu scripts/gpu_check.sh               # rehearsal on a CPU machine
#
# Status: built, not yet run on GPU hardware. The rehearsal (DEVICE=cpu:
# the "device" runs take the CPU's device-generic path, PHALANX_HOST_KERNELS=0,
# and the GPU-only steps are skipped) passes on the project's CPU machines.
#
# Steps (every command under `timeout`):
#   1. the driver and GPUs (`nvidia-smi -L`);
#   2. the build: `cargo build --release -p phalanx-cli --features cuda,nccl`
#      (nvcc from the system, else from scripts/cuda_toolchain.sh), unless
#      PHALANX_BIN names a binary; then every library it needs (`ldd`, and
#      the ones a toolchain build opens on its first CUDA call);
#   3. `phalanx bench collectives --backend nccl --op all --check` at world 1,
#      and at world 2 where there are 2+ GPUs (it ends with the all-reduce,
#      all-gather and reduce-scatter of CUDA tensors in place, even and
#      uneven blocks: NCCL on device memory); again with non-blocking
#      communicators (NCCL_COMM_BLOCKING=0) at the largest world;
#      `phalanx bench optimizer
#      --check` (the optimizer's step on the device against the host's, in
#      chunks, pieces and with frozen variance; then timed over 124M
#      elements, host against device);
#   4. every strategy on the device against the CPU's 1-rank run of the same
#      model (a 2-layer GPT-2 and a 2-layer Llama, 8 steps; DDP also with 4
#      micro-batches and full activation checkpointing, and with the
#      optimizer offloaded to the host; elsewhere its state and step are
#      on the device; 1 rank and ZeRO-1 on 1 rank also reading no gradient
#      back, the step log's grad_reads): the loss of
#      every step within LOSS_TOL (default 1e-3) relative; bf16 against the
#      CPU's bf16 run within 2%. Ranks beyond the GPU count share GPUs (the
#      native backend carries their collectives through host memory); with
#      2+ GPUs, DDP, ZeRO-1, ZeRO-2, ZeRO-3 and pp 2 (gradients averaged or
#      summed in device memory, no read-back: the step log's grad_reads;
#      ZeRO-3's blocks gathered there too, 2 blocks ahead; pp's activations
#      by ncclSend / ncclRecv, also interleaved),
#      and tp 2 with and
#      without sequence parallelism (its exchanges in device memory) once
#      more over NCCL, and with 4+ GPUs dp 2 x pp 2 under ZeRO-1;
#   5. resume: 4 steps saved on the device, resumed on the CPU to step 8,
#      and the reverse, each against 8 uninterrupted CPU steps (in the
#      rehearsal, the device's side takes the generic path);
#   5b. a rank whose step fails (PHALANX_FAULT=error-at-step:1:3) makes its
#      peer fail at once naming its error, on the device and, with 2+ GPUs,
#      over NCCL (the NCCL waits ask the native mesh);
#   6. GPT-2 124M in bf16 on one GPU: tokens/s and MFU against the GPU's
#      dense bf16 peak (PEAK_TFLOPS, default 989: H100/H200 SXM), and again
#      with the optimizer offloaded to the host;
#   7. NCCL all-reduce bus bandwidth at 1 MB / 64 MB / 1 GB (host-staged:
#      the backend takes host buffers), with 2+ GPUs.
# The last line reads `N passed, M failed` (and `, K skipped` where steps
# were skipped: each skip says why, as `--- SKIP`); the exit status is 0
# when none failed. LOG_DIR (default a temporary directory) keeps every
# run's output.
#
# Environment: the `lib` folders of python3's `nvidia` wheels (cuBLAS,
# cuRAND, NVRTC, the CUDA runtime, NCCL) are added to LD_LIBRARY_PATH;
# PHALANX_NCCL_LIBRARY (a libnccl file or directory) where libnccl is
# elsewhere. On a machine without Rust, build here (`eval "$(scripts/cuda_toolchain.sh)"`,
# then `cargo build --release -p phalanx-cli --features cuda,nccl`; 70 MB
# stripped, 19 MB gzipped), copy the binary there and give it as PHALANX_BIN.
#
# A machine lent for one command of at most 10 minutes, with no Rust and
# no network: build here with scripts/gpu_prepare.sh (it writes
# target/gpu/phalanx.gz, under a 64 MiB copy limit), carry that file, and
# give it as PHALANX_BIN (a `.gz` is unpacked here). DEADLINE (seconds)
# caps every step's timeout at what is left of it, skips the steps that
# find too little left, and keeps time for the summary. Each part starts
# afresh (a bare machine), so:
#   PHALANX_BIN=target/gpu/phalanx.gz FAMILIES=gpt DEADLINE=540 scripts/gpu_check.sh
#   PHALANX_BIN=target/gpu/phalanx.gz BASICS=0 FAMILIES=llama EXTRA=0 PERF=0 \
#     DEADLINE=540 scripts/gpu_check.sh
# Under a runner that keeps only $OUT: this script's output goes to
# $OUT/gpu_check.log, and every run's log (checkpoints left out) to
# $OUT/logs.tgz.

set -u
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
LOSS_TOL=${LOSS_TOL:-1e-3}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
# Parts, for a machine lent for one command of a few minutes at a time:
# BASICS=0 (skip step 3), FAMILIES (the models of step 4), CHECKS=0 (skip
# steps 4-5b), EXTRA=0 (skip steps 5-5b only), PERF=0 (skip steps 6-7).
FAMILIES=${FAMILIES:-gpt llama}
BASICS=${BASICS:-1}
CHECKS=${CHECKS:-1}
EXTRA=${EXTRA:-1}
PERF=${PERF:-1}
# DEADLINE: seconds from the start that the whole script must end within
# (empty: none). RESERVE of them are kept for the summary and the logs.
DEADLINE=${DEADLINE:-}
RESERVE=${RESERVE:-20}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/phalanx-gpu-check.XXXXXX)}
mkdir -p "$LOG_DIR"
# Under a runner that returns only $OUT (a few files, the output's tail):
# this script's output in one file there, the logs packed in another at
# the end (finish), checkpoints left out.
tee_pid=""
if [ -n "${OUT:-}" ]; then
    exec > >(tee -a "$OUT/gpu_check.log") 2>&1
    tee_pid=$!
fi
# CUDA's JIT cache (candle's kernels are PTX): kept across the runs' processes.
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-${TMPDIR:-/tmp}/phalanx-nvcache}
echo "device: $DEVICE; logs: $LOG_DIR; families: $FAMILIES; basics: $BASICS; checks: $CHECKS; extra: $EXTRA; perf: $PERF; deadline: ${DEADLINE:-none}"

passed=0
failed=0
skipped=0
# cap SECONDS: SECONDS, or less where the deadline leaves less (0: none left).
cap() {
    if [ -z "$DEADLINE" ]; then
        echo "$1"
        return
    fi
    local left=$((DEADLINE - RESERVE - SECONDS))
    [ $left -lt 0 ] && left=0
    echo $(($1 < left ? $1 : left))
}
skip() { # skip NAME WHY [N]: a step (or N steps) not run, said and counted
    local n=${3:-1}
    skipped=$((skipped + n))
    if [ "$n" -gt 1 ]; then echo "--- SKIP $n steps: $1 ($2)"; else echo "--- SKIP $1 ($2)"; fi
}
step() { # step NAME SECONDS CMD...: run CMD under a timeout and count it
    local name=$1 secs
    secs=$(cap "$2")
    shift 2
    if [ "$secs" -lt 10 ]; then
        skip "$name" "DEADLINE: ${secs}s left"
        return 1
    fi
    echo "=== $name (timeout ${secs}s)"
    local t0=$SECONDS rc
    if declare -F "$1" >/dev/null; then
        STEP_TIMEOUT=$secs "$@" # a function: each command in it under the timeout
    else
        timeout "$secs" "$@"
    fi
    rc=$?
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
    local line="$passed passed, $failed failed"
    [ "$skipped" -gt 0 ] && line="$line, $skipped skipped"
    echo "$line"
    # Nothing that ran is no pass (a DEADLINE that left no time, say).
    [ "$passed" -eq 0 ] && [ "$failed" -eq 0 ] && failed=1 && echo "nothing ran: not a pass"
    if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/logs.tgz" -C "$LOG_DIR" --exclude='ck-*' . 2>/dev/null &&
            echo "logs: \$OUT/logs.tgz"
        # Let tee copy the last lines before the runner ends.
        exec >&- 2>&-
        [ -n "$tee_pid" ] && wait "$tee_pid" 2>/dev/null
    fi
    [ "$failed" -eq 0 ]
    exit $?
}

gpus=0
drv=""
if [ "$DEVICE" = cuda ]; then
    # The CUDA libraries of PyPI's wheels (PyTorch brings them), after
    # whatever the library path already has.
    for d in $(python3 -c 'import nvidia; print(*nvidia.__path__)' 2>/dev/null); do
        for lib in $(find "$d" -maxdepth 3 -type d -name lib 2>/dev/null); do
            LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$lib
        done
    done
    export LD_LIBRARY_PATH
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    if step "driver and GPUs (nvidia-smi -L)" 30 nvidia-smi -L; then
        gpus=$(timeout 30 nvidia-smi -L | grep -c '^GPU')
        # nvidia-smi lists every GPU; CUDA (and so NCCL's one GPU per
        # rank) sees only CUDA_VISIBLE_DEVICES' where it is set.
        if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
            # (CUDA stops at the first entry that names no device.)
            vis=$(printf '%s\n' "$CUDA_VISIBLE_DEVICES" |
                awk -F, '{ n = 0; for (i = 1; i <= NF; i++) { if ($i == "" || $i ~ /^-/) break; n++ } print n }')
            vis=${vis:-0}
            [ "$vis" -lt "$gpus" ] && gpus=$vis
        fi
        # A binary from scripts/cuda_toolchain.sh (CUDA 13.0) needs a
        # CUDA 13 driver: 580 or later.
        drv=$(timeout 30 nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
        echo "driver: $drv"
        if [ "${drv%%.*}" -lt 580 ] 2>/dev/null; then
            echo "note: driver $drv is older than 580: a binary built by scripts/cuda_toolchain.sh (CUDA 13.0) will not load its kernels; build with this machine's CUDA 12 nvcc instead"
        fi
    fi
    echo "GPUs: $gpus"
else
    export PHALANX_HOST_KERNELS=0 # the "device" runs: the generic path
fi

if [ -n "${PHALANX_BIN:-}" ]; then
    bin=$PHALANX_BIN
    if [ "${bin%.gz}" != "$bin" ]; then # carried gzipped: unpacked here
        unpacked="${TMPDIR:-/tmp}/phalanx-gpu-check-bin"
        gunzip -c "$bin" >"$unpacked.tmp" && chmod +x "$unpacked.tmp" && mv "$unpacked.tmp" "$unpacked" ||
            { echo "PHALANX_BIN $bin: cannot unpack it"; failed=$((failed + 1)); finish; }
        echo "PHALANX_BIN $bin unpacked to $unpacked"
        bin=$unpacked
    fi
else
    features=cuda,nccl
    [ "$DEVICE" = cuda ] || features=nccl
    if ! command -v cargo >/dev/null; then
        echo "no cargo here to build with: build elsewhere (scripts/gpu_prepare.sh) and give PHALANX_BIN"
        failed=$((failed + 1))
        finish
    fi
    if [ "$DEVICE" = cuda ] && ! command -v nvcc >/dev/null; then
        # The toolchain's link stubs come from cudarc's sources: fetch first.
        cargo fetch --quiet || { echo "cargo fetch failed (no registry?): give PHALANX_BIN"; failed=$((failed + 1)); finish; }
        tc=$(scripts/cuda_toolchain.sh) || { echo "scripts/cuda_toolchain.sh failed (it downloads NVIDIA's wheels from PyPI: without a network, build the binary elsewhere and give PHALANX_BIN)"; failed=$((failed + 1)); finish; }
        eval "$tc"
    fi
    step "build (cargo build --release -p phalanx-cli --features $features)" 1200 \
        cargo build --release -p phalanx-cli --features "$features" || finish
    bin="${CARGO_TARGET_DIR:-target}/release/phalanx"
fi
if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then
    echo "the binary $bin is missing or not executable"
    failed=$((failed + 1))
    finish
fi

if [ "$DEVICE" = cuda ]; then
    # Every library the binary needs, found before anything runs: those it
    # links (ldd) and those it opens on its first CUDA call (a toolchain
    # build's lazy loader names them in the binary; scripts/cuda_lazy.py).
    # The libraries a toolchain build opens on first use, as the lazy
    # loader names them in the binary (grep when binutils' strings is not
    # there: minimal CUDA images lack it).
    lazy_libs() {
        if command -v strings >/dev/null; then
            strings -a "$bin"
        else
            grep -aoE 'phalanx-cuda-lazy: [[:graph:]]+' "$bin"
        fi | sed -n 's/^phalanx-cuda-lazy: //p' | sort -u
    }
    # A CUDA 13 build (cuBLAS 13 among what it opens) on a driver older
    # than 580 loads no kernel: every check would fail for that one reason.
    if [ "${drv%%.*}" -lt 580 ] 2>/dev/null && lazy_libs | grep -q '\.so\.13$'; then
        echo "driver $drv is older than 580, and this binary is a CUDA 13 build (it opens $(lazy_libs | grep '\.so\.13$' | head -1)): its kernels cannot load here; build it with this machine's CUDA 12 nvcc (PHALANX_BIN)"
        failed=$((failed + 1))
        finish
    fi
    libs_found() {
        local missing=0 so deps
        deps=$(ldd "$bin") || { echo "ldd $bin failed"; return 1; }
        grep 'not found' <<<"$deps" && missing=1
        for so in $(lazy_libs); do
            if python3 -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' "$so" 2>/dev/null ||
                ldconfig -p | grep -q "^[[:space:]]*$so "; then
                echo "opened on first use: $so (found)"
            else
                echo "opened on first use: $so not found"
                missing=1
            fi
        done
        [ $missing = 0 ] || echo 'missing: put them on LD_LIBRARY_PATH'
        return $missing
    }
    step "the binary's libraries (ldd, and those it opens on first use)" 30 libs_found || finish
    worlds="1"
    [ "$gpus" -ge 2 ] && worlds="1 2"
    [ "$BASICS" = 1 ] || worlds=""
    for n in $worlds; do
        step "NCCL collectives --check, world $n" 120 \
            "$bin" bench collectives --backend nccl --nproc "$n" --op all \
            --sizes 8:64M --factor 8 --iters 3 --warmup 1 --check
    done
    # Non-blocking communicators: creation, splits and launches answer
    # ncclInProgress and are polled under the deadline (nccl::progress).
    if [ "$BASICS" = 1 ]; then
        [ "$gpus" -ge 2 ] || skip "NCCL collectives --check, world 2" "needs 2 GPUs, this machine has $gpus"
        n=${worlds##* }
        step "NCCL collectives --check, world $n, non-blocking (NCCL_COMM_BLOCKING=0)" 120 \
            env NCCL_COMM_BLOCKING=0 "$bin" bench collectives --backend nccl --nproc "$n" \
            --op all --sizes 8:1M --factor 8 --iters 2 --warmup 1 --check
    fi
fi

# The optimizer's state and step on the device against the host's loop:
# chunks, pieces, frozen variance, parameters already there; then timed.
if [ "$DEVICE" = cuda ]; then opt_params=124M; else opt_params=4M; fi
if [ "$BASICS" = 1 ]; then
    step "optimizer on $DEVICE: --check against the host, timed over $opt_params elements" 180 \
        "$bin" bench optimizer --device "$DEVICE" --check --params "$opt_params" --steps 3
fi

# train NAME NPROC DEVICE HOST_KERNELS SET...: one `phalanx train` (from the
# checkpoint $RESUME when set), its per-step log in $LOG_DIR/NAME.jsonl, its
# output in NAME.out.
train() {
    local name=$1 n=$2 dev=$3 host=$4
    shift 4
    local sets=() secs rc
    for s in "$@"; do sets+=(--set "$s"); done
    secs=$(cap "${STEP_TIMEOUT:-300}")
    [ "$secs" -ge 5 ] || { echo "$name: no time left before DEADLINE"; return 124; }
    rm -f "$LOG_DIR/$name.ok"
    PHALANX_HOST_KERNELS=$host timeout "$secs" "$bin" train ${RESUME:+--resume "$RESUME"} \
        --nproc-per-node "$n" \
        --set train.device="\"$dev\"" --set train.eval_interval=0 \
        --set log.plot= --set log.report= "${sets[@]}" \
        --log-json "$LOG_DIR/$name.jsonl" >"$LOG_DIR/$name.out" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] && echo "$name: timed out after ${secs}s"
        tail -20 "$LOG_DIR/$name.out"
        return $rc
    fi
    touch "$LOG_DIR/$name.ok" # finished: its log is whole
}
# finished NAME...: each run finished (a partial log proves nothing).
finished() {
    local r
    for r in "$@"; do
        [ -f "$LOG_DIR/$r.ok" ] || { echo "run $r did not finish"; return 1; }
    done
}
# same A B TOL: every step's loss of run A within TOL relative of run B's.
same() {
    finished "$1" "$2" || return 1
    python3 - "$LOG_DIR/$1.jsonl" "$LOG_DIR/$2.jsonl" "$3" <<'EOF'
import json, sys
def losses(p):
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r}
a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
if not a or sorted(a) != sorted(b):
    sys.exit(f"steps differ: {sorted(a)} vs {sorted(b)}")
worst = max(abs(a[k] - b[k]) / abs(b[k]) for k in b)
print(f"{len(b)} steps, first loss {b[min(b)]:.5f}, last {b[max(b)]:.5f}; "
      f"largest relative difference {worst:.2e} (tolerance {tol:g})")
sys.exit(0 if worst <= tol else 1)
EOF
}
# no_reads NAME: no step of run NAME read a gradient back from the device
# (the step log's `grad_reads`, rank 0's process).
no_reads() {
    finished "$1" || return 1
    python3 - "$LOG_DIR/$1.jsonl" <<'EOF'
import json, sys
reads = [r.get("grad_reads") for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
print(f"gradient read-backs per step: {reads}")
sys.exit(0 if reads and all(x == 0 for x in reads) else 1)
EOF
}
# check NAME NPROC BASE TOL SET...: train NAME on the device, compare to BASE.
check() {
    local name=$1 n=$2 base=$3 tol=$4
    shift 4
    train "$name" "$n" "$DEVICE" "${PHALANX_HOST_KERNELS:-1}" "$@" && same "$name" "$base" "$tol"
}

gpt=(model.arch=\"gpt2\" model.n_layer=2 model.n_head=4 model.n_embd=64 model.block_size=32
    train.steps=8 optim.lr=0.003 optim.warmup_steps=2)
llama=(model.arch=\"llama\" model.n_layer=2 model.n_head=4 model.n_kv_head=2 model.n_embd=64
    model.intermediate_size=96 model.block_size=32 train.steps=8 optim.lr=0.003 optim.warmup_steps=2)
[ "$CHECKS" = 1 ] || FAMILIES=""
for fam in $FAMILIES; do
    declare -n m=$fam
    # The CPU's 1-rank runs (its own kernels), fp32 and bf16: global batch 8.
    step "$fam: CPU 1 rank (the reference)" 120 train "$fam-base" 1 cpu 1 "${m[@]}" train.micro_batch_size=8
    step "$fam: CPU 1 rank bf16" 120 train "$fam-base-bf16" 1 cpu 1 "${m[@]}" train.micro_batch_size=8 \
        train.precision=\"bf16\"
    b=$fam-base
    # One data-parallel rank: the gradients never leave the device.
    step "$fam: 1 rank" 120 check "$fam-1" 1 $b "$LOSS_TOL" "${m[@]}" train.micro_batch_size=8
    step "$fam: 1 rank read no gradient back" 10 no_reads "$fam-1"
    step "$fam: DDP 2 ranks" 120 check "$fam-ddp" 2 $b "$LOSS_TOL" "${m[@]}" train.micro_batch_size=4
    if [ "$DEVICE" = cpu ]; then # the rehearsal: host memory is the "device's"
        step "$fam: DDP 2 ranks reduced where the gradients lie" 10 no_reads "$fam-ddp"
    fi
    # Micro-batches DDP does not reduce hold their gradients on the device,
    # recomputation builds each block twice on the kept parameters.
    step "$fam: DDP 2 ranks, 4 micro-batches, full checkpointing" 120 check "$fam-ddp-accum" 2 $b \
        "$LOSS_TOL" "${m[@]}" train.micro_batch_size=1 train.grad_accum_steps=4 \
        train.activation_checkpointing=\"full\"
    # The optimizer's state and step are on the device unless offloaded:
    # DeepSpeed's offload_optimizer.device = cpu keeps them on the host.
    step "$fam: DDP 2 ranks, optimizer offloaded to the host" 120 check "$fam-ddp-offload" 2 $b \
        "$LOSS_TOL" "${m[@]}" train.micro_batch_size=4 zero_optimization.offload_optimizer.device=\"cpu\"
    for z in 1 2 3; do
        step "$fam: ZeRO-$z 2 ranks" 120 check "$fam-zero$z" 2 $b "$LOSS_TOL" "${m[@]}" \
            train.micro_batch_size=4 zero_optimization.stage=$z
    done
    if [ "$DEVICE" = cpu ]; then
        step "$fam: ZeRO-1 2 ranks reduced where the gradients lie" 10 no_reads "$fam-zero1"
        step "$fam: ZeRO-2 2 ranks reduced where the gradients lie" 10 no_reads "$fam-zero2"
        step "$fam: ZeRO-3 2 ranks gathered and reduced where the shards lie" 10 no_reads "$fam-zero3"
    fi
    # ZeRO-1 on one rank: its shard is the model, stepped in the kept copies.
    step "$fam: ZeRO-1 1 rank" 120 check "$fam-zero1-1" 1 $b "$LOSS_TOL" "${m[@]}" \
        train.micro_batch_size=8 zero_optimization.stage=1
    step "$fam: ZeRO-1 1 rank read no gradient back" 10 no_reads "$fam-zero1-1"
    step "$fam: tp 2" 120 check "$fam-tp" 2 $b "$LOSS_TOL" "${m[@]}" train.micro_batch_size=8 parallel.tp=2
    step "$fam: pp 2 (1f1b)" 120 check "$fam-pp" 2 $b "$LOSS_TOL" "${m[@]}" train.micro_batch_size=2 \
        train.grad_accum_steps=4 parallel.pp=2
    step "$fam: dp 2 x pp 2, ZeRO-1" 120 check "$fam-pp-zero1" 4 $b "$LOSS_TOL" "${m[@]}" \
        train.micro_batch_size=2 train.grad_accum_steps=2 parallel.pp=2 zero_optimization.stage=1
    if [ "$DEVICE" = cpu ]; then # each stage's gradients held and stepped where they lie
        step "$fam: pp 2 read no gradient back" 10 no_reads "$fam-pp"
        step "$fam: dp 2 x pp 2, ZeRO-1 read no gradient back" 10 no_reads "$fam-pp-zero1"
    fi
    step "$fam: dp 2 x pp 2 x tp 2" 180 check "$fam-3d" 8 $b "$LOSS_TOL" "${m[@]}" train.micro_batch_size=2 \
        train.grad_accum_steps=2 parallel.pp=2 parallel.tp=2
    step "$fam: full activation checkpointing, ZeRO-2" 120 check "$fam-recompute" 2 $b "$LOSS_TOL" "${m[@]}" \
        train.micro_batch_size=4 zero_optimization.stage=2 train.activation_checkpointing=\"full\"
    step "$fam: bf16" 120 check "$fam-bf16" 1 "$fam-base-bf16" 0.02 "${m[@]}" train.micro_batch_size=8 \
        train.precision=\"bf16\"
    if [ "$gpus" -ge 2 ]; then # one GPU per rank: NCCL carries the collectives
        # DDP's held gradients averaged where they lie (ncclAllReduce on
        # device memory, collective).
        PHALANX_BACKEND=nccl step "$fam: DDP 2 ranks over NCCL" 120 check "$fam-ddp-nccl" 2 $b \
            "$LOSS_TOL" "${m[@]}" train.micro_batch_size=4
        step "$fam: DDP over NCCL read no gradient back" 10 no_reads "$fam-ddp-nccl"
        PHALANX_BACKEND=nccl step "$fam: DDP 2 ranks over NCCL, 4 micro-batches" 120 check \
            "$fam-ddp-nccl-accum" 2 $b "$LOSS_TOL" "${m[@]}" train.micro_batch_size=1 train.grad_accum_steps=4
        PHALANX_BACKEND=nccl step "$fam: ZeRO-1 2 ranks over NCCL" 120 check "$fam-zero1-nccl" 2 $b \
            "$LOSS_TOL" "${m[@]}" train.micro_batch_size=2 train.grad_accum_steps=2 zero_optimization.stage=1
        step "$fam: ZeRO-1 over NCCL read no gradient back" 10 no_reads "$fam-zero1-nccl"
        # ZeRO-2 reduce-scatters each micro-batch's where they lie.
        PHALANX_BACKEND=nccl step "$fam: ZeRO-2 2 ranks over NCCL, 2 micro-batches" 120 check \
            "$fam-zero2-nccl" 2 $b "$LOSS_TOL" "${m[@]}" train.micro_batch_size=2 \
            train.grad_accum_steps=2 zero_optimization.stage=2
        step "$fam: ZeRO-2 over NCCL read no gradient back" 10 no_reads "$fam-zero2-nccl"
        # ZeRO-3 gathers each block from the shards on the devices and
        # reduce-scatters its gradients there (ncclBroadcast / ncclReduce
        # grouped where the shards cut a block unevenly).
        # Two blocks gathered ahead, each waited for by its own event.
        PHALANX_BACKEND=nccl step "$fam: ZeRO-3 2 ranks over NCCL, 2 micro-batches" 120 check \
            "$fam-zero3-nccl" 2 $b "$LOSS_TOL" "${m[@]}" train.micro_batch_size=2 \
            train.grad_accum_steps=2 zero_optimization.stage=3 parallel.forward_prefetch=2 \
            parallel.backward_prefetch=2
        step "$fam: ZeRO-3 over NCCL read no gradient back" 10 no_reads "$fam-zero3-nccl"
        # Each stage's gradients held, tied copies summed over NCCL there;
        # activations and their gradients between the stages by ncclSend /
        # ncclRecv on device memory (the pipeline's links).
        PHALANX_BACKEND=nccl step "$fam: pp 2 over NCCL" 120 check "$fam-pp-nccl" 2 $b "$LOSS_TOL" \
            "${m[@]}" train.micro_batch_size=2 train.grad_accum_steps=4 parallel.pp=2
        step "$fam: pp 2 over NCCL read no gradient back" 10 no_reads "$fam-pp-nccl"
        # Two chunks per stage: each link carries several chunks' messages.
        PHALANX_BACKEND=nccl step "$fam: pp 2 interleaved over NCCL" 120 check "$fam-ppi-nccl" 2 $b \
            "$LOSS_TOL" "${m[@]}" train.micro_batch_size=2 train.grad_accum_steps=4 parallel.pp=2 \
            parallel.pp_schedule=\"interleaved:2\"
        if [ "$gpus" -ge 4 ]; then
            PHALANX_BACKEND=nccl step "$fam: dp 2 x pp 2, ZeRO-1 over NCCL" 120 check "$fam-pp-zero1-nccl" 4 \
                $b "$LOSS_TOL" "${m[@]}" train.micro_batch_size=2 train.grad_accum_steps=2 parallel.pp=2 \
                zero_optimization.stage=1
            step "$fam: dp 2 x pp 2, ZeRO-1 over NCCL read no gradient back" 10 no_reads "$fam-pp-zero1-nccl"
        fi
        # Tensor parallelism's exchanges on the activations where they lie
        # (tp::comm: ncclAllReduce, ncclAllGather, ncclReduceScatter in
        # place) and the vocabulary-parallel loss in candle's ops.
        PHALANX_BACKEND=nccl step "$fam: tp 2 over NCCL" 120 check "$fam-tp-nccl" 2 $b "$LOSS_TOL" \
            "${m[@]}" train.micro_batch_size=8 parallel.tp=2
        step "$fam: tp 2 over NCCL read no gradient back" 10 no_reads "$fam-tp-nccl"
        PHALANX_BACKEND=nccl step "$fam: tp 2 with sequence parallelism over NCCL" 120 check \
            "$fam-sp-nccl" 2 $b "$LOSS_TOL" "${m[@]}" train.micro_batch_size=8 parallel.tp=2 \
            parallel.sequence_parallel=true
    elif [ "$DEVICE" = cuda ]; then
        skip "$fam: DDP, ZeRO-1/2/3, pp 2 (also interleaved), tp 2 (also sequence parallel) over NCCL" \
            "one GPU per rank: needs 2 GPUs, this machine has $gpus" 15
    fi
    if [ "$DEVICE" = cuda ] && [ "$gpus" -lt 4 ]; then
        skip "$fam: dp 2 x pp 2, ZeRO-1 over NCCL" "needs 4 GPUs, this machine has $gpus" 2
    fi
    unset -n m
done

# Resume across devices: 4 steps on one, the rest on the other.
resume() { # resume FROM HOST_KERNELS TO HOST_KERNELS
    local from=$1 hk_from=$2 to=$3 hk_to=$4 name="resume-$1$2-$3$4"
    local ck="$LOG_DIR/ck-$name"
    # decay_steps fixes the schedule, which train.steps would otherwise set.
    local c=(checkpoint.dir=\""$ck"\" checkpoint.interval=4 train.micro_batch_size=8 optim.decay_steps=8)
    # The reference, where step 4 did not run it (FAMILIES without gpt).
    [ -f "$LOG_DIR/gpt-base.ok" ] || train gpt-base 1 cpu 1 "${gpt[@]}" train.micro_batch_size=8 || return 1
    train "$name-a" 1 "$from" "$hk_from" "${gpt[@]}" "${c[@]}" train.steps=4 &&
        RESUME=$ck train "$name-b" 1 "$to" "$hk_to" "${gpt[@]}" "${c[@]}" &&
        cat "$LOG_DIR/$name-a.jsonl" "$LOG_DIR/$name-b.jsonl" >"$LOG_DIR/$name.jsonl" &&
        touch "$LOG_DIR/$name.ok" &&
        same "$name" gpt-base "$LOSS_TOL"
}
dev_hk=${PHALANX_HOST_KERNELS:-1} # the device's runs: 0 in the rehearsal
if [ "$CHECKS" = 1 ] && [ "$EXTRA" = 1 ]; then
step "resume: saved on $DEVICE, resumed on cpu" 180 resume "$DEVICE" "$dev_hk" cpu 1
step "resume: saved on cpu, resumed on $DEVICE" 180 resume cpu 1 "$DEVICE" "$dev_hk"
fi

# A rank whose step fails tells its peer why: rank 1 errs at step 3 (a test
# hook), and rank 0, waiting for it in the step's collective (over NCCL:
# inside an NCCL wait, which asks the native mesh), fails at once naming
# rank 1's error, long before PHALANX_TIMEOUT (600 s here).
fail_fast() { # fail_fast NAME
    local out="$LOG_DIR/$1.out"
    PHALANX_FAULT=error-at-step:1:3 PHALANX_TIMEOUT=600 train "$1" 2 "$DEVICE" "$dev_hk" "${gpt[@]}" \
        train.micro_batch_size=4 >/dev/null && { echo "the run did not fail"; return 1; }
    grep -E "^\[rank 0\].*rank 1 \(.*\) aborted: injected error at step 3 on rank 1" "$out" ||
        { echo "rank 0 did not name rank 1's error:"; tail -20 "$out"; return 1; }
}
if [ "$CHECKS" = 1 ] && [ "$EXTRA" = 1 ]; then
step "a rank's error reaches its peer at once (2 ranks on $DEVICE)" 90 fail_fast fail-fast
if [ "$gpus" -ge 2 ]; then
    PHALANX_BACKEND=nccl step "a rank's error reaches its peer at once over NCCL" 90 fail_fast fail-fast-nccl
elif [ "$DEVICE" = cuda ]; then
    skip "a rank's error reaches its peer at once over NCCL" "needs 2 GPUs, this machine has $gpus"
fi
fi

if [ "$DEVICE" = cuda ] && [ "$PERF" = 1 ]; then
    mfu() { # mfu NAME SET...: GPT-2 124M in bf16 on one GPU, its tokens/s and MFU
        local name=$1
        shift
        # 16 x 1024 tokens a step in micro-batches of 4: candle's composed
        # attention keeps its (B, H, T, T) scores in f32 until the backward,
        # about 5.6 GB a layer at micro-batch 16, more than 80 GB in all.
        train "$name" 1 cuda 1 model.arch=\"gpt2\" model.preset=\"gpt2-124m\" train.precision=\"bf16\" \
            train.micro_batch_size=4 train.grad_accum_steps=4 train.steps=30 optim.warmup_steps=2 "$@" &&
            python3 - "$LOG_DIR/$name.jsonl" "$PEAK_TFLOPS" "$*" <<'EOF'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "tokens_per_s" in r][10:]
tok = sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2]
n, L, C, T = 124_439_808, 12, 768, 1024  # GPT-2 124M (tied head), context 1024
flops = 6 * n + 12 * L * C * T           # per token, forward and backward
print(f"GPT-2 124M bf16 {sys.argv[3] or '(defaults)'}: {tok:,.0f} tokens/s (median of steps 10-29), "
      f"MFU {flops * tok / (float(sys.argv[2]) * 1e12):.1%} of {sys.argv[2]} TFLOP/s")
EOF
    }
    step "GPT-2 124M tokens/s and MFU (bf16, one GPU)" 300 mfu gpt2-124m
    # The same with the optimizer offloaded to the host (its state in host
    # memory, its step the host's loop, the gradients read back and the
    # parameters sent up every step): what keeping it on the device gains.
    step "GPT-2 124M tokens/s, optimizer offloaded to the host" 300 mfu gpt2-124m-offload \
        zero_optimization.offload_optimizer.device=\"cpu\"
    # One rank moves nothing over a bus (its bus bandwidth is 0 by
    # definition): the figure needs 2 GPUs.
    if [ "$gpus" -ge 2 ]; then
        step "NCCL all-reduce bus bandwidth at 1 MB / 64 MB / 1 GB, world 2" 120 \
            "$bin" bench collectives --backend nccl --nproc 2 --op all_reduce \
            --sizes 1M,64M,1G --iters 10 --warmup 3
    else
        skip "NCCL all-reduce bus bandwidth" "needs 2 GPUs, this machine has $gpus"
    fi
fi

finish
