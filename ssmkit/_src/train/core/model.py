"""The SSM layers a config can name, which of their parameters are "SSM" parameters, and the model."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np

from ssmkit import layers
from ssmkit._src.train.errors import ConfigError

if TYPE_CHECKING:
  from ssmkit._src.train.config import ModelConfig


class LayerSpec(NamedTuple):
  """An SSM layer class and the names of its parameters that the optimizer treats apart.

  Attributes:
    cls: the flax module class.
    ssm_params: parameters trained with the SSM learning rate and no weight decay.
    no_decay_params: further parameters trained without weight decay.
  """

  cls: type[nn.Module]
  ssm_params: frozenset[str]
  no_decay_params: frozenset[str] = frozenset()


LAYERS: dict[str, LayerSpec] = {
    "lru": LayerSpec(layers.LRU, frozenset({"nu_log", "theta_log", "gamma_log", "B_re", "B_im"})),
    "s4d": LayerSpec(layers.S4D, frozenset({"log_dt", "log_a_real", "a_imag", "B_re", "B_im"})),
    "s5": LayerSpec(layers.S5, frozenset({"Lambda_re", "Lambda_im", "B", "log_dt"})),
    # Mamba trains its SSM parameters at the base learning rate, without weight decay.
    "mamba": LayerSpec(layers.Mamba, frozenset(), frozenset({"A_log", "dt_bias", "D", "conv_bias"})),
}

# Name of the SSM layer's scope inside every `ssmkit.layers.SSMBlock`.
_SSM_SCOPE = "ssm"


def _check_layer_kwargs(cls: type[nn.Module], kwargs: dict[str, Any]) -> None:
  accepted = {f.name for f in dataclasses.fields(cls) if f.init} - {"parent", "name"}
  for key in kwargs:
    if key not in accepted:
      raise ConfigError(
          f"`model.layer_kwargs.{key}` is not a field of ssmkit.layers.{cls.__name__}; "
          f"its fields are: {', '.join(sorted(accepted))}."
      )


def build_model(config: ModelConfig, num_outputs: int, vocab_size: int | None) -> layers.SequenceModel:
  """The `SequenceModel` that `config` describes.

  Args:
    config: the `model` section of a training config.
    num_outputs: classes, or the output vocabulary of per-step targets.
    vocab_size: input vocabulary of token inputs; None for real-valued inputs.

  Returns:
    An unbound `ssmkit.layers.SequenceModel`.

  Raises:
    ConfigError: for a layer keyword argument the layer does not have, naming
      `model.layer_kwargs.<key>`.
  """
  cls = LAYERS[config.layer].cls
  _check_layer_kwargs(cls, config.layer_kwargs)
  return layers.SequenceModel(
      num_outputs=num_outputs,
      layer=functools.partial(cls, **config.layer_kwargs),
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

  Args:
    params: the "params" collection of a `SequenceModel` built with `LAYERS[layer]`.
    layer: a key of `LAYERS`.

  Returns:
    A tree like `params` with one label string per leaf.
  """
  spec = LAYERS[layer]

  def label(path: tuple[Any, ...], _: Any) -> str:
    names = [key.key for key in path]
    in_ssm = _SSM_SCOPE in names[:-1]
    if in_ssm and names[-1] in spec.ssm_params:
      return "ssm"
    if (in_ssm and names[-1] in spec.no_decay_params) or names[-1] in ("bias", "scale", "embedding"):
      return "no_decay"
    return "decay"

  return jax.tree_util.tree_map_with_path(label, params)


def count_parameters(params: Any) -> int:
  """The number of scalars in `params`."""
  return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params)))
