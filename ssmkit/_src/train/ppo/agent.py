"""The actor-critic of PPO: a `SequenceModel` whose per-step outputs are policy logits and a value."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ssmkit import layers
from ssmkit._src.train.core.model import build_model
from ssmkit._src.train.ppo.config import PolicyConfig
from ssmkit._src.train.ppo.env import VecEnv

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



def make_agent(config: PolicyConfig, env: VecEnv) -> Agent:
  """The actor-critic of the `model` section for `env`'s actions."""
  model = build_model(config, env.num_actions + 1, None)
  return Agent(model, env.num_actions, recurrent=config.recurrent, mode=config.mode)
