//! Elastic membership for `phalanx run --nnodes MIN:MAX` (torchrun's c10d
//! rendezvous, on Phalanx's own authenticated store).
//!
//! Each node runs one agent. The agent on the `--rdzv-endpoint` host serves
//! the store (the first to bind it; the others connect). The job runs in
//! rounds: agents join round r, which closes when MAX nodes joined, when as
//! many joined as the previous round expects, or `last_call_timeout` after
//! MIN joined (while fewer than the previous round expects have joined,
//! the stop grace of 120 s longer: its nodes may still be saving); below
//! MIN for `join_timeout` the rendezvous fails, saying so. Node i of n runs
//! ranks i*nproc.. of n*nproc, with
//! `PHALANX_RESTART_COUNT` = r, so from round 1 on `phalanx train` resumes
//! from the latest checkpoint (resharded to the new world size, keeping its
//! global batch: `PHALANX_ELASTIC=1`).
//!
//! A round ends, and every agent stops its workers and joins the next, when:
//! - a node is lost: its heartbeat (a counter each agent bumps) stands still
//!   for `heartbeat_timeout` (a killed agent's workers die with it);
//! - a node waits to join, the round has fewer than MAX nodes and none of
//!   them is done;
//! - a worker fails: that counts against `--max-restarts` (the others do
//!   not); past it, every agent exits with the failure.
//!
//! Store keys, under `rdzv/{id}/`: `round`; per round `r{r}/joined` (a
//! counter), `r{r}/who/{i}` ("host:pid nproc"), `r{r}/closed` (n),
//! `r{r}/expect`, `r{r}/waiting`, `r{r}/next` (why it ended), `r{r}/done/{i}`;
//! `hb/{host:pid}`; `failures`.

use crate::launch::{
    catch_signals, run_group, threads_per_worker, JobEnv, LaunchOpts, Outcome, Stop,
};
use phalanx_comm::store::{StoreClient, StoreServer};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How an admission ends a round (the one reason that stops the workers
/// gracefully, at a step boundary).
const ADMITTING: &str = "admitting them";

/// Rendezvous timing (`--rdzv-timeout`, `--rdzv-conf`).
#[derive(Debug, Clone)]
pub struct Conf {
    pub join_timeout: Duration,
    pub last_call: Duration,
    pub heartbeat: Duration,
}

impl Conf {
    pub fn from_opts(o: &LaunchOpts) -> Result<Conf, String> {
        let mut c = Conf {
            join_timeout: phalanx_comm::config::wait_secs(o.rdzv_timeout as f64),
            last_call: Duration::from_secs(5),
            heartbeat: Duration::from_secs(15),
        };
        for kv in o.rdzv_conf.iter().flat_map(|s| s.split(',')) {
            let kv = kv.trim();
            if kv.is_empty() {
                continue;
            }
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("--rdzv-conf {kv}: expected key=value"))?;
            let secs: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s > 0.0)
                .ok_or_else(|| {
                    format!("--rdzv-conf {k}={v}: expected a positive number of seconds")
                })?;
            let d = phalanx_comm::config::wait_secs(secs);
            match k.trim() {
                "join_timeout" | "timeout" => c.join_timeout = d,
                "last_call_timeout" => c.last_call = d,
                "heartbeat_timeout" => c.heartbeat = d,
                k => {
                    return Err(format!(
                        "--rdzv-conf {k}: expected join_timeout, last_call_timeout or heartbeat_timeout"
                    ))
                }
            }
        }
        Ok(c)
    }
}

/// One formed round, as this node sees it.
struct Round {
    r: u64,
    node: usize,
    nodes: usize,
    /// "host:pid" of each node, by node rank.
    who: Vec<String>,
}

struct Rdzv<'a> {
    store: &'a StoreClient,
    id: String,
    endpoint: String,
    min: usize,
    max: usize,
    nproc: usize,
    me: String,
    conf: Conf,
    max_restarts: usize,
}

fn store_err(endpoint: &str, e: impl std::fmt::Display) -> String {
    format!(
        "lost the rendezvous store at {endpoint} ({e}): the agent on that host serves it, and an \
         elastic job cannot re-form without it (as with torchrun's c10d rendezvous, that host is a \
         single point of failure); start the job again: it resumes from its latest checkpoint"
    )
}

impl Rdzv<'_> {
    fn key(&self, k: &str) -> String {
        format!("rdzv/{}/{k}", self.id)
    }
    fn rkey(&self, r: u64, k: &str) -> String {
        self.key(&format!("r{r}/{k}"))
    }
    fn err(&self, e: impl std::fmt::Display) -> String {
        store_err(&self.endpoint, e)
    }
    fn get(&self, k: &str) -> Result<Option<String>, String> {
        Ok(self
            .store
            .try_get(k)
            .map_err(|e| self.err(e))?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }
    fn count(&self, k: &str, delta: i64) -> Result<i64, String> {
        self.store.add(k, delta).map_err(|e| self.err(e))
    }
    fn cas(&self, k: &str, expected: &str, desired: &str) -> Result<String, String> {
        self.store
            .compare_set(k, expected.as_bytes(), desired.as_bytes())
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .map_err(|e| self.err(e))
    }
    fn round(&self) -> Result<u64, String> {
        let k = self.key("round");
        let v = self.cas(&k, "", "0")?;
        v.parse()
            .map_err(|_| format!("rendezvous key {k} holds {v:?}"))
    }
    fn beat(&self) -> Result<(), String> {
        self.count(&self.key(&format!("hb/{}", self.me)), 1)
            .map(|_| ())
    }

    /// Fail once the job has failed more often than `--max-restarts` allows
    /// (checked while waiting, so no agent waits for nodes that stopped).
    fn check_failures(&self) -> Result<(), String> {
        let failures = self.count(&self.key("failures"), 0)? as usize;
        if failures > self.max_restarts {
            let r = self.round()?;
            let why = self.get(&self.rkey(r.saturating_sub(1), "next"))?;
            return Err(format!(
                "the job failed {failures} time(s), more than --max-restarts {}; last: {}",
                self.max_restarts,
                why.unwrap_or_default()
            ));
        }
        Ok(())
    }

    /// End round r for `why` (the first reason wins) and open the next one,
    /// expecting `expect` nodes; returns the reason that won.
    /// End round `r` for `why` (the first to end it wins), the next one
    /// expecting `expect` nodes; `stopping`: its nodes are healthy and
    /// finishing their step and checkpoint (an admission), so the next
    /// round waits for them past last call.
    fn end_round(
        &self,
        r: u64,
        why: &str,
        expect: usize,
        stopping: bool,
    ) -> Result<String, String> {
        let won = self.cas(&self.rkey(r, "next"), "", why)?;
        if won == why {
            if stopping {
                self.cas(&self.rkey(r + 1, "stopping"), "", "1")?;
            }
            self.cas(&self.rkey(r + 1, "expect"), "", &expect.to_string())?;
        }
        self.cas(&self.key("round"), &r.to_string(), &(r + 1).to_string())?;
        Ok(won)
    }

    /// Join the next round that admits this node and wait for it to close.
    fn join(&self) -> Result<Round, String> {
        let start = Instant::now();
        let mut waiting_in = None;
        let mut last_beat = Instant::now();
        loop {
            left_on_signal()?;
            if last_beat.elapsed() > self.conf.heartbeat / 5 {
                self.beat()?;
                last_beat = Instant::now();
            }
            self.check_failures()?;
            let r = self.round()?;
            if self.get(&self.rkey(r, "closed"))?.is_some() {
                // Round r runs without us: ask to be admitted at the next one.
                if waiting_in != Some(r) {
                    self.count(&self.rkey(r, "waiting"), 1)?;
                    waiting_in = Some(r);
                    crate::launch::tell!(
                        "phalanx run: rendezvous {}: round {r} is running; waiting to be admitted \
                         at the next round",
                        self.id
                    );
                }
                if start.elapsed() > self.conf.join_timeout {
                    return Err(format!(
                        "rendezvous {}: not admitted within {:?}: the job runs with {} nodes, the \
                         --nnodes maximum is {}",
                        self.id,
                        self.conf.join_timeout,
                        self.get(&self.rkey(r, "closed"))?.unwrap_or_default(),
                        self.max
                    ));
                }
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            let i = (self.count(&self.rkey(r, "joined"), 1)? - 1) as usize;
            self.store
                .set(
                    &self.rkey(r, &format!("who/{i}")),
                    format!("{} {}", self.me, self.nproc).as_bytes(),
                )
                .map_err(|e| self.err(e))?;
            let n = self.wait_closed(r, i, start)?;
            if i >= n {
                continue; // too late for round r: wait for r + 1
            }
            let mut who = Vec::with_capacity(n);
            for j in 0..n {
                let k = self.rkey(r, &format!("who/{j}"));
                let v = self.wait_key(&k, start)?;
                let (id, np) = v.rsplit_once(' ').unwrap_or((&v, "?"));
                if np != self.nproc.to_string() {
                    return Err(format!(
                        "rendezvous {}: node {id} runs {np} processes, this one {} (every node \
                         needs the same --nproc-per-node)",
                        self.id, self.nproc
                    ));
                }
                who.push(id.to_string());
            }
            return Ok(Round {
                r,
                node: i,
                nodes: n,
                who,
            });
        }
    }

    fn wait_key(&self, k: &str, start: Instant) -> Result<String, String> {
        loop {
            left_on_signal()?;
            if let Some(v) = self.get(k)? {
                return Ok(v);
            }
            if start.elapsed() > self.conf.join_timeout {
                return Err(format!("rendezvous {}: {k} never set", self.id));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait until round r closes (closing it when it may); its size.
    fn wait_closed(&self, r: u64, i: usize, start: Instant) -> Result<usize, String> {
        if i + 1 == self.max {
            self.cas(&self.rkey(r, "closed"), "", &self.max.to_string())?;
        }
        let expect: Option<usize> = self
            .get(&self.rkey(r, "expect"))?
            .and_then(|v| v.parse().ok());
        // Only after an admission are the nodes expected back healthy and
        // still saving; after a loss or a failure one may never return.
        let stopping = self.get(&self.rkey(r, "stopping"))?.is_some();
        let mut min_since: Option<Instant> = None;
        let mut last_beat = Instant::now();
        loop {
            left_on_signal()?;
            if let Some(v) = self.get(&self.rkey(r, "closed"))? {
                return v
                    .parse()
                    .map_err(|_| format!("rendezvous round {r} closed with {v:?}"));
            }
            if last_beat.elapsed() > self.conf.heartbeat / 5 {
                self.beat()?;
                last_beat = Instant::now();
            }
            self.check_failures()?;
            let joined = self.count(&self.rkey(r, "joined"), 0)? as usize;
            if joined >= self.min {
                let since = *min_since.get_or_insert_with(Instant::now);
                let all_back = expect.is_some_and(|e| joined >= e);
                // Nodes the last round expects back may still be finishing
                // their step and saving (up to STOP_GRACE): closing without
                // them would have the others resume an older checkpoint,
                // alone, and later overwrite the newer one.
                let last_call = match expect {
                    Some(_) if stopping && !all_back => {
                        crate::launch::STOP_GRACE + self.conf.last_call
                    }
                    _ => self.conf.last_call,
                };
                if all_back || since.elapsed() >= last_call {
                    let n = joined.min(self.max).to_string();
                    self.cas(&self.rkey(r, "closed"), "", &n)?;
                    continue;
                }
            } else if start.elapsed() > self.conf.join_timeout {
                return Err(format!(
                    "rendezvous {} at {}: only {joined} of the --nnodes minimum {} node(s) \
                     joined within {:?} (--rdzv-timeout); start more nodes with the same \
                     --rdzv-endpoint and --rdzv-id",
                    self.id, self.endpoint, self.min, self.conf.join_timeout
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The error a rendezvous wait returns when the agent was signalled.
const LEFT_ON_SIGNAL: &str = "signalled";

fn left_on_signal() -> Result<(), String> {
    if crate::launch::signalled() != 0 {
        return Err(LEFT_ON_SIGNAL.into());
    }
    Ok(())
}

/// Per node: the last heartbeat count seen and when it changed.
type Seen = HashMap<usize, (i64, Instant)>;

impl Rdzv<'_> {
    /// On the serving agent, after its workers succeeded: keep serving
    /// until every other node of the round is done or silent (or the
    /// rendezvous timeout passed), so that none loses the store while it
    /// finishes. It only reads: whatever else it sees (a node waiting to
    /// join, a round ended elsewhere) is for the nodes still running.
    ///
    /// A round the others ended meanwhile (a failure there) goes on
    /// without this node, in rounds it does not see: then it serves until
    /// every other node's heartbeat stopped (their agents exited), with no
    /// deadline of its own, as a live job needs its store.
    fn wait_done(&self, round: &Round) {
        let deadline = Instant::now() + self.conf.join_timeout;
        let mut seen = Seen::new();
        let mut last_beat = Instant::now();
        let mut moved_on = false;
        while (moved_on || Instant::now() < deadline) && crate::launch::signalled() == 0 {
            // Still beating: the others do not take this node for lost.
            if last_beat.elapsed() > self.conf.heartbeat / 5 {
                if self.beat().is_err() {
                    return;
                }
                last_beat = Instant::now();
            }
            moved_on = moved_on || self.round().is_ok_and(|r| r > round.r);
            match self.unfinished(round, !moved_on, &mut seen) {
                Ok(nodes) if nodes.iter().any(|&(_, silent)| !silent) => {}
                _ => return,
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The nodes of `round` other than this one that are not done (when
    /// `done_counts`), each with whether it is silent (its heartbeat stood
    /// still for the heartbeat timeout; `seen` keeps count). Posts nothing.
    fn unfinished(
        &self,
        round: &Round,
        done_counts: bool,
        seen: &mut Seen,
    ) -> Result<Vec<(usize, bool)>, String> {
        let mut out = Vec::new();
        for (j, who) in round.who.iter().enumerate() {
            if j == round.node
                || (done_counts
                    && self
                        .get(&self.rkey(round.r, &format!("done/{j}")))?
                        .is_some())
            {
                continue;
            }
            let beats = self.count(&self.key(&format!("hb/{who}")), 0)?;
            let now = Instant::now();
            let e = seen.entry(j).or_insert((beats, now));
            if e.0 != beats {
                *e = (beats, now);
            }
            out.push((j, now - e.1 > self.conf.heartbeat));
        }
        Ok(out)
    }
}

/// What an agent watches while its round runs (polled from `run_group`).
struct Watch<'a, 'b> {
    rd: &'a Rdzv<'b>,
    round: &'a Round,
    last_poll: Instant,
    last_beat: Instant,
    /// Per peer: the last heartbeat count seen and when it changed.
    seen: Seen,
    /// Whether a node waiting to join ends the round (only while this
    /// node's workers run: not while it waits for an outside cause of
    /// their failure, which would then pass for one).
    admit: bool,
    /// Why the store could not be reached (the job cannot go on).
    fatal: Option<String>,
}

impl<'a, 'b> Watch<'a, 'b> {
    fn new(rd: &'a Rdzv<'b>, round: &'a Round) -> Watch<'a, 'b> {
        Watch {
            rd,
            round,
            last_poll: Instant::now(),
            last_beat: Instant::now(),
            seen: Seen::new(),
            admit: true,
            fatal: None,
        }
    }

    /// A reason to end the round, if there is one.
    fn poll(&mut self) -> Option<String> {
        if self.fatal.is_some() {
            return self.fatal.clone();
        }
        if self.last_poll.elapsed() < Duration::from_millis(100) {
            return None;
        }
        self.last_poll = Instant::now();
        match self.check() {
            Ok(why) => why,
            Err(e) => {
                self.fatal = Some(e);
                self.fatal.clone()
            }
        }
    }

    /// As `poll`, for `run_group`: only an admission lets the (healthy)
    /// workers reach a step boundary first.
    fn stop(&mut self) -> Option<Stop> {
        let why = self.poll()?;
        let graceful = self.fatal.is_none() && why.ends_with(ADMITTING);
        Some(Stop { why, graceful })
    }

    /// Only the heartbeat (while this node stops its workers).
    fn beat_only(&mut self) {
        if self.fatal.is_none() && self.last_beat.elapsed() > self.rd.conf.heartbeat / 5 {
            match self.rd.beat() {
                Ok(()) => self.last_beat = Instant::now(),
                Err(e) => self.fatal = Some(e),
            }
        }
    }

    fn check(&mut self) -> Result<Option<String>, String> {
        let (rd, round) = (self.rd, self.round);
        let r = round.r;
        if self.last_beat.elapsed() > rd.conf.heartbeat / 5 {
            rd.beat()?;
            self.last_beat = Instant::now();
        }
        if let Some(why) = rd.get(&rd.rkey(r, "next"))? {
            return Ok(Some(why));
        }
        let unfinished = rd.unfinished(round, true, &mut self.seen)?;
        // A node that is done means the job is ending: nobody is admitted.
        let none_done = unfinished.len() + 1 == round.nodes;
        if self.admit && none_done && round.nodes < rd.max {
            let waiting = rd.count(&rd.rkey(r, "waiting"), 0)? as usize;
            if waiting > 0 {
                let expect = (round.nodes + waiting).min(rd.max);
                let why = format!("{waiting} node(s) asked to join: {ADMITTING}");
                return rd.end_round(r, &why, expect, true).map(Some);
            }
        }
        if let Some(&(j, _)) = unfinished.iter().find(|&&(_, silent)| silent) {
            let why = format!(
                "node {j} ({}) lost: no heartbeat for {:?}",
                round.who[j], rd.conf.heartbeat
            );
            return rd.end_round(r, &why, round.nodes - 1, false).map(Some);
        }
        Ok(None)
    }
}

/// Whether `host` names this machine (it may serve the store).
fn is_this_host(host: &str) -> bool {
    if phalanx_comm::init::is_loopback(host) {
        return true;
    }
    let me = phalanx::monitor::hostname();
    host.eq_ignore_ascii_case(&me) || binds_here(host)
}

/// Whether an address of `host` can be bound here; an IPv6 literal comes
/// in brackets from HOST:PORT (`[fd00::1]`), which the resolver refuses.
fn binds_here(host: &str) -> bool {
    let bare = host.trim().trim_start_matches('[').trim_end_matches(']');
    std::net::UdpSocket::bind((bare, 0)).is_ok()
}

/// `phalanx run --nnodes MIN:MAX`: the elastic agent of this node.
pub fn run_elastic(opts: &LaunchOpts, cmd: &[String]) -> Result<i32, String> {
    let (min, max) = opts.nnodes_range()?;
    let nproc = opts.nproc_per_node.unwrap_or(1);
    crate::local_ranks::check(nproc)?;
    let conf = Conf::from_opts(opts)?;
    let secret = match std::env::var("PHALANX_SECRET") {
        Ok(s) if !s.is_empty() => crate::launch::job_secret(&s)?,
        _ => {
            return Err(
                "an elastic job (--nnodes MIN:MAX with MIN < MAX, or --rdzv-backend c10d) needs the same \
                 PHALANX_SECRET (hex) exported on every node, e.g. \
                 `export PHALANX_SECRET=$(openssl rand -hex 32)`"
                    .into(),
            )
        }
    };
    let key = phalanx_comm::wire::from_hex(&secret).unwrap();
    let endpoint = opts.rdzv_endpoint.clone().unwrap_or_else(|| {
        phalanx_comm::init::host_port(&opts.master_addr, opts.master_port.unwrap_or(29400))
    });
    let (host, mut port) = crate::launch_opts::split_endpoint("--rdzv-endpoint", &endpoint)?;
    // Port 0 (torchrun --standalone's localhost:0): only a job of one node
    // on loopback, whose agent binds a free port and passes it on.
    let what = match &opts.rdzv_endpoint {
        Some(ep) => format!("--rdzv-endpoint {ep}"),
        None => format!("--master-port {port}"),
    };
    // One id for every round (a job of one node makes its own).
    let job_id = crate::launch::agreed_job_id(opts, max == 1);
    let alone = max == 1 && phalanx_comm::init::is_loopback(&host);
    crate::launch::check_port(&what, port, !alone)?;
    // The first agent on the endpoint's host serves the store, as torchrun's
    // c10d backend does; the others connect to it.
    let _server = if is_this_host(&host) {
        let bind = if phalanx_comm::init::is_loopback(&host) {
            endpoint.clone()
        } else {
            phalanx_comm::init::any_interface(&host, port)
        };
        match StoreServer::bind(&bind, key.clone()) {
            Ok(s) => Some(s),
            Err(e) if e.to_string().contains("in use") => None,
            Err(e) => return Err(e.to_string()),
        }
    } else {
        None
    };
    let endpoint = match &_server {
        Some(s) if port == 0 => {
            port = s.addr().port();
            phalanx_comm::init::host_port(&host, port)
        }
        _ => endpoint,
    };
    let serving = if _server.is_some() {
        " (serving it)"
    } else {
        ""
    };
    let store = StoreClient::connect(&endpoint, &key, conf.join_timeout)
        .map_err(|e| format!("rendezvous store at {endpoint}: {e}"))?;
    let me = format!("{}:{}", phalanx::monitor::hostname(), std::process::id());
    let rd = Rdzv {
        store: &store,
        id: opts.rdzv_id.clone(),
        endpoint: endpoint.clone(),
        min,
        max,
        nproc,
        me,
        conf,
        max_restarts: opts.max_restarts,
    };
    crate::launch::tell!(
        "phalanx run: elastic job {} at {endpoint}{serving}: --nnodes {min}:{max}, {nproc} \
         process(es) per node",
        rd.id
    );
    catch_signals();
    let threads = threads_per_worker(nproc);
    let mut ended: Option<Instant> = None;
    loop {
        let round = match rd.join() {
            Ok(r) => r,
            // Ctrl-C, or the scheduler's SIGTERM, while waiting for nodes:
            // leave now (the others see this node's heartbeat stop).
            Err(e) if e == LEFT_ON_SIGNAL => {
                let sig = crate::launch::signalled();
                crate::launch::say!(
                    "phalanx run: received signal {sig} while waiting in the rendezvous; leaving"
                );
                return Ok(128 + sig);
            }
            Err(e) => return Err(e),
        };
        let world = round.nodes * nproc;
        crate::launch::tell!(
            "phalanx run: round {} formed with {} node(s){}: this is node {} (ranks {}..{} of {world})",
            round.r,
            round.nodes,
            ended.map_or(String::new(), |t| format!(
                " {:.1} s after the last round ended",
                t.elapsed().as_secs_f64()
            )),
            round.node,
            round.node * nproc,
            (round.node + 1) * nproc,
        );
        let env = JobEnv {
            opts,
            secret: &secret,
            master_addr: &host,
            port,
            threads,
            nproc,
            node_rank: round.node,
            nnodes: round.nodes,
            run_id: format!("{}/r{}", rd.id, round.r),
            restart: round.r as usize,
            // Rounds also change for membership; torchrun's count is of
            // failures only.
            failure_restarts: rd.count(&rd.key("failures"), 0)? as usize,
            elastic: true,
            job_id: job_id.clone(),
        };
        let mut watch = Watch::new(&rd, &round);
        // (Stopping its workers, the agent only keeps its heartbeat: an
        // admission or a loss posted then would pass for the reason.)
        let outcome = run_group(&env, cmd, &mut |stopping| {
            if stopping {
                watch.beat_only();
                None
            } else {
                watch.stop()
            }
        })?;
        if let Some(f) = watch.fatal.take() {
            return Err(f);
        }
        match outcome {
            Outcome::Success => {
                let _ = store.set(&rd.rkey(round.r, &format!("done/{}", round.node)), b"1");
                if _server.is_some() {
                    // The others still need the store to finish: wait for
                    // them (or their heartbeats to stop).
                    rd.wait_done(&round);
                }
                return Ok(0);
            }
            Outcome::Signalled(sig) => {
                let why = format!("node {} ({}) left (signal {sig})", round.node, rd.me);
                let _ = rd.end_round(round.r, &why, round.nodes - 1, false);
                return Ok(128 + sig);
            }
            Outcome::Interrupted(why) => {
                // The reason the round ended, as posted (else what this node saw).
                let posted = rd.get(&rd.rkey(round.r, "next"))?;
                crate::launch::tell!(
                    "phalanx run: round {} ended: {}; re-forming",
                    round.r,
                    posted.unwrap_or(why)
                );
            }
            Outcome::Failed(code, why) => {
                // A worker that exited 1 may only have seen a peer's death:
                // watch for the heartbeat timeout whether the cause is
                // another node's.
                let mut elsewhere = None;
                if code == 1 {
                    // Only watch: a join request seen now would end the
                    // round as an admission, and this failure pass for
                    // one caused elsewhere (never counted).
                    watch.admit = false;
                    let until = Instant::now() + rd.conf.heartbeat + Duration::from_secs(1);
                    while Instant::now() < until
                        && elsewhere.is_none()
                        && crate::launch::signalled() == 0
                    {
                        elsewhere = watch.poll();
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    if let Some(f) = watch.fatal.take() {
                        return Err(f);
                    }
                }
                // Signalled while its workers were failing: this node
                // leaves (as on a signal mid-round), and the failure is not
                // booked against the others' --max-restarts.
                let sig = crate::launch::signalled();
                if sig != 0 && elsewhere.is_none() {
                    let why = format!("node {} ({}) left (signal {sig})", round.node, rd.me);
                    let _ = rd.end_round(round.r, &why, round.nodes - 1, false);
                    return Ok(128 + sig);
                }
                match elsewhere {
                    Some(cause) => {
                        crate::launch::tell!(
                            "phalanx run: round {} ended: {cause}; re-forming",
                            round.r
                        )
                    }
                    None => {
                        // The first reason posted wins: only that node's
                        // failure is counted.
                        let why = format!("node {} ({}): {why}", round.node, rd.me);
                        if rd.end_round(round.r, &why, round.nodes, false)? != why {
                            continue;
                        }
                        let n = rd.count(&rd.key("failures"), 1)? as usize;
                        if n > opts.max_restarts {
                            crate::launch::say!(
                                "phalanx run: {why}; failure {n}, more than --max-restarts {}: \
                                 the job stops",
                                opts.max_restarts
                            );
                            if _server.is_some() {
                                // The others learn it from the store (their
                                // next join fails naming it): serve them
                                // until they have left or gone silent.
                                rd.wait_done(&round);
                            }
                            return Ok(if code == 0 { 1 } else { code });
                        }
                        crate::launch::say!(
                            "phalanx run: {why}; restarting (restart {n} of {})",
                            opts.max_restarts
                        );
                    }
                }
            }
        }
        ended = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    const KEY: [u8; 32] = [7; 32];

    /// An agent's rendezvous over a store of its own on loopback.
    fn with_rdzv(max: usize, conf: Conf, f: impl FnOnce(&Rdzv, &str)) {
        let server = StoreServer::bind("127.0.0.1:0", KEY.to_vec()).unwrap();
        let addr = server.addr().to_string();
        let store = StoreClient::connect(&addr, &KEY, Duration::from_secs(10)).unwrap();
        let rd = Rdzv {
            store: &store,
            id: "t".into(),
            endpoint: addr.clone(),
            min: 1,
            max,
            nproc: 1,
            me: "me:1".into(),
            conf,
            max_restarts: 0,
        };
        f(&rd, &addr);
    }

    fn conf(heartbeat: Duration, last_call: Duration) -> Conf {
        Conf {
            join_timeout: Duration::from_secs(30),
            last_call,
            heartbeat,
        }
    }

    /// Round 0 of two nodes (of at most 3), as node 0 sees it.
    fn round() -> Round {
        Round {
            r: 0,
            node: 0,
            nodes: 2,
            who: vec!["me:1".into(), "peer:2".into()],
        }
    }

    #[test]
    fn an_ipv6_endpoint_host_in_brackets_is_bound_here() {
        // Only where this host has IPv6 loopback at all.
        if std::net::UdpSocket::bind("[::1]:0").is_err() {
            return;
        }
        assert!(binds_here("[::1]"));
        assert!(binds_here("::1"));
        assert!(binds_here("127.0.0.1"));
    }

    /// While it waits for an outside cause of its workers' failure, an
    /// agent only watches: a node waiting to join does not end the round
    /// (as an admission, which would pass the failure off as caused
    /// elsewhere); while its workers run, it does.
    #[test]
    fn only_a_running_round_admits_a_waiting_node() {
        let c = conf(Duration::from_secs(15), Duration::from_secs(5));
        with_rdzv(3, c, |rd, _| {
            let round = round();
            rd.count(&rd.rkey(0, "waiting"), 1).unwrap();
            let mut watch = Watch::new(rd, &round);
            watch.admit = false;
            assert_eq!(watch.check().unwrap(), None);
            assert_eq!(rd.get(&rd.rkey(0, "next")).unwrap(), None);
            watch.admit = true;
            let why = watch.check().unwrap().unwrap();
            assert!(why.ends_with(ADMITTING), "{why}");
            assert_eq!(rd.get(&rd.rkey(0, "next")).unwrap(), Some(why));
            assert_eq!(rd.get(&rd.rkey(1, "expect")).unwrap().as_deref(), Some("3"));
        });
    }

    /// Once a node of the round is done the job is ending: nobody is
    /// admitted (the others would stop their workers for nothing).
    #[test]
    fn a_round_with_a_node_done_admits_nobody() {
        let c = conf(Duration::from_secs(15), Duration::from_secs(5));
        with_rdzv(3, c, |rd, _| {
            let round = round();
            rd.count(&rd.rkey(0, "waiting"), 1).unwrap();
            rd.store.set(&rd.rkey(0, "done/1"), b"1").unwrap();
            let mut watch = Watch::new(rd, &round);
            assert_eq!(watch.check().unwrap(), None);
            assert_eq!(rd.get(&rd.rkey(0, "next")).unwrap(), None);
        });
    }

    /// The serving agent, done first, keeps serving while another node is
    /// still finishing (beating), whoever waits to join, and posts nothing.
    #[test]
    fn the_serving_agent_serves_until_every_node_is_done() {
        let c = conf(Duration::from_secs(5), Duration::from_secs(5));
        with_rdzv(3, c, |rd, addr| {
            let round = round();
            rd.count(&rd.rkey(0, "waiting"), 1).unwrap();
            let finished = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|s| {
                s.spawn(|| {
                    // The other node: beats a while, then is done.
                    let peer = StoreClient::connect(addr, &KEY, Duration::from_secs(10)).unwrap();
                    for _ in 0..20 {
                        peer.add("rdzv/t/hb/peer:2", 1).unwrap();
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    finished.store(true, Ordering::SeqCst);
                    peer.set("rdzv/t/r0/done/1", b"1").unwrap();
                });
                rd.wait_done(&round);
                assert!(
                    finished.load(Ordering::SeqCst),
                    "stopped serving before the other node was done"
                );
            });
            assert_eq!(rd.get(&rd.rkey(0, "next")).unwrap(), None);
        });
    }

    /// A round the others ended (a failure there) goes on without the
    /// serving agent: it serves, past its rendezvous timeout, while their
    /// heartbeats go on.
    #[test]
    fn the_serving_agent_serves_a_round_it_is_not_in_while_it_runs() {
        // (A heartbeat timeout well above the peer's 20 ms beats, so a
        // stalled thread on a loaded machine does not end the wait.)
        let mut c = conf(Duration::from_secs(1), Duration::from_secs(5));
        c.join_timeout = Duration::from_millis(200);
        with_rdzv(3, c, |rd, addr| {
            let round = round();
            rd.store.set(&rd.key("round"), b"1").unwrap();
            let finished = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|s| {
                s.spawn(|| {
                    // The other node, in round 1: beats well past the
                    // serving agent's timeout, never done in round 0.
                    let peer = StoreClient::connect(addr, &KEY, Duration::from_secs(10)).unwrap();
                    for _ in 0..40 {
                        peer.add("rdzv/t/hb/peer:2", 1).unwrap();
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    finished.store(true, Ordering::SeqCst);
                });
                rd.wait_done(&round);
                assert!(
                    finished.load(Ordering::SeqCst),
                    "stopped serving while the other node's round ran"
                );
            });
        });
    }

    /// ... or until its heartbeat stops.
    #[test]
    fn the_serving_agent_stops_waiting_for_a_silent_node() {
        let c = conf(Duration::from_millis(200), Duration::from_secs(5));
        with_rdzv(3, c, |rd, _| {
            rd.wait_done(&round());
            assert_eq!(rd.get(&rd.rkey(0, "next")).unwrap(), None);
        });
    }

    /// A round after an admission waits for the nodes it expects back
    /// (finishing their step and saving) past `last_call_timeout`, rather
    /// than forming without them.
    #[test]
    fn a_round_waits_past_last_call_for_the_nodes_it_expects() {
        let c = conf(Duration::from_secs(15), Duration::from_millis(100));
        with_rdzv(3, c, |rd, addr| {
            rd.store.set(&rd.rkey(1, "expect"), b"3").unwrap();
            rd.store.set(&rd.rkey(1, "stopping"), b"1").unwrap();
            rd.count(&rd.rkey(1, "joined"), 1).unwrap();
            let n = std::thread::scope(|s| {
                s.spawn(|| {
                    // The two old nodes, back from their stop well after
                    // last call.
                    std::thread::sleep(Duration::from_millis(500));
                    let other = StoreClient::connect(addr, &KEY, Duration::from_secs(10)).unwrap();
                    other.add("rdzv/t/r1/joined", 2).unwrap();
                });
                rd.wait_closed(1, 0, Instant::now()).unwrap()
            });
            assert_eq!(n, 3);
        });
    }

    /// After a loss or a failure (no admission), a node expected back
    /// may never return: the round closes at last call.
    #[test]
    fn a_round_after_a_loss_closes_at_last_call() {
        let c = conf(Duration::from_secs(15), Duration::from_millis(100));
        with_rdzv(3, c, |rd, _| {
            rd.store.set(&rd.rkey(1, "expect"), b"3").unwrap();
            rd.count(&rd.rkey(1, "joined"), 2).unwrap();
            let t = Instant::now();
            assert_eq!(rd.wait_closed(1, 0, Instant::now()).unwrap(), 2);
            assert!(t.elapsed() < crate::launch::STOP_GRACE, "{:?}", t.elapsed());
        });
    }
}
