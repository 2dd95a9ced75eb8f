//! Schedule tables without training: valid for many (p, m, v), broken ones
//! rejected, printed one line per rank, stashes in flight per schedule,
//! simulated bubbles against theory, partitions against brute force.

use phalanx::strategy::pipeline::{Action, Costs, Partition, Schedule, ScheduleKind};
use phalanx_models::gpt2::train::build_engine;

use super::config;

const KINDS: [ScheduleKind; 6] = [
    ScheduleKind::Gpipe,
    ScheduleKind::OneFOneB,
    ScheduleKind::ZbH1,
    ScheduleKind::Interleaved { v: 2 },
    ScheduleKind::Interleaved { v: 3 },
    ScheduleKind::Interleaved { v: 4 },
];

#[test]
fn schedule_tables_are_valid_for_many_shapes() {
    for kind in KINDS {
        for p in 1..=8 {
            for m in 1..=3 * p + 2 {
                let s = Schedule::new(kind, p, m).unwrap_or_else(|e| panic!("{kind} {p} {m}: {e}"));
                s.validate().unwrap();
                let v = kind.chunks_per_rank();
                // Each (mb, chunk) once per pass, on its owner, F before B.
                for (r, acts) in s.ranks.iter().enumerate() {
                    let fwd: Vec<_> = acts
                        .iter()
                        .filter(|a| matches!(a, Action::Forward { .. }))
                        .collect();
                    assert_eq!(fwd.len(), m * v, "{kind} p {p} m {m} rank {r}");
                    for a in acts {
                        assert_eq!(a.chunk() % p, r);
                        if a.is_last_backward() {
                            let f = Action::Forward {
                                mb: a.mb(),
                                chunk: a.chunk(),
                            };
                            let pos = |x: &Action| acts.iter().position(|y| y == x).unwrap();
                            assert!(pos(&f) < pos(a), "{kind} p {p} m {m}: {a:?} before {f:?}");
                        }
                    }
                }
                let sends = s
                    .ranks
                    .iter()
                    .flatten()
                    .filter(|a| a.parts().0.starts_with('s'));
                let recvs = s
                    .ranks
                    .iter()
                    .flatten()
                    .filter(|a| a.parts().0.starts_with('r'));
                assert_eq!(sends.count(), recvs.count());
            }
        }
    }
}

#[test]
fn broken_tables_are_rejected() {
    let good = Schedule::new(ScheduleKind::OneFOneB, 3, 4).unwrap();
    let mutate = |f: &dyn Fn(&mut Schedule)| {
        let mut s = good.clone();
        f(&mut s);
        s.validate()
    };
    // A backward before its forward.
    assert!(mutate(&|s| {
        let r = &mut s.ranks[2];
        let i = r
            .iter()
            .position(|a| matches!(a, Action::Backward { .. }))
            .unwrap();
        r.swap(i, i - 1);
    })
    .is_err());
    // A receive dropped: its send has no match.
    assert!(mutate(&|s| s.ranks[1].retain(|a| *a != Action::RecvAct { mb: 2, chunk: 1 })).is_err());
    // A duplicated forward.
    assert!(mutate(&|s| s.ranks[0].push(Action::Forward { mb: 0, chunk: 0 })).is_err());
    // A micro-batch missing.
    assert!(mutate(&|s| s.ranks[0].retain(|a| a.mb() != 3)).is_err());
    // An action on the wrong rank.
    assert!(mutate(&|s| s.ranks[0][0] = Action::Forward { mb: 0, chunk: 1 }).is_err());
    // Every ordering rule respected but a cycle: rank 0 waits for the
    // gradient of mb 1 before sending mb 1's activation.
    let mut s = Schedule::new(ScheduleKind::Gpipe, 2, 2).unwrap();
    s.ranks[0] = vec![
        Action::Forward { mb: 0, chunk: 0 },
        Action::SendAct { mb: 0, chunk: 0 },
        Action::Forward { mb: 1, chunk: 0 },
        Action::RecvGrad { mb: 1, chunk: 0 },
        Action::SendAct { mb: 1, chunk: 0 },
        Action::Backward { mb: 1, chunk: 0 },
        Action::RecvGrad { mb: 0, chunk: 0 },
        Action::Backward { mb: 0, chunk: 0 },
    ];
    let e = s.validate().unwrap_err().to_string();
    assert!(e.contains("deadlock"), "{e}");
}

#[test]
fn tables_print_one_line_per_rank() {
    let s = Schedule::new(ScheduleKind::Gpipe, 2, 2).unwrap();
    assert_eq!(s.to_string(), "rank 0: F0 F1 B0 B1\nrank 1: F0 F1 B0 B1\n");
    assert_eq!(
        format!("{s:#}"),
        "rank 0: F0 sa0 F1 sa1 rg0 B0 rg1 B1\nrank 1: ra0 F0 ra1 F1 B0 sg0 B1 sg1\n"
    );
    let z = Schedule::new(ScheduleKind::ZbH1, 2, 3).unwrap();
    assert_eq!(
        z.to_string(),
        "rank 0: F0 F1 I0 W0 F2 I1 W1 I2 W2\nrank 1: F0 I0 F1 I1 W0 F2 I2 W1 W2\n"
    );
    let i = Schedule::new(ScheduleKind::Interleaved { v: 2 }, 2, 2).unwrap();
    assert!(i.to_string().starts_with("rank 0: F0.0 F1.0 F0.1"), "{i}");
    for k in ["gpipe", "1f1b", "interleaved:3", "zb-h1"] {
        assert_eq!(k.parse::<ScheduleKind>().unwrap().to_string(), k);
    }
    assert!("2f2b".parse::<ScheduleKind>().is_err());
}

#[test]
fn stashes_in_flight_per_schedule() {
    for p in 1..=6 {
        for m in 1..=2 * p + 2 {
            let peak = |k| Schedule::new(k, p, m).unwrap();
            let g = peak(ScheduleKind::Gpipe).peak_in_flight();
            let f = peak(ScheduleKind::OneFOneB).peak_in_flight();
            let z = peak(ScheduleKind::ZbH1);
            for s in 0..p {
                assert_eq!(g[s], m, "GPipe holds every micro-batch");
                assert_eq!(f[s], (p - s).min(m), "1F1B p {p} m {m} stage {s}");
                assert_eq!(z.peak_before_input_grad()[s], (p - s).min(m));
                assert!(
                    z.peak_in_flight()[s] <= p.min(m),
                    "ZB-H1 p {p} m {m} stage {s}"
                );
            }
        }
    }
}

#[test]
fn simulated_bubbles_match_theory() {
    let c = Costs::default();
    for p in 1..=6usize {
        for m in 1..=16usize {
            let theory = (p - 1) as f64 / (m + p - 1) as f64;
            for k in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
                let sim = Schedule::new(k, p, m).unwrap().simulate(&c).unwrap();
                for b in &sim.bubble {
                    assert!(
                        (b - theory).abs() < 1e-9,
                        "{k} p {p} m {m}: {b} vs {theory}"
                    );
                }
            }
            let f1 = Schedule::new(ScheduleKind::OneFOneB, p, m).unwrap();
            let zb = Schedule::new(ScheduleKind::ZbH1, p, m).unwrap();
            let zb_span = zb.simulate(&c).unwrap().makespan;
            assert!(zb_span <= f1.simulate(&c).unwrap().makespan + 1e-9);
            if m >= p {
                // Zero bubble in the steady state: F + I + W per micro-batch
                // plus (p - 1) (F + I - W).
                assert!(
                    (zb_span - (3 * m + p - 1) as f64).abs() < 1e-9,
                    "p {p} m {m}"
                );
            }
            for v in 2..=4usize {
                if m % p == 0 && p > 1 {
                    let k = ScheduleKind::Interleaved { v };
                    let sim = Schedule::new(k, p, m).unwrap().simulate(&c).unwrap();
                    let want = (p - 1) as f64 / (v * m + p - 1) as f64;
                    assert!((sim.bubble[0] - want).abs() < 1e-9, "{k} p {p} m {m}");
                }
            }
        }
    }
}

#[test]
fn partitions_balance_parameters_or_follow_sizes() {
    let engine = build_engine(&config(6)).unwrap();
    let l = engine.layout();
    let costs = phalanx::strategy::pipeline::partition::param_costs(l);
    for k in 1..=8 {
        let parts = Partition::Balanced.split(l, k).unwrap();
        assert_eq!(parts.len(), k);
        assert_eq!(parts[0].start, 0);
        assert_eq!(parts[k - 1].end, 8);
        assert!(parts
            .windows(2)
            .all(|w| w[0].end == w[1].start && !w[0].is_empty()));
        // No contiguous split has a smaller largest chunk (brute force).
        let max_of = |ps: &[std::ops::Range<usize>]| {
            ps.iter()
                .map(|r| costs[r.clone()].iter().sum::<f64>())
                .fold(0.0, f64::max)
        };
        let best = brute_force_best(&costs, k);
        assert!((max_of(&parts) - best).abs() < 1e-6, "k {k}");
    }
    let by_hand = Partition::Sizes(vec![3, 1, 4]).split(l, 3).unwrap();
    assert_eq!(by_hand, vec![0..3, 3..4, 4..8]);
    assert!(Partition::Sizes(vec![3, 1, 3]).split(l, 3).is_err());
    assert!(Partition::Sizes(vec![8, 0]).split(l, 2).is_err());
    assert!(Partition::Balanced.split(l, 9).is_err());
}

fn brute_force_best(costs: &[f64], k: usize) -> f64 {
    fn go(c: &[f64], k: usize) -> f64 {
        if k == 1 {
            return c.iter().sum();
        }
        (1..=c.len() - (k - 1))
            .map(|i| c[..i].iter().sum::<f64>().max(go(&c[i..], k - 1)))
            .fold(f64::INFINITY, f64::min)
    }
    go(costs, k)
}
