"""Rollouts of a recurrent policy in vectorised environments, and their advantages.

A rollout runs the policy one step at a time (`SequenceModel.step`) in a `lax.scan` over time, the
environments `vmap`ped. Episodes run on across rollouts, so a rollout starts from the recurrent
state the previous one ended with, and keeps that state for the update.

References:
  Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation", ICLR 2016.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit import rl
from ssmkit._src.train.ppo.agent import Agent
from ssmkit._src.train.ppo.env import VecEnv

Array = jax.Array


class ActorState(NamedTuple):
  """Where the environments and the policy stand between rollouts."""

  env_state: Any  # the environments' states
  obs: Array  # (B, F) float32 observations to act on next
  first: Array  # (B,) bool: `obs` starts an episode
  policy_state: Any  # the recurrent state before `obs`
  episode_return: Array  # (B,) float32 rewards so far of the running episodes


class Rollout(NamedTuple):
  """`T` steps of `B` environments; per-step fields are `(T, B, ...)`, time first."""

  obs: Array  # (T, B, F) float32 observations acted on
  first: Array  # (T, B) bool: obs[t] starts an episode
  action: Array  # (T, B) int32
  logits: Array  # (T, B, A) float32 policy logits of the acting parameters
  value: Array  # (T, B) float32 values v(s_t)
  reward: Array  # (T, B) float32 reward after action[t]
  terminated: Array  # (T, B) bool: the episode ended after action[t]
  truncated: Array  # (T, B) bool: the episode was cut by the time limit after action[t]
  final_value: Array  # (T, B) float32 value of the final observation where truncated, else 0
  episode_return: Array  # (T, B) float32 return of the episode ending after step t, else 0
  last_value: Array  # (B,) float32 value of the observation after the last step, v(s_T)
  initial_state: Any  # the recurrent state before step 0


def init_actor(agent: Agent, env: VecEnv, key: Array) -> ActorState:
  """Fresh episodes in every environment and a zero recurrent state."""
  obs, env_state = env.reset(key)
  return ActorState(
      env_state=env_state,
      obs=obs,
      first=jnp.ones((env.num_envs,), bool),
      policy_state=agent.initialize_state(env.num_envs, env.obs_size),
      episode_return=jnp.zeros((env.num_envs,), jnp.float32),
  )


def collect_rollout(agent: Agent, env: VecEnv, params: Any, actor: ActorState, key: Array,
                    num_steps: int, *, greedy: bool = False) -> tuple[ActorState, Rollout]:
  """Runs the policy `num_steps` steps in every environment (a `lax.scan` over time).

  Args:
    agent: the policy.
    env: the environments.
    params: the policy's parameters.
    actor: where the environments and the policy stand.
    key: PRNG key of the actions and the environments.
    num_steps: rollout length T.
    greedy: take the most probable action instead of sampling one.

  Returns:
    `(actor, rollout)`: where they stand after the last step, and the `(T, B)` rollout.
  """
  no_reset = jnp.zeros((env.num_envs,), bool)

  def body(actor: ActorState, key: Array) -> tuple[ActorState, tuple[Array, ...]]:
    key_action, key_env = jax.random.split(key)
    state, logits, value = agent.step(params, actor.policy_state, actor.obs, actor.first)
    if greedy:
      action = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
      action = jax.random.categorical(key_action, logits).astype(jnp.int32)
    out = env.step(key_env, actor.env_state, action)
    # A truncated episode bootstraps from its final observation, seen from the state it reached.
    final_value = lax.cond(
        jnp.any(out.truncated),
        lambda: jnp.where(out.truncated, agent.step(params, state, out.final_obs, no_reset)[2], 0.0),
        lambda: jnp.zeros_like(value),
    )
    done = out.terminated | out.truncated
    episode_return = actor.episode_return + out.reward
    step = (actor.obs, actor.first, action, logits, value, out.reward, out.terminated, out.truncated,
            final_value, jnp.where(done, episode_return, 0.0))
    actor = ActorState(out.state, out.obs, done, state, jnp.where(done, 0.0, episode_return))
    return actor, step

  end, steps = lax.scan(body, actor, jax.random.split(key, num_steps))
  _, _, last_value = agent.step(params, end.policy_state, end.obs, end.first)
  return end, Rollout(*steps, last_value=last_value, initial_state=actor.policy_state)


def advantages_and_targets(rollout: Rollout, gamma: float, gae_lambda: float) -> tuple[Array, Array]:
  """GAE advantages and value targets of a rollout whose episodes end and begin anywhere in it.

  Discounts are `gamma * (1 - terminated)`; a truncated episode bootstraps from its final
  observation's value (`ssmkit.rl.generalized_advantage_estimation`'s `truncated=`).

  Args:
    rollout: `(T, B)` rollout.
    gamma: discount per step.
    gae_lambda: GAE lambda.

  Returns:
    `(advantages, targets)`, both `(T, B)` float32; targets = advantages + values.
  """
  values = jnp.concatenate([rollout.value, rollout.last_value[None]], axis=0)
  discounts = gamma * (1.0 - rollout.terminated.astype(jnp.float32))
  advantages = rl.generalized_advantage_estimation(
      rollout.reward, discounts, values, gae_lambda, axis=0,
      truncated=rollout.truncated, final_values=rollout.final_value,
  )
  return advantages, advantages + rollout.value



def evaluate_policy(agent: Agent, env: VecEnv, params: Any, key: Array, num_steps: int,
                    greedy: bool = True) -> tuple[Array, Array]:
  """The summed returns and the number of episodes completed in `num_steps` steps of fresh environments.

  Args:
    agent: the policy.
    env: the environments (all start a fresh episode).
    params: the policy's parameters.
    key: PRNG key of the environments and (unless `greedy`) the actions.
    num_steps: steps of every environment.
    greedy: take the most probable action instead of sampling one.

  Returns:
    `(return_sum, episodes)`, float32 scalars.
  """
  init_key, rollout_key = jax.random.split(key)
  actor = init_actor(agent, env, init_key)
  _, rollout = collect_rollout(agent, env, params, actor, rollout_key, num_steps, greedy=greedy)
  done = rollout.terminated | rollout.truncated
  return jnp.sum(rollout.episode_return), jnp.sum(done.astype(jnp.float32))
