//! Speaking PyTorch's TCPStore protocol to a real `torch.distributed.TCPStore`
//! (the server torchrun's agent runs): every operation the rendezvous uses,
//! keys visible from Python under the same names, a port that is not a
//! TCPStore refused at connect, and two ranks forming a group through it.
//!
//! These need Python with torch: they are ignored by default and run with
//! `cargo test --release -p phalanx-comm --test torch_store -- --ignored`,
//! with `PHALANX_PYTHON` naming that Python (default `python3`). `.ci/run`
//! installs torch in a virtual environment and runs them.

use phalanx_comm::store::StoreClient;
use phalanx_comm::{CommError, Config, DistEnv, ReduceOp};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

/// A TCPStore server in a Python child. It prints its port, then for each
/// line `k1 k2 ...` on stdin prints the values of those keys (`-` if absent).
struct TorchStore {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    port: u16,
}

const SERVER: &str = r#"
import sys, datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
print(s.port, flush=True)
for line in sys.stdin:
    out = []
    for k in line.split():
        out.append(s.get(k).decode() if s.check([k]) else "-")
    print(" ".join(out), flush=True)
"#;

impl TorchStore {
    fn start() -> TorchStore {
        let py = std::env::var("PHALANX_PYTHON").unwrap_or_else(|_| "python3".into());
        let mut child = Command::new(&py)
            .args(["-c", SERVER])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {py}: {e} (set PHALANX_PYTHON)"));
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let port = line.trim().parse().unwrap_or_else(|_| {
            panic!("{py} did not start a TCPStore (is torch installed?): {line:?}")
        });
        TorchStore {
            child,
            stdin,
            stdout,
            port,
        }
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// What Python's `TCPStore.get` returns for these keys.
    fn read(&mut self, keys: &[&str]) -> Vec<String> {
        writeln!(self.stdin, "{}", keys.join(" ")).unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.split_whitespace().map(String::from).collect()
    }
}

impl Drop for TorchStore {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
#[ignore = "needs Python with torch (PHALANX_PYTHON); run with --ignored"]
fn every_operation_against_a_real_tcpstore() {
    let mut srv = TorchStore::start();
    let c = StoreClient::connect_torch(&srv.addr(), Duration::from_secs(10)).unwrap();
    assert!(c.is_torch());
    c.set("a", b"1").unwrap();
    assert_eq!(c.get("a").unwrap(), b"1");
    assert_eq!(c.try_get("nope").unwrap(), None);
    assert_eq!(c.add("ctr", 5).unwrap(), 5);
    assert_eq!(c.add("ctr", -2).unwrap(), 3);
    assert_eq!(c.compare_set("cas", b"", b"first").unwrap(), b"first");
    assert_eq!(c.compare_set("cas", b"wrong", b"second").unwrap(), b"first");
    assert_eq!(
        c.compare_set("cas", b"first", b"second").unwrap(),
        b"second"
    );
    // Python sees the same names (torch's own client adds the same `/`).
    assert_eq!(
        srv.read(&["a", "ctr", "cas", "nope"]),
        ["1", "3", "second", "-"]
    );
    assert!(c.delete("cas").unwrap());
    assert!(!c.delete("cas").unwrap());
    assert_eq!(srv.read(&["cas"]), ["-"]);
    assert!(c.num_keys().unwrap() >= 2);

    // wait: times out naming the missing key, and wakes when another client sets it.
    let e = c
        .wait(&["a", "later"], Duration::from_millis(300))
        .unwrap_err();
    match e {
        CommError::Timeout(m) => assert!(m.contains("later") && !m.contains("a,"), "{m}"),
        e => panic!("expected a timeout, got {e}"),
    }
    let addr = srv.addr();
    let t = std::thread::spawn(move || {
        let d = StoreClient::connect_torch(&addr, Duration::from_secs(10)).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        d.set("later", b"now").unwrap();
    });
    c.wait(&["later"], Duration::from_secs(10)).unwrap();
    assert_eq!(c.get("later").unwrap(), b"now");
    t.join().unwrap();

    // A value bigger than any one frame of the rendezvous still round-trips.
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    c.set("big", &big).unwrap();
    assert_eq!(c.get("big").unwrap(), big);
}

#[test]
#[ignore = "needs Python with torch (PHALANX_PYTHON); run with --ignored"]
fn a_port_that_is_not_a_tcpstore_is_refused_at_connect() {
    // Phalanx's own store answers its handshake, not a TCPStore ping.
    let own = phalanx_comm::store::StoreServer::bind("127.0.0.1:0", b"0123456789abcdef".to_vec())
        .unwrap();
    let err = StoreClient::connect_torch(&own.addr().to_string(), Duration::from_secs(20))
        .err()
        .expect("not a TCPStore");
    assert!(
        matches!(err, CommError::Protocol(_)) && err.to_string().contains("TCPStore"),
        "{err}"
    );
}

#[test]
#[ignore = "needs Python with torch (PHALANX_PYTHON); run with --ignored"]
fn two_ranks_form_a_group_through_the_agents_store() {
    let srv = TorchStore::start();
    let port = srv.port;
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let env = DistEnv {
                    rank,
                    world_size: 2,
                    local_rank: rank,
                    local_world_size: 2,
                    master_addr: "127.0.0.1".into(),
                    master_port: port,
                    secret: b"a-test-secret-of-32-bytes-......".to_vec(),
                    secret_file: None,
                    store_hosted: false,
                    agent_store: true,
                    source: "torchrun",
                    run_id: "test/attempt_0".into(),
                };
                let cfg = Config {
                    timeout: Duration::from_secs(30),
                    ..Config::default()
                };
                let pg = phalanx_comm::init::init_with(&env, cfg).unwrap();
                let mut v = vec![rank as f32 + 1.0; 5];
                pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                v
            })
        })
        .collect();
    for r in ranks {
        assert_eq!(r.join().unwrap(), vec![3.0; 5]);
    }
    drop(srv);
}
