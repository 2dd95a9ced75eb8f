#!/usr/bin/env bash
# Install a CPU-usable PyTorch from PyPI for the peer benchmarks.
#
#   bench/peers/install_torch.sh           # light (default): ~4.1 GB on disk
#   bench/peers/install_torch.sh --full    # plain `pip install torch`: ~5.4 GB
#
# Env: PYTHON (default python3; point it at a venv's python to install there),
#      TORCH_VERSION (default 2.15.0, the version these scripts were tried with).
#
# Why not just `pip install --no-deps torch`: PyPI's only Linux x86-64 torch
# wheel is the CUDA build, and libtorch.so / libtorch_python.so name the CUDA
# runtime libraries (cudart, cublas, cudnn, nccl, nvshmem, ...) as DT_NEEDED,
# so `import torch` fails without them even on a CPU-only machine
# ("OSError: libcudart.so.13: cannot open shared object file"). The CPU-only
# wheels live on PyTorch's own index, which this machine cannot reach.
#
# Light mode installs torch with --no-deps, then exactly torch's own declared
# requirements minus what a CPU run never loads: triton (~1 GB, GPU kernels
# for torch.compile), cuda-bindings, and the cusolver/nvtx parts of
# cuda-toolkit (cusolver is only dlopen'ed by libtorch_cuda_linalg.so on a
# GPU). The versions come from torch's metadata, so they always match.
# pip will warn that triton/cuda-bindings are missing; that is expected.
set -euo pipefail

PY=${PYTHON:-python3}
VER=${TORCH_VERSION:-2.15.0}
MODE=light
case "${1:-}" in
  --full) MODE=full ;;
  --light|"") ;;
  *) echo "usage: $0 [--light|--full]" >&2; exit 2 ;;
esac

check() {
  "$PY" - <<'EOF'
import torch, torch.distributed as dist
assert dist.is_available() and dist.is_gloo_available(), "gloo not available"
x = torch.randn(64, 64)
assert torch.isfinite(x @ x).all()
print(f"torch {torch.__version__} OK: gloo available, {torch.get_num_threads()} threads")
EOF
}

if "$PY" -c "import torch" 2>/dev/null && check 2>/dev/null; then
  echo "torch already installed and working for $PY"
  exit 0
fi

if [ "$MODE" = full ]; then
  "$PY" -m pip install "torch==$VER" numpy
else
  "$PY" -m pip install --no-deps "torch==$VER"
  mapfile -t REQS < <("$PY" - <<'EOF'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
SKIP = {"triton", "cuda-bindings", "setuptools"}
DROP_EXTRAS = {"cusolver", "nvtx"}
for line in requires("torch") or []:
    r = Requirement(line)
    if r.marker is not None and "extra" in str(r.marker):
        continue  # optional extras of torch itself
    if r.marker is not None and not r.marker.evaluate():
        continue
    name = r.name.lower().replace("_", "-")
    if name in SKIP:
        continue
    extras = sorted(e for e in r.extras if e not in DROP_EXTRAS)
    ex = f"[{','.join(extras)}]" if extras else ""
    print(f"{r.name}{ex}{r.specifier}")
EOF
)
  echo "installing torch's runtime deps (light): ${REQS[*]}"
  "$PY" -m pip install "${REQS[@]}" numpy
fi
check
