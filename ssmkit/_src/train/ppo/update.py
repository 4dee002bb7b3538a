"""The PPO update: the clipped loss, and one update (a rollout, then epochs of minibatch steps).

The update re-runs the policy over each whole rollout, `(B, T, F)`, from the recurrent state the
rollout started with, the episode starts as `reset` flags. Before the first gradient step this
reproduces the rollout's logits and values, so the probability ratios start at exactly 1.

References:
  Schulman et al., "Proximal Policy Optimization Algorithms", 2017.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax import lax

from ssmkit._src.train.core.loop import run_steps
from ssmkit._src.train.core.model import TrainState
from ssmkit._src.train.ppo.agent import Agent
from ssmkit._src.train.ppo.config import PPOHyperparameters
from ssmkit._src.train.ppo.env import VecEnv
from ssmkit._src.train.ppo.rollout import (
  ActorState,
  Rollout,
  advantages_and_targets,
  collect_rollout,
  init_actor,
)

Array = jax.Array


def make_optimizer(hp: PPOHyperparameters, updates: int
                       ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Adam (eps 1e-5) after global-norm clipping, with a constant or linearly annealed learning rate.

  Args:
    hp: the `ppo` section of the config.
    updates: the number of updates of the run, each `hp.epochs * hp.minibatches` optimizer steps.

  Returns:
    `(optimizer, schedule)`, the schedule a function of the optimizer step.
  """
  if hp.anneal:
    schedule = optax.linear_schedule(hp.learning_rate, 0.0, updates * hp.epochs * hp.minibatches)
  else:
    schedule = optax.constant_schedule(hp.learning_rate)
  tx = optax.adam(schedule, eps=1e-5)
  if hp.grad_clip is not None:
    tx = optax.chain(optax.clip_by_global_norm(hp.grad_clip), tx)
  return tx, schedule


def ppo_loss(logits: Array, values: Array, action: Array, old_log_prob: Array, old_value: Array,
             advantage: Array, target: Array, hp: PPOHyperparameters) -> tuple[Array, dict[str, Array]]:
  """The PPO objective: clipped surrogate, (clipped) value loss and entropy bonus.

  With r = pi(a|s) / pi_old(a|s) and advantages A (normalised per call if
  `hp.normalize_advantages`):

      policy_loss = -mean(min(r A, clip(r, 1 - eps, 1 + eps) A))
      value_loss  = 0.5 mean(max((v - G)^2, (v_old + clip(v - v_old, -eps, eps) - G)^2))
      loss        = policy_loss + vf_coef value_loss - ent_coef entropy

  (without `hp.clip_value`, value_loss = 0.5 mean((v - G)^2)).

  Args:
    logits: `(..., A)` float32 logits of the current parameters.
    values: `(...)` float32 values of the current parameters.
    action: `(...)` int actions taken.
    old_log_prob: `(...)` log-probabilities of `action` under the acting parameters.
    old_value: `(...)` values under the acting parameters.
    advantage: `(...)` advantages A.
    target: `(...)` value targets G.
    hp: the `ppo` section of the config (clip_eps, vf_coef, ent_coef, clip_value,
      normalize_advantages).

  Returns:
    `(loss, metrics)`: metrics "loss", "policy_loss", "value_loss", "entropy", "approx_kl"
    (the estimator mean(r - 1 - log r)) and "clip_fraction", float32 scalars.
  """
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  log_prob = jnp.take_along_axis(log_probs, action[..., None], axis=-1)[..., 0]
  log_ratio = log_prob - old_log_prob
  ratio = jnp.exp(log_ratio)
  if hp.normalize_advantages:
    advantage = (advantage - jnp.mean(advantage)) / (jnp.std(advantage) + 1e-8)
  eps = hp.clip_eps
  policy_loss = -jnp.mean(jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - eps, 1 + eps) * advantage))
  value_error = jnp.square(values - target)
  if hp.clip_value:
    clipped = old_value + jnp.clip(values - old_value, -eps, eps)
    value_error = jnp.maximum(value_error, jnp.square(clipped - target))
  value_loss = 0.5 * jnp.mean(value_error)
  entropy = jnp.mean(-jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1))
  loss = policy_loss + hp.vf_coef * value_loss - hp.ent_coef * entropy
  return loss, {
      "loss": loss,
      "policy_loss": policy_loss,
      "value_loss": value_loss,
      "entropy": entropy,
      "approx_kl": jnp.mean(ratio - 1 - log_ratio),
      "clip_fraction": jnp.mean((jnp.abs(ratio - 1) > eps).astype(jnp.float32)),
  }


class Sequences(NamedTuple):
  """A rollout batch-first, `(B, T, ...)`, with what the loss needs; minibatches take env rows."""

  obs: Array
  first: Array
  action: Array
  log_prob: Array
  value: Array
  advantage: Array
  target: Array
  initial_state: Any


def _take_envs(data: Sequences, index: Array, state_axis: int) -> Sequences:
  """The environments `index` of `data`: rows of the `(B, T, ...)` arrays and of the state."""
  rows = jax.tree.map(lambda x: jnp.take(x, index, axis=0), data._replace(initial_state=None))
  state = jax.tree.map(lambda x: jnp.take(x, index, axis=state_axis), data.initial_state)
  return rows._replace(initial_state=state)


@struct.dataclass
class PPOState:
  """Everything a run carries from one update to the next, which a checkpoint saves.

  Attributes:
    train_state: parameters, optimizer state and optimizer step count.
    actor: the environments and the recurrent state between rollouts.
    key: `(2,)` uint32 data of the run's PRNG key.
    update: int32 number of updates done.
  """

  train_state: TrainState
  actor: ActorState
  key: Array
  update: Array


def create_ppo_state(agent: Agent, env: VecEnv, tx: optax.GradientTransformation,
                     key: Array) -> PPOState:
  """The state of a new run: initial parameters, fresh episodes, a zero recurrent state.

  Args:
    agent: the policy.
    env: the environments.
    tx: the optimizer.
    key: PRNG key of the parameters, the first episodes and the run.

  Returns:
    The state before the first update.
  """
  params_key, env_key, run_key = jax.random.split(key, 3)
  example = jnp.zeros((1, 1, env.obs_size), jnp.float32)
  first = jnp.ones((1, 1), bool)
  # One program: the optimizer's moments built outside it would compile one per shape.
  init = lambda k: agent.model.init(k, example, None, first, mode=agent.mode)["params"]
  train_state = jax.jit(lambda k: TrainState.create(apply_fn=agent.model.apply, params=init(k), tx=tx,
                                                    batch_stats={}))(params_key)
  return PPOState(
      # int32 arrays, not Python ints, so the first update does not trace with weak types.
      train_state=train_state.replace(step=jnp.zeros((), jnp.int32)),
      actor=init_actor(agent, env, env_key),
      key=jax.random.key_data(run_key),
      update=jnp.zeros((), jnp.int32),
  )


def sequences(rollout: Rollout, hp: PPOHyperparameters) -> Sequences:
  """The rollout batch-first with old log-probabilities, advantages and targets."""
  advantage, target = advantages_and_targets(rollout, hp.gamma, hp.gae_lambda)
  log_probs = jax.nn.log_softmax(rollout.logits, axis=-1)
  log_prob = jnp.take_along_axis(log_probs, rollout.action[..., None], axis=-1)[..., 0]
  batch_first = lambda x: jnp.swapaxes(x, 0, 1)
  return Sequences(
      obs=batch_first(rollout.obs),
      first=batch_first(rollout.first),
      action=batch_first(rollout.action),
      log_prob=batch_first(log_prob),
      value=batch_first(rollout.value),
      advantage=batch_first(advantage),
      target=batch_first(target),
      initial_state=rollout.initial_state,
  )


def ppo_update(agent: Agent, env: VecEnv, hp: PPOHyperparameters, state: PPOState
               ) -> tuple[PPOState, dict[str, Array]]:
  """One PPO update: a rollout, then `hp.epochs` passes of `hp.minibatches` gradient steps.

  Minibatches split the environments, so each holds whole sequences, which the policy re-runs
  from the rollout's initial recurrent state with the episode starts as resets.

  Args:
    agent: the policy.
    env: the environments.
    hp: the `ppo` section of the config.
    state: the run's state.

  Returns:
    `(state, metrics)`: the means over the gradient steps of `ppo_loss`'s metrics, and the
    rollout's "episode_return_sum" and "episodes" (of the episodes that ended in it).
  """
  key, rollout_key, shuffle_key = jax.random.split(jax.random.wrap_key_data(state.key), 3)
  actor, rollout = collect_rollout(
      agent, env, state.train_state.params, state.actor, rollout_key, hp.rollout_steps
  )
  data = sequences(rollout, hp)

  def loss_fn(params: Any, batch: Sequences) -> tuple[Array, dict[str, Array]]:
    logits, values = agent.sequence(params, batch.initial_state, batch.obs, batch.first)
    return ppo_loss(logits, values, batch.action, batch.log_prob, batch.value, batch.advantage,
                    batch.target, hp)

  def minibatch_step(train_state: TrainState, index: Array) -> tuple[TrainState, dict[str, Array]]:
    batch = _take_envs(data, index, agent.state_batch_axis)
    grads, metrics = jax.grad(loss_fn, has_aux=True)(train_state.params, batch)
    return train_state.apply_gradients(grads=grads), metrics

  def epoch(train_state: TrainState, key: Array) -> tuple[TrainState, dict[str, Array]]:
    order = jax.random.permutation(key, env.num_envs).reshape(hp.minibatches, -1)
    return lax.scan(minibatch_step, train_state, order)

  train_state, metrics = lax.scan(epoch, state.train_state, jax.random.split(shuffle_key, hp.epochs))
  metrics = jax.tree.map(jnp.mean, metrics)
  done = rollout.terminated | rollout.truncated
  metrics["episode_return_sum"] = jnp.sum(rollout.episode_return)
  metrics["episodes"] = jnp.sum(done.astype(jnp.float32))
  new_state = PPOState(train_state, actor, jax.random.key_data(key), state.update + 1)
  return new_state, metrics


def ppo_updates(agent: Agent, env: VecEnv, hp: PPOHyperparameters, state: PPOState, count: Array,
                size: int) -> tuple[PPOState, dict[str, Array]]:
  """`count` PPO updates in one call, each as `ppo_update` computes it.

  Args:
    agent: the policy.
    env: the environments.
    hp: the `ppo` section of the config.
    state: the run's state before the first update.
    count: int32 number of updates, at most `size`.
    size: the longest span of updates, the rows of the returned metrics.

  Returns:
    The state after `count` updates and `(size,)` arrays of every update's metrics (zero past
    `count`).
  """
  return run_steps(lambda state, _: ppo_update(agent, env, hp, state), state, count, size)
