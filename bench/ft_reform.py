"""Time a surviving replica group loses when the other is killed, and the
time a restarted group takes to heal from it (fault_tolerance).

Two `phalanx train` groups of NPROC ranks (gpt-tiny) under `phalanx
lighthouse` on this host; group 1 (its launcher and ranks) is SIGKILLed when
group 0 prints step 50 and started again 3 s later. Prints group 0's step
times around the loss and group 1's time from its restart to its first
healed step. CKPT_INTERVAL > 0 also writes checkpoints every that many steps
(each group its own), to compare: healing never reads them.

usage: python3 bench/ft_reform.py HEARTBEAT_TIMEOUT [CKPT_INTERVAL [NPROC]]
(after cargo build --release)
"""
import os, socket, subprocess, sys, tempfile, threading, time, shutil, statistics
hb = sys.argv[1]
ckpt = int(sys.argv[2]) if len(sys.argv) > 2 else 0
nproc = sys.argv[3] if len(sys.argv) > 3 else "1"
repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
exe = os.path.join(repo, "target/release/phalanx")
d = tempfile.mkdtemp(prefix="phalanx-ft-bench-")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
env = dict(os.environ, PHALANX_SECRET="cd" * 32); env.pop("RANK", None)
lh = subprocess.Popen([exe, "lighthouse", "--bind", f"127.0.0.1:{port}", "--heartbeat-timeout", hb],
                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(0.5)
def group(g):
    args = [exe, "train", "--nproc-per-node", nproc, "--set", "train.steps=200", "--set", "log.interval=1",
            "--set", f"checkpoint.interval={ckpt}", "--set", f'checkpoint.dir="{d}/ckpt"',
            "--set", "train.eval_interval=0", "--set", 'log.plot=""', "--set", 'log.report=""',
            "--set", f'fault_tolerance.lighthouse="127.0.0.1:{port}"', "--set", f"fault_tolerance.replica_id={g}",
            "--set", "fault_tolerance.replicas=2", "--set", f"fault_tolerance.heartbeat_timeout={hb}"]
    p = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    lines = []
    t = threading.Thread(target=lambda: [lines.append((time.time(), l.rstrip())) for l in p.stdout]); t.start()
    return p, lines, t
a, la, ta = group(0)
b, lb, tb = group(1)
while not any("step    50/" in l for _, l in la): time.sleep(0.01)
tk = time.time(); os.killpg(b.pid, 9); b.wait(); tb.join()
time.sleep(3)
tr = time.time(); b2, lb2, tb2 = group(1)
a.wait(); b2.wait(); ta.join(); tb2.join(); lh.kill()
steps = [(ts, l) for ts, l in la if "] step " in l or "[#" in l]
times = [ts for ts, _ in steps]
gaps = [b - a for a, b in zip(times, times[1:])]
typical = statistics.median(gaps)
after = [ts for ts in times if ts > tk]
print(f"groups of {nproc} rank(s), checkpoint.interval {ckpt}, heartbeat {hb}s: group 0's median step {typical*1e3:.0f} ms; the step after the kill took "
      f"{(after[0]-tk)*1e3:.0f} ms from the kill (lost {(after[0]-tk-typical):.2f} s, 1 step rerun)")
healed = next(ts for ts, l in lb2 if "healed from group 0" in l)
first = next(ts for ts, l in lb2 if ts > healed and ("] step " in l or "[#" in l))
print(f"group 1 restarted: healed {healed-tr:.2f} s after its start, first step {first-tr:.2f} s; "
      f"{[l for _, l in lb2 if 'healed' in l][0]}")
print("exit", a.returncode, b2.returncode)
shutil.rmtree(d, ignore_errors=True)
