"""The model a config describes: its `model` section, checks, the model, its optimizer groups, its state.

Every name here comes from `ssmkit.layers`: the layers a config may name, their keyword arguments
(the layer's own fields and types), the norm, activation and pooling choices, and which
parameters are recurrence parameters (each layer's `parameter_groups`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.training import train_state

from ssmkit import layers
from ssmkit._src.layers.registry import ACTIVATIONS, LAYERS, NORMS, POOLINGS
from ssmkit._src.modes import Mode
from ssmkit._src.train.core.errors import ConfigError


@dataclasses.dataclass
class ModelConfig:
  """The `ssmkit.layers.SequenceModel` to train; its outputs and vocabulary come from the task."""

  # SSM layer of every block: an ssmkit.layers class by its name in lower case, words joined by
  # "_" (gated_deltanet for GatedDeltaNet).
  layer: str = "lru"
  # Keyword arguments of the layer class, e.g. {d_state: 64, r_min: 0.4} for ssmkit.layers.LRU;
  # each must be a field of the class, of its type.
  layer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Model width H.
  features: int = 64
  # Number of residual SSM blocks.
  num_blocks: int = 2
  # "mean" or "last" over the real steps for one label per sequence; "none" for per-step targets.
  pooling: str = "mean"
  # Normalisation in the blocks.
  norm: str = "layer"
  # After the SSM layer: GELU, or GELU and a gated linear unit.
  activation: str = "glu"
  # Dropout inside the blocks during training.
  dropout_rate: float = 0.0
  # Normalise block inputs (true) or residual sums (false).
  prenorm: bool = True
  # Apply the blocks with nn.scan over stacked parameters (compile time independent of depth).
  scan_blocks: bool = False
  # Scan mode of the SSM layers.
  mode: str = "auto"


# Each string field of the `model` section with the values it may take.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.layer": tuple(LAYERS),
    "model.pooling": POOLINGS,
    "model.norm": NORMS,
    "model.activation": ACTIVATIONS,
    "model.mode": tuple(mode.value for mode in Mode),
}
# Each numeric field of the `model` section with the smallest value it may take.
MINIMUMS: dict[str, float] = {"model.features": 1, "model.num_blocks": 1}

# Name of the SSM layer's scope inside every `ssmkit.layers.SSMBlock`.
_SSM_SCOPE = "ssm"


def _layer_fields(cls: type[nn.Module]) -> dict[str, Any]:
  """The fields a config may set on the layer class `cls`, with their types."""
  hints = typing.get_type_hints(cls)
  fields = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name")]
  return {name: hints[name] for name in fields}


def _accepts(hint: Any, value: Any) -> bool:
  """Whether a YAML `value` fits the type `hint` of a layer field; types it cannot judge pass."""
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    return any(_accepts(arm, value) for arm in typing.get_args(hint))
  if hint is type(None):
    return value is None
  if hint is bool:
    return isinstance(value, bool)
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if hint is float:
    return isinstance(value, int | float) and not isinstance(value, bool)
  if hint is str:
    return isinstance(value, str)
  if hint is np.dtype:
    try:
      return isinstance(value, str) and bool(jnp.dtype(value))
    except TypeError:
      return False
  return True


def _type_name(hint: Any) -> str:
  if hint is np.dtype:
    return "a dtype name (e.g. float32)"
  return getattr(hint, "__name__", str(hint)).replace("NoneType", "None")


def check_layer_kwargs(config: ModelConfig) -> None:
  """Checks that every key of `config.layer_kwargs` is a field of the layer, with a value of its type.

  Raises:
    ConfigError: naming `model.layer_kwargs.<key>`, the layer and what it expected.
  """
  cls = LAYERS[config.layer].layer
  fields = _layer_fields(cls)
  for key, value in config.layer_kwargs.items():
    if key not in fields:
      raise ConfigError(
          f"`model.layer_kwargs.{key}` is not a field of ssmkit.layers.{cls.__name__}; "
          f"its fields are: {', '.join(sorted(fields))}."
      )
    if not _accepts(fields[key], value):
      raise ConfigError(
          f"`model.layer_kwargs.{key}` must be {_type_name(fields[key])} (the type of "
          f"ssmkit.layers.{cls.__name__}.{key}), got {value!r}."
      )


def _layer_error(cls: type[nn.Module], kwargs: dict[str, Any], features: int) -> Exception | None:
  """The error initialising `cls(**kwargs)` on inputs of width `features` raises, if any."""
  x = jax.ShapeDtypeStruct((1, 2, features), jnp.float32)
  try:
    jax.eval_shape(cls(**kwargs).init, jax.random.key(0), x)
  # A layer may reject a value anywhere in its initialisation, with any error type.
  except Exception as error:
    return error
  return None


def check_layer_values(config: ModelConfig) -> None:
  """Initialises the layer of `config` (shapes only) to find keyword arguments it rejects.

  A value of the right type may still be out of the layer's range (`d_state=-3`,
  `r_min` > `r_max`). The layer raises then, in its own words; this names the keys that
  cause it: those without which the layer builds, else those with which alone it fails.

  Raises:
    ConfigError: naming `model.layer_kwargs.<key>` and the layer's error.
  """
  cls, kwargs = LAYERS[config.layer].layer, config.layer_kwargs
  error = _layer_error(cls, kwargs, config.features)
  if error is None:
    return
  fails = lambda keys: _layer_error(cls, {key: kwargs[key] for key in keys}, config.features) is not None
  culprits = ([key for key in kwargs if not fails(kwargs.keys() - {key})]
              or [key for key in kwargs if fails({key})] or list(kwargs))
  values = ", ".join(f"`model.layer_kwargs.{key}`={kwargs[key]!r}" for key in culprits)
  message = str(error).splitlines()[0] if str(error) else type(error).__name__
  raise ConfigError(
      f"ssmkit.layers.{cls.__name__} rejects {values or 'its defaults'}: {message}") from error


def build_model(config: ModelConfig, num_outputs: int, vocab_size: int | None) -> layers.SequenceModel:
  """The `SequenceModel` that `config` describes, its layer's keyword arguments checked.

  Args:
    config: the `model` section of a training config.
    num_outputs: classes, or the output vocabulary of per-step targets.
    vocab_size: input vocabulary of token inputs; None for real-valued inputs.

  Returns:
    An unbound `ssmkit.layers.SequenceModel`.

  Raises:
    ConfigError: for a layer keyword argument the layer does not have, of another type, or
      that the layer rejects; the message names `model.layer_kwargs.<key>`.
  """
  check_layer_kwargs(config)
  check_layer_values(config)
  return layers.SequenceModel(
      num_outputs=num_outputs,
      layer=functools.partial(LAYERS[config.layer].layer, **config.layer_kwargs),
      features=config.features,
      num_blocks=config.num_blocks,
      vocab_size=vocab_size,
      pooling=config.pooling,
      norm=config.norm,
      activation=config.activation,
      dropout_rate=config.dropout_rate,
      prenorm=config.prenorm,
      scan_blocks=config.scan_blocks,
  )


def parameter_labels(params: Any, layer: str) -> Any:
  """"ssm", "no_decay" or "decay" for every leaf of `params`, by its name and scope.

  Inside the SSM layer of a block, the layer's `parameter_groups` decide: its recurrence
  parameters are "ssm", its no-decay ones "no_decay". Elsewhere biases, norm scales and
  embeddings are "no_decay" and every other parameter "decay".

  Args:
    params: the "params" collection of a `SequenceModel` built with `LAYERS[layer].layer`, or the
      `nnx.Param` state of an `ssmkit.nnx.SequenceModel` of that layer.
    layer: a key of `LAYERS`.

  Returns:
    A tree like `params` with one label string per leaf.
  """
  groups = LAYERS[layer].layer.parameter_groups

  def label(path: tuple[Any, ...], _: Any) -> str:
    # Dict keys name the scopes; in an NNX state each leaf is further a Variable's attribute.
    names = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
    in_ssm = _SSM_SCOPE in names[:-1]
    if in_ssm and names[-1] in groups.recurrence:
      return "ssm"
    if (in_ssm and names[-1] in groups.no_decay) or names[-1] in ("bias", "scale", "embedding"):
      return "no_decay"
    return "decay"

  return jax.tree_util.tree_map_with_path(label, params)


def count_parameters(params: Any) -> int:
  """The number of scalars in `params`."""
  return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params)))


class TrainState(train_state.TrainState):
  """Parameters, optimizer state and step, plus the BatchNorm running averages.

  Attributes:
    batch_stats: the "batch_stats" collection; `{}` for a model without BatchNorm.
  """

  batch_stats: Any = None


def variables(state: TrainState) -> dict[str, Any]:
  """The model's variables in `state`: {"params"}, and "batch_stats" if the model has BatchNorm."""
  return {"params": state.params, **({"batch_stats": state.batch_stats} if state.batch_stats else {})}
