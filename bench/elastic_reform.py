"""Time from a node's loss to training again in an elastic job.

Two one-rank nodes (`phalanx train --nnodes 1:2`, gpt-tiny) on this host;
node B is SIGKILLed at step 50; prints how long after the kill node A's
job re-formed, resumed and ran its first step.

usage: python3 bench/elastic_reform.py HEARTBEAT_TIMEOUT CHECKPOINT_INTERVAL
(run from the repository, after `cargo build --release`; TIMEOUT, default
600, is how many seconds each wait below may take before it gives up)
"""
import subprocess, time, sys, os, threading, socket, shutil, tempfile
hb = sys.argv[1]; interval = sys.argv[2]
timeout = float(os.environ.get("TIMEOUT", 600))
repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
exe = os.path.join(repo, os.environ.get("CARGO_TARGET_DIR", "target"), "release/phalanx")
if not os.access(exe, os.X_OK):
    sys.exit(f"{exe} not found: build first (cargo build --release -p phalanx-cli)")
d = os.path.join(tempfile.gettempdir(), f"phalanx-elastic-bench-{hb}-{interval}"); shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
args = [exe, "train", "--set", "train.steps=400", "--set", "log.interval=1",
        "--set", f"checkpoint.interval={interval}", "--set", f'checkpoint.dir="{d}/ckpt"', "--set", "train.eval_interval=0",
        "--set", 'log.plot=""', "--set", 'log.report=""',
        "--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "m",
        "--rdzv-conf", f"heartbeat_timeout={hb},last_call_timeout=2"]
env = dict(os.environ, PHALANX_SECRET="ab"*32)
env.pop("RANK", None)
lines = []
def wait_for(text, procs):
    """Wait for node A to print `text`; fail if a node exits first or the deadline passes
    (otherwise a node that dies early leaves this loop spinning for ever)."""
    deadline = time.time() + timeout
    while not any(text in l for _, l in lines):
        for name, p in procs:
            if p.poll() is not None:
                time.sleep(0.5)  # let the reader catch up with A's last lines
                if any(text in l for _, l in lines): return
                sys.exit(f"node {name} exited with {p.returncode} before node A printed {text!r}; node A's last lines:\n"
                         + "\n".join(l for _, l in lines[-20:]))
        if time.time() > deadline:
            sys.exit(f"node A printed no {text!r} within {timeout:g} s (TIMEOUT)")
        time.sleep(0.02)
a = b = None
try:
    a = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    def rd():
        for l in a.stdout:
            lines.append((time.time(), l.rstrip()))
    t = threading.Thread(target=rd, daemon=True); t.start()
    wait_for("serving it", [("A", a)])
    b = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for("step    50/", [("A", a), ("B", b)])
    tk = time.time(); b.kill(); b.wait()
    try:
        a.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"node A did not finish within {timeout:g} s (TIMEOUT) after B was killed")
    t.join()
finally:
    # Whatever happened above, leave no node running and no checkpoints behind
    # (each launcher's ranks die with it).
    for p in (a, b):
        if p is not None and p.poll() is None:
            p.kill(); p.wait()
    shutil.rmtree(d, ignore_errors=True)
after = [(ts, l) for ts, l in lines if ts > tk]
def first(p):
    for ts, l in after:
        if p in l: return ts - tk, l
formed = first("round 1 formed"); resumed = first("resumed from"); step = None
seen = False
for ts, l in after:
    if "resumed from" in l: seen = True
    elif seen and "step " in l and "/400" in l: step = (ts - tk, l); break
for what, got in (("'round 1 formed'", formed), ("'resumed from'", resumed), ("a step after the resume", step)):
    if got is None:
        sys.exit(f"node A printed no {what} after B was killed (exit {a.returncode}); its last lines:\n"
                 + "\n".join(l for _, l in lines[-20:]))
print(f"heartbeat {hb}s, checkpoint every {interval}: re-formed {formed[0]:.2f}s, resumed {resumed[0]:.2f}s, first step {step[0]:.2f}s after the kill")
print(resumed[1]); print(step[1])
print([l for _, l in after if "lost" in l or "elastic:" in l])
print("exit", a.returncode)
