//! Which rank a failure started at, from what the failed ranks said.
//!
//! When a rank hangs (SIGSTOP, a stuck host) or dies, its peers are the
//! ones that exit, each with an error naming it (`rank 1 (host:port)
//! failed: no heartbeat for 1.5 s`, see `phalanx_comm::CommError`). The
//! launcher sees only that rank 0 exited 1; as torchrun's root-cause error
//! file does, it reads the failed ranks' last stderr lines and follows who
//! named whom to the rank the failure started at.

/// What a peer's error says about a named rank.
const VERDICTS: [&str; 3] = [") failed: ", ") aborted: ", ") stopped after an error: "];

/// An abort that passes on a timeout names a messenger, not a cause: in a
/// ring a rank waits for its neighbour, which may itself wait for the rank
/// that is stuck, so neither the aborting rank nor the one it waited for
/// is blamed on that word.
const MESSENGER: &str = ") aborted: timeout: ";

/// What a replica group's fault-tolerance manager says (`replica group
/// 0: the step's reduction failed (rank 2 (host) failed: ...)`) names the
/// ranks of the quorum across groups, which are other jobs, not this one's
/// ranks.
const ACROSS_GROUPS: &str = "replica group ";

/// Ranks other than `own` that `lines` name as failed, first named first.
pub fn named(lines: &[String], own: usize) -> Vec<usize> {
    let mut out = Vec::new();
    for line in lines {
        // What follows a replica group's words names other groups' ranks.
        let mut rest = line.split(ACROSS_GROUPS).next().unwrap_or("");
        while let Some(i) = rest.find("rank ") {
            rest = &rest[i + 5..];
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            let Ok(r) = digits.parse::<usize>() else {
                continue;
            };
            let after = &rest[digits.len()..];
            // `rank N (HOST) failed: …`: the host has no parentheses.
            let Some(host) = after.strip_prefix(" (") else {
                continue;
            };
            let Some(close) = host.find(')') else {
                continue;
            };
            let verdict = &host[close..];
            let blames = VERDICTS.iter().any(|v| verdict.starts_with(v));
            if r != own && blames && !verdict.starts_with(MESSENGER) && !out.contains(&r) {
                out.push(r);
            }
        }
    }
    out
}

/// Follow who named whom from `start` (a failed rank): the last rank of
/// the chain, if it is not `start`. `said(r)` is rank r's last stderr
/// lines (empty for a rank not on this node, or one that said nothing,
/// such as a stopped one).
pub fn follow(start: usize, said: impl Fn(usize) -> Vec<String>) -> Option<usize> {
    let mut seen = vec![start];
    let mut at = start;
    while let Some(&next) = named(&said(at), at).first() {
        if seen.contains(&next) {
            break;
        }
        seen.push(next);
        at = next;
    }
    (at != start).then_some(at)
}

/// How a process that has not been reaped stands, from /proc (Linux).
pub fn state(pid: u32) -> Option<&'static str> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The state follows the command name, which may hold anything but
    // ends at the last ')'.
    let s = stat[stat.rfind(')')? + 1..].trim_start().chars().next()?;
    Some(match s {
        'T' | 't' => "stopped (SIGSTOP or a debugger)",
        'D' => "in uninterruptible sleep",
        'Z' => "exited",
        _ => "still running",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn peers_named_as_failed_are_found_in_order() {
        let lines = l(&[
            "phalanx train: error: rank 0 (host0): rank 2 (127.0.0.1:4000) failed: no heartbeat",
            "rank 0: failed at iteration 3: rank 1 (127.0.0.1:5) aborted: x; rank 2 (h) failed: y",
            "rank 3 is mentioned without a verdict (h) failed: no",
        ]);
        assert_eq!(named(&lines, 0), vec![2, 1]);
        assert!(named(&l(&["rank 0 (h) failed: itself"]), 0).is_empty());
        // A timeout passed on names nobody: the rank waited for may be a
        // messenger too.
        let late = "rank 2 (h:2) aborted: timeout: all_reduce (collective #7) waited for rank 3 \
                    (h:1) past the deadline (PHALANX_TIMEOUT)";
        assert!(named(&l(&[late]), 0).is_empty());
        // The quorum's ranks across replica groups are other jobs.
        let ft = "replica group 0: the step's reduction failed (rank 2 (192.0.2.2:1) failed: \
                  shut down before reaching all_reduce); retrying with the next quorum";
        assert!(named(&l(&[ft]), 0).is_empty());
        // A peer of this job passing such an error on is still named.
        let passed = "rank 0 (h:1) aborted: I/O error: replica group 1: dropped from the quorum";
        assert_eq!(named(&l(&[passed]), 1), vec![0]);
    }

    #[test]
    fn the_chain_of_blame_ends_at_the_root_cause() {
        // 0 names 2, 2 names 1, 1 said nothing (stopped).
        let said = |r: usize| match r {
            0 => l(&["rank 2 (a) failed: gone"]),
            2 => l(&["rank 1 (b) failed: no heartbeat"]),
            _ => vec![],
        };
        assert_eq!(follow(0, said), Some(1));
        // A cycle stops where it closes; no naming at all is no answer.
        let cyc = |r: usize| l(&[&format!("rank {} (h) aborted: x", 1 - r)]);
        assert_eq!(follow(0, cyc), Some(1));
        assert_eq!(follow(0, |_| vec![]), None);
    }
}
