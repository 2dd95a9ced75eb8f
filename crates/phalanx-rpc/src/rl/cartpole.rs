//! The classic cart-pole (Barto, Sutton & Anderson 1983), with the
//! equations, constants and termination rules of Gym's CartPole-v0: a
//! reward of 1 per step, the episode ends when the pole leans more than
//! 12 degrees, the cart leaves ±2.4, or after 200 steps. Solved means a
//! mean return of at least 195 over 100 consecutive episodes.

use super::Rng;

pub const MAX_STEPS: usize = 200;
pub const SOLVED: f32 = 195.0;

const GRAVITY: f32 = 9.8;
const MASS_CART: f32 = 1.0;
const MASS_POLE: f32 = 0.1;
const TOTAL_MASS: f32 = MASS_CART + MASS_POLE;
/// Half the pole's length.
const LENGTH: f32 = 0.5;
const POLE_MASS_LENGTH: f32 = MASS_POLE * LENGTH;
const FORCE: f32 = 10.0;
/// Seconds between state updates (explicit Euler).
const TAU: f32 = 0.02;
const THETA_LIMIT: f32 = 12.0 * 2.0 * std::f32::consts::PI / 360.0;
const X_LIMIT: f32 = 2.4;

/// State: cart position, cart velocity, pole angle, pole angular velocity.
pub struct CartPole {
    pub state: [f32; 4],
    pub steps: usize,
}

impl CartPole {
    /// A new episode: every state variable uniform in ±0.05.
    pub fn reset(rng: &mut Rng) -> CartPole {
        CartPole {
            state: std::array::from_fn(|_| rng.uniform() * 0.1 - 0.05),
            steps: 0,
        }
    }

    /// Push left (action 0) or right (1); returns (reward, done).
    pub fn step(&mut self, action: usize) -> (f32, bool) {
        let [x, x_dot, theta, theta_dot] = self.state;
        let force = if action == 1 { FORCE } else { -FORCE };
        let (sin, cos) = theta.sin_cos();
        let temp = (force + POLE_MASS_LENGTH * theta_dot * theta_dot * sin) / TOTAL_MASS;
        let theta_acc = (GRAVITY * sin - cos * temp)
            / (LENGTH * (4.0 / 3.0 - MASS_POLE * cos * cos / TOTAL_MASS));
        let x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS;
        self.state = [
            x + TAU * x_dot,
            x_dot + TAU * x_acc,
            theta + TAU * theta_dot,
            theta_dot + TAU * theta_acc,
        ];
        self.steps += 1;
        let [x, _, theta, _] = self.state;
        let fell =
            !(-X_LIMIT..=X_LIMIT).contains(&x) || !(-THETA_LIMIT..=THETA_LIMIT).contains(&theta);
        (1.0, fell || self.steps >= MAX_STEPS)
    }
}
