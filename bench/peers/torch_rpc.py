"""rpc_sync round trip of torch.distributed.rpc (TensorPipe), the peer of
`cargo run --release -p phalanx-rpc --example rpc_bench`.

Two processes on this host; worker0 calls `echo(tensor)` on worker1 with a
uint8 tensor of 8 B, 64 KB and 4 MB (the payload goes there and back, as
in the Phalanx bench). Prints one JSON line per size: the mean round trip
in microseconds over `iters` calls after a warm-up, calls/s and MB/s
(payload bytes / round trip).

    python bench/peers/torch_rpc.py [--threads 1]
"""
import argparse
import json
import os
import socket
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

SIZES = [(8, 5000), (64 << 10, 2000), (4 << 20, 200)]


def echo(t):
    return t


def run(rank, port, threads):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        for size, iters in SIZES:
            x = torch.ones(size, dtype=torch.uint8)
            for _ in range(max(10, iters // 10)):
                rpc.rpc_sync("worker1", echo, args=(x,))
            t0 = time.perf_counter()
            for _ in range(iters):
                y = rpc.rpc_sync("worker1", echo, args=(x,))
            dt = (time.perf_counter() - t0) / iters
            assert y.numel() == size
            print(json.dumps({
                "peer": "torch.distributed.rpc (tensorpipe)",
                "torch": torch.__version__,
                "bytes": size,
                "iters": iters,
                "rtt_us": round(dt * 1e6, 1),
                "calls_per_s": round(1 / dt),
                "mb_per_s": round(size / dt / 1e6, 1),
            }), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(run, args=(port, a.threads), nprocs=2, join=True)
