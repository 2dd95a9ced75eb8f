#!/usr/bin/env python3
"""Phalanx's Llama training against transformers' LlamaForCausalLM, interleaved.

    python bench/peers/llama_side_by_side.py --phalanx target/release/phalanx \
        --preset llama-60m --micro-batch 4 --steps 6 --repeats 3

For each repeat and each layout (1 rank x 2 threads, 2 ranks x 1 thread),
runs `phalanx train` and then torch_ddp_llama.py with the same model, batch,
context and data, and records each one's median tokens/s over the steps
after the 2 warm-up steps (Phalanx: from --log-json; torch: its JSON line).
Prints a line per run and, at the end, a table with the range over repeats
and each repeat's ratio (its two runs are adjacent in time) with their median. `uptime` is printed before and after.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 2
LAYOUTS = [(1, 2), (2, 1)]  # (ranks, threads per rank) on 2 cores


def phalanx_run(args, nproc, threads, tmp):
    log = os.path.join(tmp, "log.jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = [args.phalanx, "train", "--nproc-per-node", str(nproc),
           "--set", f"model.preset={args.preset}",
           "--set", f"train.micro_batch_size={args.micro_batch}",
           "--set", f"train.steps={args.steps}", "--set", "train.eval_interval=0",
           "--set", f"data.path={args.data}",
           "--set", f"log.plot={tmp}/loss.svg", "--set", f"log.report={tmp}/report.html",
           "--log-json", log]
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"phalanx failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    steps = [json.loads(line) for line in open(log)]
    tok = [s["tokens_per_s"] for s in steps if s["step"] >= WARMUP]
    return statistics.median(tok)


def torch_run(args, nproc, threads):
    cmd = [sys.executable, os.path.join(HERE, "torch_ddp_llama.py"), "--preset", args.preset,
           "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
           "--nproc", str(nproc), "--threads", str(threads), "--data", args.data]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"torch failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])["tokens_per_s_median"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phalanx", default="target/release/phalanx")
    p.add_argument("--preset", default="llama-60m")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data", default="data/corpus.txt")
    args = p.parse_args()
    if args.steps <= WARMUP:
        p.error(f"--steps must exceed the {WARMUP} warm-up steps")
    print("#", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
          flush=True)
    res = {(lay, who): [] for lay in LAYOUTS for who in ("phalanx", "torch")}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(1, args.repeats + 1):
            for nproc, threads in LAYOUTS:
                for who in ("phalanx", "torch"):
                    if who == "phalanx":
                        t = phalanx_run(args, nproc, threads, tmp)
                    else:
                        t = torch_run(args, nproc, threads)
                    res[((nproc, threads), who)].append(t)
                    print(f"repeat {rep}  {nproc} rank(s) x {threads} thread(s)  {who:7} "
                          f"{t:9.1f} tokens/s", flush=True)
    print("#", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"\n{args.preset}, micro-batch {args.micro_batch}, median tokens/s of steps "
          f"{WARMUP + 1}-{args.steps}, {args.repeats} repeats")
    print("| layout | Phalanx tokens/s | PyTorch tokens/s | Phalanx / PyTorch per repeat |")
    print("|---|---|---|---|")
    for nproc, threads in LAYOUTS:
        ph, to = res[((nproc, threads), "phalanx")], res[((nproc, threads), "torch")]
        ratios = [a / b for a, b in zip(ph, to)]
        # Ratios of the two runs of one repeat (adjacent in time, so under
        # about the same load), and their median.
        print(f"| {nproc} rank x {threads} thread{'s' if threads > 1 else ''} "
              f"| {min(ph):.0f}–{max(ph):.0f} | {min(to):.0f}–{max(to):.0f} "
              f"| {', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
