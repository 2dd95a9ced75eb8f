//! Per-step fault tolerance across replica groups (torchft's model): a job
//! is R replica groups; a [`Lighthouse`] decides each step's quorum from
//! their joins and heartbeats, and each group's [`Manager`] averages over
//! that quorum only, so a lost group costs the others at most the step it
//! was lost in; a group that (re)joins heals from a live peer.
//!
//! Per step, a group's manager:
//! 1. [`Manager::quorum`]: reads the lighthouse's epoch (one store round trip
//!    when nothing changed); when it changed, waits for an epoch that holds
//!    this incarnation, connects a process group among its members (ranks by
//!    replica id, over the lighthouse's store), and says which member holds
//!    the most advanced state (the healer) and whether this group is behind;
//! 2. [`Manager::heal`] (after a change): every member receives the healer's
//!    state (parameters, optimizer state, step...) by broadcast, so all hold
//!    bitwise the same;
//! 3. [`Manager::all_reduce`]: the cross-group average of the step; an error
//!    (a member lost mid-step) reports the epoch as suspect and returns
//!    `Ok(false)`: the step does not commit, and the caller retries it with
//!    the next quorum, without the lost group.
//!
//! ```
//! use phalanx_comm::ft::{Lighthouse, LighthouseOpts, Manager, ManagerOpts};
//! let secret = b"0123456789abcdef0123456789abcdef".to_vec();
//! let lh = Lighthouse::start("127.0.0.1:0", secret.clone(), LighthouseOpts::default()).unwrap();
//! let addr = lh.addr().to_string();
//! let t: Vec<_> = ["a", "b"].iter().map(|id| {
//!     let (addr, secret) = (addr.clone(), secret.clone());
//!     let id = id.to_string();
//!     std::thread::spawn(move || {
//!         let mut m = Manager::connect(&addr, &secret, &id, ManagerOpts::default()).unwrap();
//!         // Wait for the quorum of both groups.
//!         let q = loop {
//!             let q = m.quorum(0).unwrap();
//!             if q.size == 2 { break q; }
//!             m.wait_change().unwrap();
//!         };
//!         let mut g = vec![if id == "a" { 1.0f32 } else { 3.0 }];
//!         assert!(m.all_reduce(&mut g).unwrap());
//!         (q.size, g[0])
//!     })
//! }).collect();
//! for h in t { assert_eq!(h.join().unwrap(), (2, 2.0)); }
//! ```

mod lighthouse;
mod manager;

pub use lighthouse::{Lighthouse, LighthouseOpts};
pub use manager::{Manager, ManagerOpts, Quorum};

/// A lighthouse store key.
pub(crate) fn key(k: &str) -> String {
    format!("ft/{k}")
}

/// A connection to the lighthouse's store at `addr` (its messages say "the
/// lighthouse", not "the rendezvous store").
pub(crate) fn connect(
    addr: &str,
    secret: &[u8],
    timeout: std::time::Duration,
) -> crate::error::Result<crate::store::StoreClient> {
    crate::store::StoreClient::connect_to("the lighthouse", addr, secret, timeout)
}

/// `id@inc,id@inc` → [(id, inc)].
pub(crate) fn parse_members(list: &str) -> Vec<(String, u64)> {
    list.split(',')
        .filter(|s| !s.is_empty())
        .filter_map(|m| {
            let (id, inc) = m.rsplit_once('@')?;
            Some((id.to_string(), inc.parse().ok()?))
        })
        .collect()
}
