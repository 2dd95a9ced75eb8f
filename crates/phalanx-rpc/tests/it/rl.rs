//! Distributed RL: the cart-pole physics, and a learner that improves the
//! mean return on a fixed seed with observers on other ranks.

use phalanx_rpc::rl::cartpole::{CartPole, MAX_STEPS};
use phalanx_rpc::rl::{self, LearnerConfig, Rng};
use phalanx_rpc::rpc::{Options, Registry, Rpc};

#[test]
fn cartpole_follows_the_classic_equations() {
    let mut env = CartPole {
        state: [0.0; 4],
        steps: 0,
    };
    // One push right from rest (Gym CartPole-v0, explicit Euler, tau 0.02):
    // positions move only on the next step; the velocities change now.
    let (r, done) = env.step(1);
    assert_eq!((r, done), (1.0, false));
    let [x, xd, th, thd] = env.state;
    assert_eq!((x, th), (0.0, 0.0));
    let temp = 10.0f32 / 1.1;
    let thacc = -temp / (0.5 * (4.0 / 3.0 - 0.1 / 1.1));
    assert!((thd - 0.02 * thacc).abs() < 1e-6, "{thd}");
    assert!(
        (xd - 0.02 * (temp - 0.05 * thacc / 1.1)).abs() < 1e-6,
        "{xd}"
    );
    // Pushing right forever tips the pole over to the left, well before
    // the time limit.
    let mut n = 1;
    while !env.step(1).1 {
        n += 1;
    }
    assert!(env.state[2] < -0.2 && n < 20, "{n} steps, {:?}", env.state);
    // Any policy ends by the time limit.
    let mut rng = Rng::new(3);
    let mut env = CartPole::reset(&mut rng);
    assert!(env.state.iter().all(|v| v.abs() <= 0.05));
    let mut steps = 0;
    loop {
        steps += 1;
        let a = usize::from(env.state[2] + 0.5 * env.state[3] > 0.0);
        if env.step(a).1 {
            break;
        }
    }
    assert!(steps <= MAX_STEPS);
}

fn train(episodes: usize, asynchronous: bool) -> Vec<f32> {
    let out = phalanx_comm::threads::run(3, move |pg| {
        let mut reg = Registry::new();
        rl::serve_observer(&mut reg);
        let name = match pg.rank() {
            0 => "learner".to_string(),
            r => format!("observer{r}"),
        };
        let rpc = Rpc::start(&pg, &name, reg, Options::default()).unwrap();
        let mut returns = Vec::new();
        if pg.rank() == 0 {
            let cfg = LearnerConfig {
                max_episodes: episodes,
                seed: 11,
                stop_when_solved: false,
                asynchronous,
                ..LearnerConfig::default()
            };
            let obs = ["observer1".to_string(), "observer2".to_string()];
            returns = rl::learn(&rpc, &obs, &cfg).unwrap().returns;
        }
        rpc.shutdown().unwrap();
        returns
    });
    out.into_iter().next().unwrap()
}

fn mean(x: &[f32]) -> f32 {
    x.iter().sum::<f32>() / x.len() as f32
}

#[test]
fn the_learner_improves_the_mean_return_on_a_fixed_seed() {
    let r = train(240, false);
    assert_eq!(r.len(), 240);
    let (first, last) = (mean(&r[..40]), mean(&r[200..]));
    assert!(last > first + 20.0, "first 40: {first}, last 40: {last}");
    // Synchronous rounds are reproducible.
    assert_eq!(train(240, false), r);
}

#[test]
fn the_asynchronous_learner_improves_too() {
    let r = train(200, true);
    let (first, last) = (mean(&r[..40]), mean(&r[160..]));
    assert!(last > first + 20.0, "first 40: {first}, last 40: {last}");
}

#[test]
fn a_learner_without_observers_is_refused() {
    phalanx_comm::threads::run(1, |pg| {
        let rpc = Rpc::start(&pg, "learner", Registry::new(), Options::default()).unwrap();
        for asynchronous in [false, true] {
            let cfg = LearnerConfig {
                asynchronous,
                ..LearnerConfig::default()
            };
            let e = rl::learn(&rpc, &[], &cfg).unwrap_err();
            assert!(e.to_string().contains("at least one observer"), "{e}");
        }
        rpc.shutdown().unwrap();
    });
}
