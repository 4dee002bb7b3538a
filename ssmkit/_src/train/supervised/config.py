"""The schema of supervised training runs: a dataset, a model, an optimizer, the run's length."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import MISSING

from ssmkit._src.train.core import model, schema
from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.core.model import ModelConfig
from ssmkit._src.train.core.parallel import MeshConfig


@dataclasses.dataclass
class DataConfig:
  """Which dataset to train on and how to batch it."""

  # A dataset of `ssmkit.data.load`, by the name of its function in ssmkit.data.
  name: str = MISSING
  # Keyword arguments of that dataset's function, e.g. {num_samples: 5000} for mnist1d.
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Sequences per train and eval batch; the last partial train batch of an epoch is dropped.
  batch_size: int = 64


@dataclasses.dataclass
class OptimizerConfig:
  """AdamW with linear warmup, a cosine or constant schedule and global-norm clipping."""

  # Peak learning rate of all parameters but the recurrence ones.
  learning_rate: float = 3e-3
  # Peak learning rate of the recurrence parameters that the layer declares (its
  # `parameter_groups.recurrence`: eigenvalues, steps, input matrices), without weight decay, as
  # in the S4, S5 and LRU papers.
  ssm_learning_rate: float = 1e-3
  # Decoupled weight decay of the weight matrices (not of biases, norm scales, embeddings or the
  # parameters the layer declares free of it).
  weight_decay: float = 0.05
  # Steps of linear warmup from 0 to the peak learning rates.
  warmup_steps: int = 100
  # After warmup: "cosine" decay to 0 at the last step, or "constant".
  schedule: str = "cosine"
  # Clip gradients to this global norm; null disables clipping.
  grad_clip: float | None = 1.0


@dataclasses.dataclass
class TrainConfig:
  """Length of the run, and how often it logs, evaluates and saves."""

  # Seed of the parameter initialisation, the dropout and the data order.
  seed: int = 0
  # Number of train steps; null: `epochs` passes over the training split.
  steps: int | None = None
  # Passes over the training split when `steps` is null.
  epochs: int = 10
  # Log train metrics (averaged since the previous log) every this many steps.
  log_every: int = 50
  # Evaluate on the whole test split every this many steps; 0: only after the last step.
  eval_every: int = 0
  # Save a checkpoint every this many steps; one is also saved after the last step and on
  # SIGINT/SIGTERM, and a run in the same workdir resumes from the latest.
  checkpoint_every: int = 500
  # Number of most recent checkpoints kept.
  keep_checkpoints: int = 2


@dataclasses.dataclass
class Config:
  """A supervised training run: `ssmkit train CONFIG` and `train_and_evaluate` read this."""

  # The task kind, which picks the schema; a config that declares none is supervised.
  task: str = "supervised"
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


# Each string field with the values it may take.
CHOICES: dict[str, tuple[str, ...]] = {
    "task": ("supervised",),
    **model.CHOICES,
    "optimizer.schedule": ("cosine", "constant"),
}
# Each numeric field with the smallest value it may take.
MINIMUMS: dict[str, float] = {
    "data.batch_size": 1,
    **model.MINIMUMS,
    "optimizer.warmup_steps": 0,
    "train.steps": 1,
    "train.epochs": 1,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.checkpoint_every": 1,
    "train.keep_checkpoints": 1,
}
# Each numeric field that must be > 0.
POSITIVE = ("optimizer.learning_rate", "optimizer.ssm_learning_rate", "optimizer.grad_clip",
            *model.POSITIVE)


def validate(config: Config) -> Config:
  """Checks the values the schema's types do not constrain; returns `config`.

  Raises:
    ConfigError: naming the first field with a value outside its choices or range, or a layer
      keyword argument the layer does not have or of another type.
  """
  return check_run(config, CHOICES, MINIMUMS, POSITIVE)


def check_run(config: Any, choices: dict[str, tuple[str, ...]], minimums: dict[str, float],
              positive: tuple[str, ...]) -> Any:
  """`validate` for any schema with this one's `model`, `optimizer` and `train` sections, with
  that schema's choices and ranges; returns `config`."""
  schema.check_values(config, choices, minimums, positive)
  if config.optimizer.weight_decay < 0:
    raise ConfigError(f"`optimizer.weight_decay` must be >= 0, got {config.optimizer.weight_decay}.")
  if not 0 <= config.model.dropout_rate < 1:
    raise ConfigError(f"`model.dropout_rate` must lie in [0, 1), got {config.model.dropout_rate}.")
  model.check_layer_kwargs(config.model)
  return config
