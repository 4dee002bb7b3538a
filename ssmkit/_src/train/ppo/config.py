"""The schema of PPO runs: a gymnax environment, a policy, PPO's hyperparameters, the run's length.

`ssmkit.train.load_config` reads a YAML file into this schema when it declares `task: ppo`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import MISSING

from ssmkit._src.train.core import model, schema
from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.core.model import ModelConfig
from ssmkit._src.train.core.parallel import MeshConfig


@dataclasses.dataclass
class EnvConfig:
  """The gymnax environment and how many copies of it run side by side."""

  # A gymnax environment id, e.g. "MemoryChain-bsuite" (see `gymnax.registered_envs`).
  name: str = MISSING
  # Keyword arguments of the environment class (e.g. {num_bits: 1}) or fields of its EnvParams
  # (e.g. {memory_length: 10, max_steps_in_episode: 1000}); each goes where it belongs.
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Environments stepped in parallel; every rollout holds num_envs sequences.
  num_envs: int = 64


@dataclasses.dataclass
class PolicyConfig(ModelConfig):
  """The actor-critic: a `SequenceModel` with per-step outputs, logits `[..., :A]` and value `[..., A]`.

  The fields of `ModelConfig`, except that pooling must be "none", norm "layer" or "rms" (the same
  normalisation while acting and while training) and dropout 0; and `recurrent`.
  """

  # Per-step outputs: the policy and the value act at every step.
  pooling: str = "none"
  # Carry the SSM state across the steps of an episode. False resets it before every step, which
  # makes the same network a feed-forward policy of the current observation only.
  recurrent: bool = True


@dataclasses.dataclass
class PPOHyperparameters:
  """Rollouts, advantages, the clipped objective and its optimizer."""

  # Steps of every environment per rollout; episodes run on across rollouts.
  rollout_steps: int = 128
  # Discount per step; the discounts are gamma * (1 - terminated).
  gamma: float = 0.99
  # GAE lambda.
  gae_lambda: float = 0.95
  # PPO clipping range of the probability ratio (and of the value change with `clip_value`).
  clip_eps: float = 0.2
  # Weight of the entropy bonus.
  ent_coef: float = 0.01
  # Weight of the value loss.
  vf_coef: float = 0.5
  # Clip the value loss like the ratio, around the rollout's values.
  clip_value: bool = True
  # Normalise the advantages of every minibatch to mean 0 and standard deviation 1.
  normalize_advantages: bool = True
  # Passes over every rollout.
  epochs: int = 4
  # Minibatches per pass, split over the environments so each holds whole rollout sequences;
  # must divide env.num_envs.
  minibatches: int = 4
  # Adam learning rate.
  learning_rate: float = 3e-4
  # Clip gradients to this global norm; null disables clipping.
  grad_clip: float | None = 0.5
  # Decay the learning rate linearly to 0 at the last update.
  anneal: bool = True


@dataclasses.dataclass
class PPOTrainConfig:
  """Length of the run, and how often it logs, evaluates and saves."""

  # Seed of the parameter initialisation, the environments and the sampled actions.
  seed: int = 0
  # Number of PPO updates; each collects env.num_envs * ppo.rollout_steps environment steps.
  updates: int = 100
  # Log metrics (averaged since the previous log) every this many updates.
  log_every: int = 10
  # Evaluate every this many updates; 0: only after the last update.
  eval_every: int = 0
  # Steps of each of env.num_envs fresh environments in an evaluation; the mean return is over
  # the episodes completed within them.
  eval_steps: int = 128
  # Evaluate the most probable action (true) or sampled actions (false).
  eval_greedy: bool = True
  # Save a checkpoint every this many updates; one is also saved after the last update and on
  # SIGINT/SIGTERM, and a run in the same workdir resumes from the latest.
  checkpoint_every: int = 50
  # Number of most recent checkpoints kept.
  keep_checkpoints: int = 2


@dataclasses.dataclass
class PPOConfig:
  """A PPO run: `ssmkit train CONFIG` and `train_and_evaluate` read this."""

  # The task kind, which picks the schema.
  task: str = "ppo"
  env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
  model: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
  ppo: PPOHyperparameters = dataclasses.field(default_factory=PPOHyperparameters)
  train: PPOTrainConfig = dataclasses.field(default_factory=PPOTrainConfig)
  # The "data" axis splits the environments.
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


# Each string field with the values it may take.
CHOICES: dict[str, tuple[str, ...]] = {
    "task": ("ppo",),
    **model.CHOICES,
    "model.pooling": ("none",),
    "model.norm": ("layer", "rms"),
}
# Each numeric field with the smallest value it may take.
MINIMUMS: dict[str, float] = {
    **model.MINIMUMS,
    "env.num_envs": 1,
    "ppo.rollout_steps": 1,
    "ppo.gamma": 0,
    "ppo.gae_lambda": 0,
    "ppo.ent_coef": 0,
    "ppo.vf_coef": 0,
    "ppo.epochs": 1,
    "ppo.minibatches": 1,
    "train.updates": 1,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.eval_steps": 1,
    "train.checkpoint_every": 1,
    "train.keep_checkpoints": 1,
}
# Each numeric field that must be > 0.
POSITIVE = ("ppo.clip_eps", "ppo.learning_rate", "ppo.grad_clip", *model.POSITIVE)
_AT_MOST_ONE = ("ppo.gamma", "ppo.gae_lambda")


def validate(config: PPOConfig) -> PPOConfig:
  """Checks the values the schema's types do not constrain; returns `config`.

  Raises:
    ConfigError: naming the first field with a value outside its choices or range.
  """
  schema.check_values(config, CHOICES, MINIMUMS, POSITIVE)
  for key in _AT_MOST_ONE:
    if schema.get_field(config, key) > 1:
      raise ConfigError(f"`{key}` must lie in [0, 1], got {schema.get_field(config, key)}.")
  if config.model.dropout_rate != 0:
    raise ConfigError(
        f"`model.dropout_rate` must be 0 for a policy, which acts without dropout; got "
        f"{config.model.dropout_rate}."
    )
  if config.env.num_envs % config.ppo.minibatches:
    raise ConfigError(
        f"`ppo.minibatches`={config.ppo.minibatches} must divide `env.num_envs`={config.env.num_envs}."
    )
  model.check_layer_kwargs(config.model)
  return config
