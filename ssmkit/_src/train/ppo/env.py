"""The `env` section's gymnax environment, vectorised, its observations as float32 vectors."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.ppo.config import EnvConfig

Array = jax.Array


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



def make_env(config: EnvConfig) -> VecEnv:
  """The vectorised gymnax environment of the `env` section.

  Raises:
    ConfigError: for an unknown environment, a key of `env.kwargs` that is neither an argument of
      the environment class nor a field of its EnvParams, or an action space that is not discrete.
  """
  # Imported on use: importing gymnax takes seconds (it loads seaborn and pandas), which
  # `import ssmkit.train` for supervised training should not pay.
  import gymnax

  if config.name not in gymnax.registered_envs:
    raise ConfigError(
        f"`env.name` must be a gymnax environment, one of {', '.join(gymnax.registered_envs)}; "
        f"got {config.name!r}."
    )
  env, params = gymnax.make(config.name)
  fields = {field.name for field in dataclasses.fields(params)}
  arguments = set(inspect.signature(type(env)).parameters)
  for key in config.kwargs:
    if key not in fields | arguments:
      raise ConfigError(
          f"`env.kwargs.{key}` is neither an argument of {type(env).__name__} "
          f"({', '.join(sorted(arguments)) or 'none'}) nor a field of its EnvParams "
          f"({', '.join(sorted(fields))})."
      )
  env_kwargs = {key: value for key, value in config.kwargs.items() if key in arguments}
  if env_kwargs:
    env, params = gymnax.make(config.name, **env_kwargs)
  params = params.replace(**{key: value for key, value in config.kwargs.items() if key in fields})
  if not hasattr(env.action_space(params), "n"):
    raise ConfigError(f"`env.name`={config.name!r} has a continuous action space; PPO here needs a "
                      "discrete one.")
  return VecEnv(env, params, config.num_envs)
