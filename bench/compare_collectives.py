#!/usr/bin/env python3
"""Phalanx against torch.distributed (gloo), side by side in the same run.

Runs `phalanx bench collectives --json` and `bench/peers/gloo_collectives.py
--json` alternately, R rounds each, and prints the median time and busbw of
each (op, size) with the ratios Phalanx / gloo (busbw: higher is better;
time: lower is better).

    python bench/compare_collectives.py --nproc 2 --sizes 8,1M,64M --rounds 3
"""
import argparse, json, os, statistics, subprocess, sys

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)

p = argparse.ArgumentParser()
p.add_argument("--nproc", type=int, default=2)
p.add_argument("--op", default="all_reduce")
p.add_argument("--sizes", default="8,1M,64M")
p.add_argument("--iters", type=int, default=20)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--phalanx", default=os.path.join(root, os.environ.get("CARGO_TARGET_DIR", "target"), "release/phalanx"))
p.add_argument("--timeout", type=float, default=1800, help="seconds one run of either side may take")
a = p.parse_args()
if not os.access(a.phalanx, os.X_OK):
    sys.exit(f"{a.phalanx} not found: build first (cargo build --release -p phalanx-cli) or pass --phalanx")

common = ["--nproc", str(a.nproc), "--op", a.op, "--sizes", a.sizes, "--iters", str(a.iters), "--json"]
cmds = {
    "phalanx": [a.phalanx, "bench", "collectives"] + common,
    "gloo": [sys.executable, os.path.join(here, "peers/gloo_collectives.py")] + common,
}


def run(cmd):
    # Output is captured to parse the JSON, so on failure show the stderr
    # ourselves (check=True would only say "returned non-zero exit status");
    # the timeout keeps a hung rank from stalling the comparison for ever.
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        raise SystemExit(f"{' '.join(cmd)}: no result after {a.timeout:g} s (--timeout)\n{err}")
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stderr}")
    out = r.stdout
    for line in out.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[rank") else line
        if line.startswith("["):
            return json.loads(line)
    raise SystemExit(f"no JSON from {cmd}:\n{out}")


res = {k: {} for k in cmds}
for _ in range(a.rounds):
    for name, cmd in cmds.items():
        for row in run(cmd):
            res[name].setdefault((row["op"], row["bytes"]), []).append(row)

print(f"# {a.nproc} ranks, {a.rounds} rounds, medians; ratio = phalanx / gloo")
print(f"# {'op':<14} {'bytes':>10} {'phalanx us':>11} {'gloo us':>10} {'phalanx busbw':>14} {'gloo busbw':>11} {'busbw ratio':>12} {'time ratio':>11}")
for key in sorted(res["phalanx"]):
    ph, gl = res["phalanx"][key], res["gloo"].get(key)
    if not gl:
        continue
    med = lambda rows, f: statistics.median(r[f] for r in rows)
    pt, gt = med(ph, "time_us"), med(gl, "time_us")
    pb, gb = med(ph, "busbw_gbps"), med(gl, "busbw_gbps")
    ratio = f"{pb / gb:12.2f}" if gb > 0 else f"{'-':>12}"
    print(f"  {key[0]:<14} {key[1]:>10} {pt:>11.1f} {gt:>10.1f} {pb:>14.3f} {gb:>11.3f} {ratio} {pt / gt:>11.2f}")
