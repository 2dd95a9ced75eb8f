"""Time a surviving replica group loses when the other is killed, and the
time a restarted group takes to heal from it (fault_tolerance).

Two `phalanx train` groups of NPROC ranks (gpt-tiny) under `phalanx
lighthouse` on this host; group 1 (its launcher and ranks) is SIGKILLed when
group 0 prints step 50 and started again 3 s later. Prints group 0's step
times around the loss and group 1's time from its restart to its first
healed step. CKPT_INTERVAL > 0 also writes checkpoints every that many steps
(each group its own), to compare: healing never reads them.

usage: python3 bench/ft_reform.py HEARTBEAT_TIMEOUT [CKPT_INTERVAL [NPROC]]
(after cargo build --release; TIMEOUT, default 600, is how many seconds each
wait below may take before it gives up)
"""
import os, socket, subprocess, sys, tempfile, threading, time, shutil, statistics
hb = sys.argv[1]
ckpt = int(sys.argv[2]) if len(sys.argv) > 2 else 0
nproc = sys.argv[3] if len(sys.argv) > 3 else "1"
timeout = float(os.environ.get("TIMEOUT", 600))
repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
exe = os.path.join(repo, os.environ.get("CARGO_TARGET_DIR", "target"), "release/phalanx")
if not os.access(exe, os.X_OK):
    sys.exit(f"{exe} not found: build first (cargo build --release -p phalanx-cli)")
d = tempfile.mkdtemp(prefix="phalanx-ft-bench-")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
env = dict(os.environ, PHALANX_SECRET="cd" * 32); env.pop("RANK", None)
def group(g):
    args = [exe, "train", "--nproc-per-node", nproc, "--set", "train.steps=200", "--set", "log.interval=1",
            "--set", f"checkpoint.interval={ckpt}", "--set", f'checkpoint.dir="{d}/ckpt"',
            "--set", "train.eval_interval=0", "--set", 'log.plot=""', "--set", 'log.report=""',
            "--set", f'fault_tolerance.lighthouse="127.0.0.1:{port}"', "--set", f"fault_tolerance.replica_id={g}",
            "--set", "fault_tolerance.replicas=2", "--set", f"fault_tolerance.heartbeat_timeout={hb}"]
    p = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    groups.append(p)
    lines = []
    t = threading.Thread(target=lambda: [lines.append((time.time(), l.rstrip())) for l in p.stdout], daemon=True); t.start()
    return p, lines, t
def wait(name, p):
    """p.wait() with the deadline, so that a group that never ends cannot hang the bench."""
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"{name} did not finish within {timeout:g} s (TIMEOUT)")
lh = None; groups = []
try:
    lh = subprocess.Popen([exe, "lighthouse", "--bind", f"127.0.0.1:{port}", "--heartbeat-timeout", hb],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    a, la, ta = group(0)
    b, lb, tb = group(1)
    # Wait for group 0's step 50, failing (not spinning for ever) if a process
    # exits first or the deadline passes.
    deadline = time.time() + timeout
    while not any("step    50/" in l for _, l in la):
        for name, p, out in (("the lighthouse", lh, []), ("group 0", a, la), ("group 1", b, lb)):
            if p.poll() is not None:
                time.sleep(0.5)  # let the readers catch up with the last lines
                if any("step    50/" in l for _, l in la): break
                sys.exit(f"{name} exited with {p.returncode} before group 0's step 50"
                         + "".join(f"\n{l}" for _, l in out[-20:]))
        else:
            if time.time() > deadline:
                sys.exit(f"group 0 printed no step 50 within {timeout:g} s (TIMEOUT)")
            time.sleep(0.01)
    tk = time.time(); os.killpg(b.pid, 9); b.wait(); tb.join()
    time.sleep(3)
    tr = time.time(); b2, lb2, tb2 = group(1)
    wait("group 0", a); wait("group 1 (restarted)", b2); ta.join(); tb2.join()
finally:
    # Whatever happened above, leave no group, rank or lighthouse running and
    # no checkpoints behind.
    for p in groups:
        if p.poll() is None:
            os.killpg(p.pid, 9); p.wait()
    if lh is not None and lh.poll() is None:
        lh.kill(); lh.wait()
    shutil.rmtree(d, ignore_errors=True)
steps = [(ts, l) for ts, l in la if "] step " in l or "[#" in l]
times = [ts for ts, _ in steps]
gaps = [b - a for a, b in zip(times, times[1:])]
def missing(what, lines):
    sys.exit(f"{what}; its last lines:\n" + "\n".join(l for _, l in lines[-20:]))
if len(gaps) < 1:
    missing("group 0 printed fewer than two steps", la)
typical = statistics.median(gaps)
after = [ts for ts in times if ts > tk]
if not after:
    missing(f"group 0 printed no step after group 1 was killed (exit {a.returncode})", la)
print(f"groups of {nproc} rank(s), checkpoint.interval {ckpt}, heartbeat {hb}s: group 0's median step {typical*1e3:.0f} ms; the step after the kill took "
      f"{(after[0]-tk)*1e3:.0f} ms from the kill (lost {(after[0]-tk-typical):.2f} s, 1 step rerun)")
healed = next((ts for ts, l in lb2 if "healed from group 0" in l), None)
if healed is None:
    missing(f"the restarted group 1 printed no 'healed from group 0' (exit {b2.returncode})", lb2)
first = next((ts for ts, l in lb2 if ts > healed and ("] step " in l or "[#" in l)), None)
if first is None:
    missing(f"the restarted group 1 printed no step after healing (exit {b2.returncode})", lb2)
print(f"group 1 restarted: healed {healed-tr:.2f} s after its start, first step {first-tr:.2f} s; "
      f"{[l for _, l in lb2 if 'healed' in l][0]}")
print("exit", a.returncode, b2.returncode)
