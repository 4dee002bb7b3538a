"""Discounted returns and GAE on rollouts with terminations and time-limit truncations.

A corridor: the agent starts at a random cell 0..10, moves one cell right per step and
collects r(p) = cos(2 pi p / 12) + 0.5; stepping into cell 11 terminates the episode, and a
time limit of 8 steps truncates it. Environments reset automatically, as in gymnax or
vectorised gymnasium, so the observation after an episode's last step is the next
episode's first. The critic is exact, V(p) = r(p) + gamma V(p + 1), so every advantage
should be 0: any other value is the estimator's bias. Then the same GAE runs in every
scan mode on a bigger batch, with the same result.

    python examples/discounted_returns.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from ssmkit import rl

GAMMA, LAMBDA = 0.9, 0.95
EXIT, TIME_LIMIT = 11, 8


def reward(p: np.ndarray) -> np.ndarray:
  return np.cos(2 * np.pi * p / 12) + 0.5


def exact_values() -> np.ndarray:
  """V(p) for p = 0 .. EXIT - 1 (the exit cell is never observed)."""
  v = np.zeros(EXIT + 1)
  for p in range(EXIT - 1, -1, -1):
    v[p] = reward(p) + GAMMA * v[p + 1]
  return v[:EXIT]


def rollout(steps: int, envs: int, seed: int = 0):
  """Time-major arrays `(T, B)` of one rollout of auto-resetting corridors."""
  rng = np.random.default_rng(seed)
  cell = rng.integers(0, EXIT, envs)
  age = np.zeros(envs, int)
  obs, final_obs = np.zeros((steps, envs), int), np.zeros((steps, envs), int)
  terminated, truncated = np.zeros((steps, envs), bool), np.zeros((steps, envs), bool)
  for t in range(steps):
    obs[t] = cell
    nxt = cell + 1
    age += 1
    terminated[t] = nxt == EXIT
    truncated[t] = (age == TIME_LIMIT) & ~terminated[t]
    final_obs[t] = np.minimum(nxt, EXIT - 1)  # the cell the agent reached (read if truncated)
    done = terminated[t] | truncated[t]
    cell = np.where(done, rng.integers(0, EXIT, envs), nxt)
    age = np.where(done, 0, age)
  return obs, reward(obs), terminated, truncated, final_obs, cell


def main() -> None:
  v = exact_values()
  obs, rewards, terminated, truncated, final_obs, last_obs = rollout(steps=64, envs=16)
  values = np.concatenate([v[obs], v[last_obs][None]])  # V(s_0) ... V(s_T)
  discounts = GAMMA * ~terminated
  print(f"rollout: 64 steps x 16 envs, {terminated.sum()} terminations, {truncated.sum()} truncations")

  aware = rl.generalized_advantage_estimation(
      rewards, discounts, values, LAMBDA, truncated=truncated, final_values=v[final_obs]
  )
  as_termination = rl.generalized_advantage_estimation(
      rewards, np.where(truncated, 0.0, discounts), values, LAMBDA
  )
  ignored = rl.generalized_advantage_estimation(rewards, discounts, values, LAMBDA)
  print("mean |advantage| with an exact critic (0 is right):")
  for name, adv in [
      ("truncated + final_values", aware),
      ("truncation as termination", as_termination),
      ("truncation ignored (rlax)", ignored),
  ]:
    print(f"  {name:<26} {float(jnp.mean(jnp.abs(adv))):.2e}")
  returns = rl.discounted_returns(
      rewards, discounts, values[-1], truncated=truncated, final_values=v[final_obs]
  )
  # With an exact critic, the truncation-aware return is V(s_t) at every step.
  print(f"max |return - V(s_t)|: {float(jnp.max(jnp.abs(returns - v[obs]))):.2e}")

  steps, envs = 2048, 1024
  key_r, key_v, key_d = jax.random.split(jax.random.key(1), 3)
  rewards = jax.random.normal(key_r, (steps, envs))
  values = jax.random.normal(key_v, (steps + 1, envs))
  discounts = jnp.where(jax.random.uniform(key_d, (steps, envs)) < 0.01, 0.0, GAMMA)
  print(f"\nGAE on {steps} steps x {envs} envs, time-major, jitted (median of 20 calls):")
  reference = None
  for mode in ["sequential", "parallel", "chunked", "auto"]:
    gae = jax.jit(
        lambda r, d, v, mode=mode: rl.generalized_advantage_estimation(r, d, v, LAMBDA, mode=mode)
    )
    adv = gae(rewards, discounts, values).block_until_ready()
    times = []
    for _ in range(20):
      start = time.perf_counter()
      gae(rewards, discounts, values).block_until_ready()
      times.append(time.perf_counter() - start)
    ms = np.median(times) * 1e3
    reference = adv if reference is None else reference
    error = float(jnp.max(jnp.abs(adv - reference)))
    print(f"  {mode:>10}: {ms:6.2f} ms, max |A - A_sequential| = {error:.1e}")


if __name__ == "__main__":
  main()
