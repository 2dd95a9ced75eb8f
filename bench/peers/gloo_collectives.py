#!/usr/bin/env python3
"""PyTorch/gloo peer of `phalanx bench collectives`: an nccl-tests style sweep.

    python bench/peers/gloo_collectives.py --nproc 2 --op all_reduce \
        --sizes 8:256M --factor 4 --iters 20 --warmup 5 --dtype f32 [--json]

Starts --nproc local processes itself (torch.multiprocessing, gloo over TCP
on 127.0.0.1, a free port), each with torch.set_num_threads(max(1, cores //
nproc)) unless --threads is given, and sweeps the sizes for the chosen op(s):

  op              torch call                          size = bytes of
  all_reduce      dist.all_reduce (SUM, in place)     the buffer
  all_gather      dist.all_gather_into_tensor         the output (n chunks)
  reduce_scatter  dist.reduce_scatter_tensor (SUM)    the input (n chunks)
  broadcast       dist.broadcast from rank 0          the buffer
  all_to_all      dist.all_to_all_single              the per-rank buffer
  sendrecv        isend to rank+1, irecv from rank-1  the message

Counts are rounded down to a multiple of nproc (at least nproc) for
all_gather, reduce_scatter and all_to_all; the bytes reported are the real
ones. Time = mean over the timed iterations of one rank, then the MAX over
ranks (an all_reduce MAX). algbw = bytes / time; busbw = algbw x 2(n-1)/n for
all_reduce, x (n-1)/n for all_gather, reduce_scatter and all_to_all, x 1 for
broadcast and sendrecv. Like phalanx, sizes above 16 MiB run
max(2, ceil(iters/4)) timed iterations (--full-iters disables that).

If this torch's gloo lacks a *_tensor / *_single call, the op is emulated
(all_gather: list all_gather into views of the output; reduce_scatter:
all_reduce + own chunk; all_to_all: list all_to_all into views) and the
header (or the "impl" field in --json) says so. Note that even the native
gloo reduce_scatter_tensor is all_reduce + own chunk inside PyTorch
(pytorch/pytorch#118911, #149869): gloo has no real reduce-scatter there, so
it moves >= 2x the data of a ring reduce-scatter and its busbw reads low
(measured with torch 2.15 on 2 ranks: 1.3-1.9x the time of an all_reduce of
the same buffer).
"""

import argparse
import json
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "sendrecv"]
DTYPES = {
    "f32": torch.float32,
    "f64": torch.float64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i32": torch.int32,
    "i64": torch.int64,
}
BIG = 16 << 20  # above this many bytes, fewer timed iterations (as phalanx)


def parse_size(s):
    s = s.strip()
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10,
             "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
             "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
    i = 0
    while i < len(s) and s[i].isdigit():
        i += 1
    num, unit = s[:i], s[i:].upper()
    if not num or unit not in units:
        raise ValueError(f"bad size {s!r} (use e.g. 8, 64K, 1M, 2G)")
    return int(num) * units[unit]


def parse_sizes(spec, factor):
    if ":" in spec:
        lo, hi = (parse_size(x) for x in spec.split(":", 1))
        if lo == 0 or factor < 2 or lo > hi:
            raise ValueError(f"bad size range {spec!r} (factor {factor})")
        out, s = [], lo
        while s <= hi:
            out.append(s)
            s *= factor
        return out
    return [parse_size(x) for x in spec.split(",") if x.strip()]


def bus_factor(op, n):
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(fn):
    """True if the gloo call works on a tiny tensor."""
    try:
        fn()
        return True
    except (RuntimeError, NotImplementedError, AttributeError, ValueError):
        return False


def detect_impls(n, rank, dtype):
    """Which native calls this torch/gloo supports (all ranks probe alike)."""
    z = lambda k: torch.zeros(k, dtype=dtype)  # noqa: E731
    impl = {"all_reduce": "all_reduce", "broadcast": "broadcast",
            "sendrecv": "isend/irecv" if n > 1 else "local copy (1 rank)"}
    ok_ag = hasattr(dist, "all_gather_into_tensor") and probe(
        lambda: dist.all_gather_into_tensor(z(n), z(1)))
    impl["all_gather"] = "all_gather_into_tensor" if ok_ag else \
        "EMULATED: all_gather(list of output views)"
    ok_rs = hasattr(dist, "reduce_scatter_tensor") and probe(
        lambda: dist.reduce_scatter_tensor(z(1), z(n)))
    impl["reduce_scatter"] = ("reduce_scatter_tensor (torch builds it from gloo all_reduce; no real RS)"
                              if ok_rs else "EMULATED: all_reduce(input) + copy own chunk")
    ok_a2a = hasattr(dist, "all_to_all_single") and probe(
        lambda: dist.all_to_all_single(z(n), z(n)))
    impl["all_to_all"] = "all_to_all_single" if ok_a2a else \
        "EMULATED: all_to_all(lists of views)"
    dist.barrier()
    return impl, ok_ag, ok_rs, ok_a2a


def fill(t, seed):
    g = torch.Generator().manual_seed(seed)
    # small integers (0..15) as phalanx does: sums stay exact in every dtype
    t.copy_(torch.randint(0, 16, t.shape, generator=g).to(t.dtype))


def make_op(op, count, n, rank, dtype, native, check):
    """Return (run, verify) closures over freshly allocated buffers."""
    per = count // n
    ok_ag, ok_rs, ok_a2a = native
    if op == "all_reduce":
        a = torch.empty(count, dtype=dtype)
        fill(a, rank)
        ref = [fill_ref(count, r, dtype) for r in range(n)] if check else None
        run = lambda: dist.all_reduce(a)  # noqa: E731
        verify = lambda: torch.equal(a, sum(ref[1:], ref[0].clone()))  # noqa: E731
        return run, verify, lambda: fill(a, rank)
    if op == "all_gather":
        src = torch.empty(per, dtype=dtype)
        fill(src, rank)
        out = torch.empty(count, dtype=dtype)
        views = list(out.chunk(n))
        if ok_ag:
            run = lambda: dist.all_gather_into_tensor(out, src)  # noqa: E731
        else:
            run = lambda: dist.all_gather(views, src)  # noqa: E731
        verify = lambda: torch.equal(out, torch.cat([fill_ref(per, r, dtype) for r in range(n)]))  # noqa: E731
        return run, verify, lambda: None
    if op == "reduce_scatter":
        inp = torch.empty(count, dtype=dtype)
        fill(inp, rank)
        out = torch.empty(per, dtype=dtype)
        if ok_rs:
            run = lambda: dist.reduce_scatter_tensor(out, inp)  # noqa: E731
            refill = lambda: None  # noqa: E731
        else:
            tmp = torch.empty(count, dtype=dtype)

            def run():
                tmp.copy_(inp)
                dist.all_reduce(tmp)
                out.copy_(tmp[rank * per:(rank + 1) * per])
            refill = lambda: None  # noqa: E731

        def verify():
            full = sum((fill_ref(count, r, dtype) for r in range(1, n)), fill_ref(count, 0, dtype))
            return torch.equal(out, full[rank * per:(rank + 1) * per])
        return run, verify, refill
    if op == "broadcast":
        a = torch.empty(count, dtype=dtype)
        fill(a, 0 if rank == 0 else 1000 + rank)
        run = lambda: dist.broadcast(a, src=0)  # noqa: E731
        verify = lambda: torch.equal(a, fill_ref(count, 0, dtype))  # noqa: E731
        return run, verify, lambda: fill(a, 0 if rank == 0 else 1000 + rank)
    if op == "all_to_all":
        inp = torch.empty(count, dtype=dtype)
        fill(inp, rank)
        out = torch.empty(count, dtype=dtype)
        if ok_a2a:
            run = lambda: dist.all_to_all_single(out, inp)  # noqa: E731
        else:
            ov, iv = list(out.chunk(n)), list(inp.chunk(n))
            run = lambda: dist.all_to_all(ov, iv)  # noqa: E731
        # block j of out = block `rank` of rank j's input
        verify = lambda: torch.equal(out, torch.cat(  # noqa: E731
            [fill_ref(count, j, dtype)[rank * per:(rank + 1) * per] for j in range(n)]))
        return run, verify, lambda: None
    if op == "sendrecv":
        a = torch.empty(count, dtype=dtype)
        fill(a, rank)
        b = torch.empty(count, dtype=dtype)
        dst, src = (rank + 1) % n, (rank - 1) % n
        if n > 1:
            def run():
                reqs = [dist.isend(a, dst), dist.irecv(b, src)]
                for q in reqs:
                    q.wait()
        else:
            run = lambda: b.copy_(a)  # noqa: E731
        verify = lambda: torch.equal(b, fill_ref(count, src, dtype))  # noqa: E731
        return run, verify, lambda: None
    raise ValueError(op)


def fill_ref(count, seed, dtype):
    t = torch.empty(count, dtype=dtype)
    fill(t, seed)
    return t


def worker(rank, n, port, args, sizes, ops):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // n)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=n)
    dtype = DTYPES[args.dtype]
    esz = torch.empty(0, dtype=dtype).element_size()
    impl, *native = detect_impls(n, rank, dtype)
    rows, wrong = [], 0
    for op in ops:
        for size in sizes:
            count = max(1, size // esz)
            if op in ("all_gather", "reduce_scatter", "all_to_all"):
                count = max(1, count // n) * n
            nbytes = count * esz
            iters = args.iters
            if nbytes > BIG and not args.full_iters:
                iters = max(2, math.ceil(args.iters / 4))
            run, verify, refill = make_op(op, count, n, rank, dtype, native, args.check)
            for _ in range(args.warmup):
                run()
            if args.check:
                refill()
                run()
                bad = torch.tensor([0 if verify() else 1])
                dist.all_reduce(bad)
                wrong += int(bad.item())
                if rank == 0 and bad.item():
                    print(f"# CHECK FAILED: {op} {nbytes} B on {int(bad.item())} rank(s)",
                          file=sys.stderr, flush=True)
            dist.barrier()
            total = 0.0
            for _ in range(iters):
                t0 = time.perf_counter()
                run()
                total += time.perf_counter() - t0
            t = torch.tensor([total / iters], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            secs = t.item()
            algbw = nbytes / secs / 1e9
            rows.append({"op": op, "bytes": nbytes, "count": count, "dtype": args.dtype,
                         "nproc": n, "time_us": secs * 1e6, "algbw_gbps": algbw,
                         "busbw_gbps": algbw * bus_factor(op, n), "impl": impl[op]})
            del run, verify, refill
    if rank == 0:
        report(rows, n, threads, args, ops, impl)
    dist.barrier()
    dist.destroy_process_group()
    if wrong:
        raise SystemExit(f"gloo_collectives: {wrong} wrong results")


def report(rows, n, threads, args, ops, impl):
    if args.json:
        print(json.dumps(rows), flush=True)
        return
    print(f"# gloo_collectives (torch {torch.__version__}, backend gloo): {n} ranks, "
          f"{threads} threads/rank, warmup {args.warmup}, iters {args.iters}"
          f"{'' if args.full_iters else f' ({max(2, math.ceil(args.iters / 4))} above 16 MiB)'}, "
          f"check {'on' if args.check else 'off'}")
    for op in ops:
        print(f"# {op}: {impl[op]}")
    print(f"# {'op':<14} {'size(B)':>10} {'count':>10} {'type':>5} {'time(us)':>10} "
          f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
    for r in rows:
        print(f"  {r['op']:<14} {r['bytes']:>10} {r['count']:>10} {r['dtype']:>5} "
              f"{r['time_us']:>10.1f} {r['algbw_gbps']:>12.2f} {r['busbw_gbps']:>12.2f}")
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--op", default="all_reduce", help=f"one of {OPS} or all")
    p.add_argument("--sizes", default="8:64M", help='"8,1M,64M" or "lo:hi" (times --factor)')
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores // nproc)")
    p.add_argument("--full-iters", action="store_true", help="no fewer iterations above 16 MiB")
    p.add_argument("--check", action="store_true", help="verify one (untimed) result per size")
    p.add_argument("--json", action="store_true", help="print one JSON array instead of the table")
    args = p.parse_args()
    ops = OPS if args.op == "all" else [args.op]
    bad = [o for o in ops if o not in OPS]
    if bad or args.nproc < 1 or args.iters < 1 or args.warmup < 0:
        p.error(f"bad --op/--nproc/--iters/--warmup (ops: {OPS} or all)")
    try:
        sizes = parse_sizes(args.sizes, args.factor)
    except ValueError as e:
        p.error(str(e))
    port = free_port()
    try:
        mp.spawn(worker, args=(args.nproc, port, args, sizes, ops), nprocs=args.nproc, join=True)
    except mp.ProcessRaisedException as e:
        print(f"gloo_collectives: a rank failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"gloo_collectives: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
