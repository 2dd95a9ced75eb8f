"""DDP against LocalSGD-style DiLoCo and Streaming DiLoCo across a slow link.

Two data-parallel ranks of gpt-10m on this host, each its own DiLoCo group
(`[diloco]` in a plain job), or DDP. Two passes:

  loss   STEPS steps without network emulation: the loss after them (the
         mean of the last 10 steps' training losses and the final
         validation loss) and the bytes each rank sent per step
         (`comm_bytes_total` / steps). Training is the same bit for bit
         with or without emulation, so this pass needs no slow link.
  time   under PHALANX_NET_EMULATE (default bandwidth=100mbit,latency=10ms
         between the two ranks): wall-clock per step over STEPS steps
         (the sum of the logged step times / steps), which for DiLoCo must
         span at least one outer step (STEPS >= H).

usage: python3 bench/diloco_links.py loss 500
       python3 bench/diloco_links.py time 100 [--only ddp,h20,...] [--steps-ddp 20]
(after cargo build --release)
"""
import json, os, subprocess, sys, tempfile, shutil

repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
exe = os.path.join(repo, "target/release/phalanx")
mode, steps = sys.argv[1], int(sys.argv[2])
args = sys.argv[3:]
only = None
steps_ddp = steps
while args:
    a = args.pop(0)
    if a == "--only":
        only = args.pop(0).split(",")
    elif a == "--steps-ddp":
        steps_ddp = int(args.pop(0))
    else:
        sys.exit(f"unknown argument {a}")
emulate = os.environ.get("PHALANX_NET_EMULATE", "bandwidth=100mbit,latency=10ms")

RUNS = [
    ("ddp", "DDP", []),
    ("h20", "DiLoCo H=20", ["diloco.inner_steps=20"]),
    ("h50", "DiLoCo H=50", ["diloco.inner_steps=50"]),
    ("h100", "DiLoCo H=100", ["diloco.inner_steps=100"]),
    ("stream", "Streaming DiLoCo H=100, F=4, tau=1", ["diloco.inner_steps=100", "diloco.fragments=4"]),
    ("stream8", "Streaming DiLoCo H=100, F=4, tau=1, int8",
     ["diloco.inner_steps=100", "diloco.fragments=4", "diloco.quantize=true"]),
]

d = tempfile.mkdtemp(prefix="phalanx-diloco-bench-")
rows = []
for key, name, sets in RUNS:
    if only and key not in only:
        continue
    n = steps_ddp if key == "ddp" else steps
    log = os.path.join(d, f"{key}.jsonl")
    cmd = [exe, "train", "--nproc-per-node", "2", "--set", "model.preset=\"gpt-10m\"",
           "--set", f"train.steps={n}", "--set", 'log.plot=""', "--set", 'log.report=""',
           "--log-json", log]
    if mode == "time":
        cmd += ["--set", "train.eval_interval=0"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ)
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]:
        env.pop(v, None)
    if mode == "time":
        env["PHALANX_NET_EMULATE"] = emulate
    else:
        env.pop("PHALANX_NET_EMULATE", None)
    print("running", " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
    lines = [json.loads(l) for l in open(log)]
    last = lines[-1]
    per_step = last["comm_bytes_total"] / len(lines)
    if mode == "loss":
        tail = [l["loss"] for l in lines[-10:]]
        val = next((l["val_loss"] for l in reversed(lines) if l.get("val_loss") is not None), float("nan"))
        rows.append((name, f"{sum(tail)/len(tail):.4f}", f"{val:.4f}", f"{per_step:,.0f}"))
    else:
        wall = sum(l["step_ms"] for l in lines) / len(lines)
        rows.append((name, f"{len(lines)}", f"{wall:,.0f} ms", f"{per_step:,.0f}"))

if mode == "loss":
    print(f"| run | loss (mean of steps {steps-9}-{steps}) | val loss | bytes/step per rank |")
else:
    print(f"| run | steps timed | wall-clock per step ({emulate}) | bytes/step per rank |")
print("|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
shutil.rmtree(d, ignore_errors=True)
