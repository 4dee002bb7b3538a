"""Recurrent PPO on vectorised gymnax environments: rollouts, advantages, the clipped loss, the update.

The policy is a `SequenceModel` read as an actor-critic (`Agent`). A rollout runs it one step at a
time (`SequenceModel.step`) in a `lax.scan` over time, the environments `vmap`ped. Episodes run on
across rollouts, so a rollout starts from the recurrent state the previous one ended with; it keeps
that state, and the update re-runs the policy over the whole rollout, `(B, T, F)`, from it, with the
episode starts as `reset` flags. Before the first gradient step this reproduces the rollout's
logits and values, so the probability ratios start at exactly 1.

References:
  Schulman et al., "Proximal Policy Optimization Algorithms", 2017.
  Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation", ICLR 2016.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax import lax

from ssmkit import layers, rl
from ssmkit._src.train.steps import TrainState

if TYPE_CHECKING:
  from ssmkit._src.train.ppo_config import PPOHyperparameters

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Agent:
  """A `SequenceModel` with `num_actions + 1` per-step outputs read as policy logits and a value.

  Attributes:
    model: a `SequenceModel` with pooling "none" and `num_outputs = num_actions + 1`: outputs
      `[..., :num_actions]` are the logits of a categorical policy, `[..., num_actions]` the value.
    num_actions: number of discrete actions A.
    recurrent: carry the state across steps; False resets it before every step, which makes the
      same network a feed-forward function of the current observation.
    mode: scan mode of the SSM layers over whole sequences.
  """

  model: layers.SequenceModel
  num_actions: int
  recurrent: bool = True
  mode: str = "auto"

  def initialize_state(self, num_envs: int, obs_size: int) -> Any:
    """The zero recurrent state of `num_envs` environments with observations of `obs_size`."""
    return self.model.initialize_state((num_envs, obs_size))

  @property
  def state_batch_axis(self) -> int:
    """The environment axis of every leaf of the recurrent state (after the block axis, if any)."""
    return 1 if self.model.scan_blocks else 0

  def _split(self, outputs: Array) -> tuple[Array, Array]:
    outputs = outputs.astype(jnp.float32)
    return outputs[..., : self.num_actions], outputs[..., self.num_actions]

  def step(self, params: Any, state: Any, obs_t: Array, first_t: Array) -> tuple[Any, Array, Array]:
    """One step of every environment.

    Args:
      params: the model's "params".
      state: the recurrent state before this step, as `initialize_state` makes it.
      obs_t: `(B, F)` float32 observations.
      first_t: `(B,)` bool, True where `obs_t` starts an episode (the state is cleared first).

    Returns:
      `(state, logits, value)`: the state after the step, `(B, A)` and `(B,)` float32.
    """
    reset = first_t if self.recurrent else jnp.ones_like(first_t)
    state, outputs = self.model.apply({"params": params}, state, obs_t, reset, method="step")
    return (state, *self._split(outputs))

  def sequence(self, params: Any, initial_state: Any, obs: Array, first: Array) -> tuple[Array, Array]:
    """The policy over whole sequences, as `step` would compute them one after the other.

    Args:
      params: the model's "params".
      initial_state: the recurrent state before the first step, `initialize_state`'s structure.
      obs: `(B, T, F)` float32 observations.
      first: `(B, T)` bool episode starts.

    Returns:
      `(logits, values)`, `(B, T, A)` and `(B, T)` float32.
    """
    reset = first if self.recurrent else jnp.ones_like(first)
    outputs = self.model.apply(
        {"params": params}, obs, None, reset, initial_state=initial_state, mode=self.mode
    )
    return self._split(outputs)


class EnvStep(NamedTuple):
  """What one step of `VecEnv` returns, every field with a leading `(B,)` axis."""

  obs: Array  # (B, F) float32 next observations; of the next episode where one ended
  state: Any  # the environments' states
  reward: Array  # (B,) float32
  terminated: Array  # (B,) bool: the episode ended
  truncated: Array  # (B,) bool: the episode was cut by the time limit
  final_obs: Array  # (B, F) float32 last observation of the episode that ended (else `obs`)


@dataclasses.dataclass(frozen=True)
class VecEnv:
  """`num_envs` copies of a gymnax environment stepped together, observations as float32 vectors.

  gymnax environments reset themselves at the end of an episode: the step that ends one
  returns the first observation of the next.

  Attributes:
    env: a gymnax environment with a discrete action space.
    params: its `EnvParams`.
    num_envs: number of copies B.
  """

  env: Any
  params: Any
  num_envs: int

  @property
  def obs_size(self) -> int:
    """F, the size of a flattened observation."""
    return math.prod(self.env.observation_space(self.params).shape)

  @property
  def num_actions(self) -> int:
    """A, the number of discrete actions."""
    return int(self.env.action_space(self.params).n)

  def _flat(self, obs: Array) -> Array:
    return obs.reshape(self.num_envs, -1).astype(jnp.float32)

  def reset(self, key: Array) -> tuple[Array, Any]:
    """`(obs, state)`: first observations `(B, F)` and states of fresh episodes."""
    obs, state = jax.vmap(self.env.reset, in_axes=(0, None))(jax.random.split(key, self.num_envs),
                                                             self.params)
    return self._flat(obs), state

  def step(self, key: Array, state: Any, action: Array) -> EnvStep:
    """Applies `(B,)` int actions; an environment whose episode ends starts the next one."""
    keys = jax.random.split(key, self.num_envs)
    obs, state, reward, terminated, truncated, info = jax.vmap(
        self.env.step, in_axes=(0, 0, 0, None))(keys, state, action, self.params)
    return EnvStep(
        self._flat(obs), state, reward.astype(jnp.float32), terminated.astype(bool),
        truncated.astype(bool), self._flat(info["final_observation"]),
    )


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
  variables = jax.jit(lambda k: agent.model.init(k, example, None, first, mode=agent.mode))(params_key)
  train_state = TrainState.create(apply_fn=agent.model.apply, params=variables["params"], tx=tx,
                                  batch_stats={})
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
