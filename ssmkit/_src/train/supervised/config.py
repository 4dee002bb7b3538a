"""The training configuration: a typed schema that YAML files and `key=value` overrides fill in."""

from __future__ import annotations

import dataclasses
import importlib.resources
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ssmkit._src.modes import Mode
from ssmkit._src.train.errors import ConfigError
from ssmkit._src.train.model import LAYERS

if TYPE_CHECKING:
  from ssmkit._src.train.ppo_config import PPOConfig

_Schema = TypeVar("_Schema")


@dataclasses.dataclass
class DataConfig:
  """Which dataset to train on and how to batch it."""

  # A dataset of `ssmkit.data.load`: "mnist1d", "sequential_digits", "selective_copying",
  # "induction_heads" or "listops".
  name: str = MISSING
  # Keyword arguments of that dataset's function, e.g. {num_samples: 5000} for mnist1d.
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Sequences per train and eval batch; the last partial train batch of an epoch is dropped.
  batch_size: int = 64


@dataclasses.dataclass
class ModelConfig:
  """The `ssmkit.layers.SequenceModel` to train; outputs and vocabulary come from the dataset."""

  # SSM layer of every block: "lru", "s4d", "s5" or "mamba".
  layer: str = "lru"
  # Keyword arguments of the layer class, e.g. {d_state: 64, r_min: 0.4} for ssmkit.layers.LRU.
  layer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Model width H.
  features: int = 64
  # Number of residual SSM blocks.
  num_blocks: int = 2
  # "mean" or "last" over the real steps for one label per sequence; "none" for per-step targets.
  pooling: str = "mean"
  # "layer", "batch" or "rms".
  norm: str = "layer"
  # "gelu", "glu" or "half_glu" after the SSM layer.
  activation: str = "glu"
  # Dropout inside the blocks during training.
  dropout_rate: float = 0.0
  # Normalise block inputs (true) or residual sums (false).
  prenorm: bool = True
  # Apply the blocks with nn.scan over stacked parameters (compile time independent of depth).
  scan_blocks: bool = False
  # Scan mode of the SSM layers: "auto", "sequential", "parallel" or "chunked".
  mode: str = "auto"


@dataclasses.dataclass
class OptimizerConfig:
  """AdamW with linear warmup, a cosine or constant schedule and global-norm clipping."""

  # Peak learning rate of all parameters but the SSM ones.
  learning_rate: float = 3e-3
  # Peak learning rate of the SSM parameters (eigenvalues, steps, input matrices), without weight
  # decay, as in the S4, S5 and LRU papers.
  ssm_learning_rate: float = 1e-3
  # Decoupled weight decay of the weight matrices (not of biases, norm scales, embeddings or SSM
  # parameters).
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
class MeshConfig:
  """The devices a run uses: a one-axis `jax.sharding.Mesh` named "data" that splits every batch.

  Parameters and optimizer state are replicated on every device of the mesh. A run may resume on
  another number of devices.
  """

  # Devices on the "data" axis, the first ones of `jax.devices()`; -1: every device of every
  # process. Must divide the batch size; a multi-process run uses every device.
  data: int = -1


@dataclasses.dataclass
class Config:
  """A whole training run: `ssmkit train CONFIG` and `train_and_evaluate` read this."""

  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


# Each string field with the values it may take.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.layer": tuple(LAYERS),
    "model.pooling": ("mean", "last", "none"),
    "model.norm": ("layer", "batch", "rms"),
    "model.activation": ("gelu", "glu", "half_glu"),
    "model.mode": tuple(mode.value for mode in Mode),
    "optimizer.schedule": ("cosine", "constant"),
}
# Each numeric field with the smallest value it may take.
MINIMUMS: dict[str, float] = {
    "data.batch_size": 1,
    "model.features": 1,
    "model.num_blocks": 1,
    "optimizer.warmup_steps": 0,
    "train.steps": 1,
    "train.epochs": 1,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.checkpoint_every": 1,
    "train.keep_checkpoints": 1,
}
_POSITIVE = ("optimizer.learning_rate", "optimizer.ssm_learning_rate", "optimizer.grad_clip")


def get_field(config: Any, key: str) -> Any:
  """The value of the field `key` ("section.name") of a config dataclass."""
  section, name = key.split(".")
  return getattr(getattr(config, section), name)


def check_values(config: Any, choices: dict[str, tuple[str, ...]], minimums: dict[str, float],
                 positive: Sequence[str]) -> None:
  """Checks fields against their choices, their minimums and (`positive`) > 0; None passes.

  Raises:
    ConfigError: naming the first field with a value outside its choices or range.
  """
  for key, allowed in choices.items():
    if get_field(config, key) not in allowed:
      raise ConfigError(f"`{key}` must be one of {allowed}, got {get_field(config, key)!r}.")
  for key, minimum in minimums.items():
    value = get_field(config, key)
    if value is not None and value < minimum:
      raise ConfigError(f"`{key}` must be >= {minimum}, got {value}.")
  for key in positive:
    value = get_field(config, key)
    if value is not None and value <= 0:
      raise ConfigError(f"`{key}` must be > 0, got {value}.")


def validate(config: Config) -> Config:
  """Checks the values the schema's types do not constrain; returns `config`.

  Raises:
    ConfigError: naming the first field with a value outside its choices or range.
  """
  check_values(config, CHOICES, MINIMUMS, _POSITIVE)
  if config.optimizer.weight_decay < 0:
    raise ConfigError(f"`optimizer.weight_decay` must be >= 0, got {config.optimizer.weight_decay}.")
  if not 0 <= config.model.dropout_rate < 1:
    raise ConfigError(f"`model.dropout_rate` must lie in [0, 1), got {config.model.dropout_rate}.")
  return config


def _config_error(error: OmegaConfBaseException) -> ConfigError:
  key = getattr(error, "full_key", None)
  message = str(error).splitlines()[0]
  return ConfigError(f"config key `{key}`: {message}" if key else f"config: {message}")


def _shipped_directory() -> importlib.resources.abc.Traversable:
  return importlib.resources.files("ssmkit") / "configs"


def shipped_configs(kind: str | None = None) -> list[str]:
  """The names of the configs shipped with ssmkit, which `load_config` accepts in place of a path.

  Args:
    kind: "supervised" or "ppo" (a config with an `env` or `ppo` section) for the configs of that
      kind only; None for all.
  """
  names = sorted(
      entry.name.removesuffix(".yaml") for entry in _shipped_directory().iterdir()
      if entry.name.endswith(".yaml")
  )
  if kind is None:
    return names
  if kind not in ("supervised", "ppo"):
    raise ValueError(f"`kind` must be 'supervised', 'ppo' or None, got {kind!r}.")
  return [name for name in names if config_kind(_read_yaml(name)) == kind]


def config_kind(content: dict[str, Any], overrides: Sequence[str] = ()) -> str:
  """"ppo" for a config with an `env` or `ppo` section in `content` or `overrides`, else "supervised"."""
  sections = set(content) | {override.split("=")[0].split(".")[0] for override in overrides}
  return "ppo" if sections & {"env", "ppo"} else "supervised"


def _read_yaml(path: str | pathlib.Path) -> dict[str, Any]:
  file = pathlib.Path(path)
  if not file.is_file():
    if str(path) not in shipped_configs():
      shipped = ", ".join(shipped_configs())
      raise FileNotFoundError(f"config {str(path)!r} is neither a file nor a shipped config: {shipped}.")
    file = _shipped_directory() / f"{path}.yaml"
  try:
    content = yaml.safe_load(file.read_text())
  except yaml.YAMLError as error:
    raise ConfigError(f"config file {str(path)!r} is not valid YAML: {error}") from None
  if not isinstance(content, dict | None):
    raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(content).__name__}.")
  return content or {}


def merge_structured(schema: type[_Schema], content: dict[str, Any],
                     overrides: Sequence[str]) -> _Schema:
  """An instance of the dataclass `schema` filled from `content`, then from `key=value` overrides.

  Raises:
    ConfigError: for a malformed override, an unknown key, a value of the wrong type or a
      missing mandatory value; the message names the key.
  """
  for override in overrides:
    if "=" not in override:
      raise ConfigError(f"override {override!r} must have the form key=value.")
  try:
    dotlist = OmegaConf.from_dotlist(list(overrides))
    merged = OmegaConf.merge(OmegaConf.structured(schema), content, dotlist)
    return OmegaConf.to_object(merged)
  except OmegaConfBaseException as error:
    raise _config_error(error) from None


def load_config(path: str | pathlib.Path | None = None, overrides: Sequence[str] = ()
                ) -> Config | PPOConfig:
  """The `Config` (or `PPOConfig`) of a YAML file, with dotted `key=value` overrides applied on top.

  A file or overrides with an `env` or `ppo` section make a `PPOConfig` (reinforcement learning
  with `train_ppo`); any other a `Config` (supervised training with `train_and_evaluate`).

  Args:
    path: YAML file with any of the sections `data`, `model`, `optimizer`, `train` (or `env`,
      `model`, `ppo`, `train`), or the name of a shipped config (`shipped_configs()`, e.g.
      "mnist1d_lru"); None starts from the defaults.
    overrides: strings like "train.steps=100" or "model.layer_kwargs.d_state=32", applied in order;
      values are parsed as YAML ("null", "true", "1e-3"); the dict fields `data.kwargs`,
      `env.kwargs` and `model.layer_kwargs` are merged key by key.

  Returns:
    The merged and validated config.

  Raises:
    FileNotFoundError: if `path` is neither a file nor a shipped config.
    ConfigError: for an unknown key, a value of the wrong type, a missing mandatory value
      (`data.name`, `env.name`) or a value out of range; the message names the key.

  Examples:
    >>> config = load_config(None, ["data.name=mnist1d", "train.steps=100"])
    >>> config.train.steps, config.model.layer
    (100, 'lru')
  """
  content = _read_yaml(path) if path is not None else {}
  if config_kind(content, overrides) == "ppo":
    # Imported here: the PPO schema builds on this module's `ModelConfig` and checks.
    from ssmkit._src.train import ppo_config

    return ppo_config.validate(merge_structured(ppo_config.PPOConfig, content, overrides))
  return validate(merge_structured(Config, content, overrides))


def to_dict(config: Config | PPOConfig) -> dict[str, Any]:
  """`config` as nested plain dicts, e.g. for JSON."""
  return dataclasses.asdict(config)


def to_yaml(config: Config | PPOConfig) -> str:
  """`config` as YAML text that `load_config` reads back."""
  return OmegaConf.to_yaml(OmegaConf.structured(config))
