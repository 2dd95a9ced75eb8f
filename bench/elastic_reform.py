"""Time from a node's loss to training again in an elastic job.

Two one-rank nodes (`phalanx train --nnodes 1:2`, gpt-tiny) on this host;
node B is SIGKILLed at step 50; prints how long after the kill node A's
job re-formed, resumed and ran its first step.

usage: python3 bench/elastic_reform.py HEARTBEAT_TIMEOUT CHECKPOINT_INTERVAL
(run from the repository, after `cargo build --release`)
"""
import subprocess, time, sys, os, threading, socket, shutil, tempfile
hb = sys.argv[1]; interval = sys.argv[2]
repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
d = os.path.join(tempfile.gettempdir(), f"phalanx-elastic-bench-{hb}-{interval}"); shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
args = [os.path.join(repo, "target/release/phalanx"), "train", "--set", "train.steps=400", "--set", "log.interval=1",
        "--set", f"checkpoint.interval={interval}", "--set", f'checkpoint.dir="{d}/ckpt"', "--set", "train.eval_interval=0",
        "--set", 'log.plot=""', "--set", 'log.report=""',
        "--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "m",
        "--rdzv-conf", f"heartbeat_timeout={hb},last_call_timeout=2"]
env = dict(os.environ, PHALANX_SECRET="ab"*32)
env.pop("RANK", None)
a = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
lines = []
def rd():
    for l in a.stdout:
        lines.append((time.time(), l.rstrip()))
t = threading.Thread(target=rd); t.start()
while not any("serving it" in l for _, l in lines): time.sleep(0.05)
b = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while not any("step    50/" in l for _, l in lines): time.sleep(0.02)
tk = time.time(); b.kill(); b.wait()
a.wait(); t.join()
after = [(ts, l) for ts, l in lines if ts > tk]
def first(p):
    for ts, l in after:
        if p in l: return ts - tk, l
formed = first("round 1 formed"); resumed = first("resumed from"); step = None
seen = False
for ts, l in after:
    if "resumed from" in l: seen = True
    elif seen and "step " in l and "/400" in l: step = (ts - tk, l); break
print(f"heartbeat {hb}s, checkpoint every {interval}: re-formed {formed[0]:.2f}s, resumed {resumed[0]:.2f}s, first step {step[0]:.2f}s after the kill")
print(resumed[1]); print(step[1])
print([l for _, l in after if "lost" in l or "elastic:" in l])
print("exit", a.returncode)
shutil.rmtree(d, ignore_errors=True)
