"""The model a config describes: its `model` section, checks, the model, its optimizer groups, its state.

Every name here comes from `ssmkit.layers`: the layers a config may name, their keyword arguments
(the layer's own fields and types), the norm, activation and pooling choices, and which
parameters are recurrence parameters (each layer's `parameter_groups`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.training import train_state

from ssmkit import layers
from ssmkit._src.layers.experts import MixtureOfExperts
from ssmkit._src.layers.model import check_model, place_in_pattern
from ssmkit._src.layers.registry import ACTIVATIONS, BLOCKS, LAYERS, MLPS, NORMS, POOLINGS
from ssmkit._src.modes import Mode
from ssmkit._src.train.core import schema
from ssmkit._src.train.core.errors import ConfigError


@dataclasses.dataclass
class ModelConfig:
  """The `ssmkit.layers.SequenceModel` to train; its outputs and vocabulary come from the task."""

  # Layer of every block: an ssmkit.layers class by its name in lower case, words joined by "_"
  # (gated_deltanet for GatedDeltaNet); or a list of such names cycled over the blocks, e.g.
  # [rglru, rglru, attention] (Griffin).
  layer: Any = "lru"
  # Keyword arguments of the layer class, e.g. {d_state: 64, r_min: 0.4} for ssmkit.layers.LRU;
  # each must be a field of the class, of its type. With a list of layers, a mapping from each
  # name to its keyword arguments, e.g. {attention: {window: 64}}.
  layer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Model width H.
  features: int = 64
  # Number of residual blocks.
  num_blocks: int = 2
  # "mean" or "last" over the real steps for one label per sequence; "none" for per-step targets.
  pooling: str = "mean"
  # "ssm": norm, layer, activation or GLU, residual (ssmkit.layers.SSMBlock); "mixer": pre-norm,
  # layer, residual, then an optional pre-norm MLP and residual (ssmkit.layers.MixerBlock).
  block: str = "ssm"
  # Normalisation in the blocks.
  norm: str = "layer"
  # Epsilon of every norm; null: flax's default (1e-6 for layer and rms, 1e-5 for batch).
  norm_eps: float | None = None
  # After the layer of an "ssm" block: GELU, or GELU and a gated linear unit.
  activation: str = "glu"
  # The MLP of a "mixer" block: none, gelu, geglu, swiglu, or experts (a mixture of experts).
  mlp: str = "none"
  # The MLP's hidden width over `features`.
  mlp_expansion: float = 4.0
  # Biases in the MLP's projections.
  mlp_bias: bool = False
  # With mlp: experts, the keyword arguments of ssmkit.layers.Experts, e.g. {num_experts: 8,
  # top_k: 2, width: 128, shared_width: 128, balance_weight: 0.01}; its weighted load-balancing
  # loss is added to the training loss.
  experts: dict[str, Any] | None = None
  # Dropout inside the blocks during training.
  dropout_rate: float = 0.0
  # Normalise block inputs (true) or residual sums (false; "ssm" blocks only).
  prenorm: bool = True
  # Apply the blocks with nn.scan over stacked parameters (compile time independent of depth).
  scan_blocks: bool = False
  # With a list of layers, how many of its first places are the first blocks' alone: block
  # i < head_blocks takes place i and the later blocks cycle over the places after them, e.g.
  # [attention, gated_deltanet] with head_blocks 1: one attention block, then Gated DeltaNet
  # blocks. With scan_blocks, those first blocks run as a scanned head of their own.
  head_blocks: int = 0
  # Decode tokens with the transposed input embedding (per-step token targets of the input vocabulary).
  tie_embeddings: bool = False
  # A bias on the decoder (an untied head); published language models have none.
  decoder_bias: bool = True
  # Multiply token embeddings by sqrt(features).
  scale_embeddings: bool = False
  # Soft-cap the outputs to logit_cap * tanh(y / logit_cap); null for none.
  logit_cap: float | None = None
  # Computation dtype of activations, norms and projections, e.g. bfloat16 for mixed precision
  # (the layers keep their recurrences in float32); null: that of the inputs and parameters.
  dtype: str | None = None
  # Dtype of the model's own parameters (embedding, norms, projections); the layers' follow
  # their `param_dtype` keyword argument.
  param_dtype: str = "float32"
  # Scan mode of the SSM layers.
  mode: str = "auto"


# Each string field of the `model` section with the values it may take.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.layer": tuple(LAYERS),
    "model.pooling": POOLINGS,
    "model.block": BLOCKS,
    "model.norm": NORMS,
    "model.activation": ACTIVATIONS,
    "model.mlp": MLPS,
    "model.mode": tuple(mode.value for mode in Mode),
}
# Each numeric field of the `model` section with the smallest value it may take.
MINIMUMS: dict[str, float] = {"model.features": 1, "model.num_blocks": 1}
# Each numeric field of the `model` section that must be > 0 (None passes).
POSITIVE = ("model.mlp_expansion", "model.logit_cap", "model.norm_eps")

# The options of `ssmkit.layers.SequenceModel` that the section gives by the same names.
_MODEL_OPTIONS = ("features", "num_blocks", "pooling", "block", "norm", "norm_eps", "activation", "mlp",
                  "mlp_expansion", "mlp_bias", "dropout_rate", "prenorm", "scan_blocks",
                  "head_blocks", "tie_embeddings", "decoder_bias", "scale_embeddings", "logit_cap")
# The parameters trained without weight decay wherever they are: biases, norm scales,
# embeddings, and a mixture of experts' score bias (in a block's MLP or a feed-forward layer).
_NO_DECAY = ("bias", "scale", "embedding", *MixtureOfExperts.parameter_groups.no_decay)
# Names of the layer's scope inside an `ssmkit.layers.SSMBlock` and a `MixerBlock`.
_LAYER_SCOPES = ("ssm", "mixer")


def layer_names(config: ModelConfig) -> tuple[str, ...]:
  """The registry names of the layers `config.layer` cycles over the blocks (one for one layer),
  checked as `CHOICES` checks them."""
  schema.check_values(types.SimpleNamespace(model=config), {"model.layer": CHOICES["model.layer"]}, {})
  return tuple(config.layer) if isinstance(config.layer, list | tuple) else (config.layer,)


def _layer_kwargs(config: ModelConfig) -> dict[str, tuple[str, dict[str, Any]]]:
  """Each layer name of `config` with the config key of its keyword arguments and their values.

  Raises:
    ConfigError: for a list of layers whose `layer_kwargs` names a layer not in the list, or
      gives one a value that is not a mapping.
  """
  names = layer_names(config)
  if not isinstance(config.layer, list | tuple):
    return {names[0]: ("model.layer_kwargs", config.layer_kwargs)}
  for name, kwargs in config.layer_kwargs.items():
    if name not in names:
      raise ConfigError(f"`model.layer_kwargs.{name}`: with a list of layers, `model.layer_kwargs` "
                        f"maps each of {sorted(set(names))} to its keyword arguments; {name!r} is "
                        "not in `model.layer`.")
    if not isinstance(kwargs, dict):
      raise ConfigError(f"`model.layer_kwargs.{name}` must be a mapping of keyword arguments of "
                        f"that layer, got {kwargs!r}.")
  return {name: (f"model.layer_kwargs.{name}", dict(config.layer_kwargs.get(name, {})))
          for name in names}


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
  """Checks the layers of `config` and that every keyword argument of each is a field of the
  layer, with a value of its type.

  Raises:
    ConfigError: naming `model.layer` or `model.layer_kwargs.<key>` (with a list of layers,
      `model.layer_kwargs.<layer>.<key>`), the layer and what it expected.
  """
  for name, (where, kwargs) in _layer_kwargs(config).items():
    cls = LAYERS[name].layer
    fields = _layer_fields(cls)
    for key, value in kwargs.items():
      if key not in fields:
        raise ConfigError(
            f"`{where}.{key}` is not a field of ssmkit.layers.{cls.__name__}; "
            f"its fields are: {', '.join(sorted(fields))}."
        )
      if not _accepts(fields[key], value):
        raise ConfigError(
            f"`{where}.{key}` must be {_type_name(fields[key])} (the type of "
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
  """Initialises each layer of `config` (shapes only) to find keyword arguments it rejects.

  A value of the right type may still be out of the layer's range (`d_state=-3`,
  `r_min` > `r_max`). The layer raises then, in its own words; this names the keys that
  cause it: those without which the layer builds, else those with which alone it fails.

  Raises:
    ConfigError: naming `model.layer_kwargs.<key>` and the layer's error.
  """
  for name, (where, kwargs) in _layer_kwargs(config).items():
    cls = LAYERS[name].layer
    error = _layer_error(cls, kwargs, config.features)
    if error is None:
      continue
    fails = lambda keys, cls=cls, kwargs=kwargs: _layer_error(
        cls, {key: kwargs[key] for key in keys}, config.features) is not None
    culprits = ([key for key in kwargs if not fails(kwargs.keys() - {key})]
                or [key for key in kwargs if fails({key})] or list(kwargs))
    values = ", ".join(f"`{where}.{key}`={kwargs[key]!r}" for key in culprits)
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    raise ConfigError(
        f"ssmkit.layers.{cls.__name__} rejects {values or 'its defaults'}: {message}") from error


def build_model(config: ModelConfig, num_outputs: int, vocab_size: int | None) -> layers.SequenceModel:
  """The `SequenceModel` that `config` describes, its layers' keyword arguments checked.

  Args:
    config: the `model` section of a training config.
    num_outputs: classes, or the output vocabulary of per-step targets.
    vocab_size: input vocabulary of token inputs; None for real-valued inputs.

  Returns:
    An unbound `ssmkit.layers.SequenceModel`.

  Raises:
    ConfigError: for a layer keyword argument the layer does not have, of another type, or
      that the layer rejects (the message names `model.layer_kwargs.<key>`), or model options
      that do not fit together (naming the option).
  """
  check_layer_kwargs(config)
  check_layer_values(config)
  by_name = {name: functools.partial(LAYERS[name].layer, **kwargs)
             for name, (_, kwargs) in _layer_kwargs(config).items()}
  pattern = tuple(by_name[name] for name in layer_names(config))
  model = layers.SequenceModel(
      num_outputs=num_outputs,
      layer=pattern if isinstance(config.layer, list | tuple) else pattern[0],
      vocab_size=vocab_size,
      dtype=None if config.dtype is None else float_dtype(config.dtype, "model.dtype"),
      param_dtype=float_dtype(config.param_dtype, "model.param_dtype"),
      experts=_experts(config.experts),
      **{name: getattr(config, name) for name in _MODEL_OPTIONS},
  )
  try:
    check_model(model)
  except ValueError as error:
    # The option a model error names first is the one at fault: name it by its config key.
    raise ConfigError(re.sub(r"`(\w+)`", r"`model.\1`", str(error), count=1)) from None
  return model


def _experts(kwargs: dict[str, Any] | None) -> layers.Experts | None:
  """The `ssmkit.layers.Experts` of `model.experts`, or None.

  Raises:
    ConfigError: naming `model.experts` (and the key) when it is no mapping of the fields of
      `ssmkit.layers.Experts`, or a value that it rejects.
  """
  if kwargs is None:
    return None
  fields = {f.name for f in dataclasses.fields(layers.Experts)}
  if not isinstance(kwargs, dict) or set(kwargs) - fields:
    unknown = sorted(set(kwargs) - fields) if isinstance(kwargs, dict) else kwargs
    raise ConfigError(f"`model.experts` must map fields of ssmkit.layers.Experts "
                      f"({', '.join(sorted(fields))}) to values, got {unknown!r}.")
  try:
    return layers.Experts(**kwargs)
  except ValueError as error:
    raise ConfigError(re.sub(r"`(\w+)`", r"`model.experts.\1`", str(error), count=1)) from None


def float_dtype(name: str, key: str) -> type:
  """The floating dtype called `name` as `jax.numpy` names it (`jnp.bfloat16`), the form of the
  layers' defaults; a ConfigError naming `key` for anything else.

  `np.dtype("float32") == jnp.float32`, but the two hash apart: a model holding the one and
  an equal model holding the other (built in code, or loaded from a checkpoint) were two keys
  of every cache and static argument, each traced and compiled on its own.
  """
  try:
    dtype = jnp.dtype(name)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ConfigError(f"`{key}` must be a floating dtype name (bfloat16, float16, float32), got "
                      f"{name!r}.")
  return getattr(jnp, dtype.name)


def _pattern_position(names: list[Any], length: int, head: int, scanned: bool) -> int:
  """The place in a layer pattern of `length`, its first `head` places the head's
  (`SequenceModel.head_blocks`), of the block a parameter path `names` lies in.

  Block i of an unrolled model (linen `block_<i>`, NNX `blocks/<i>`) takes the place
  `pattern_place` gives it (i mod length without a head). In a scanned model, `head/block_<j>`
  (NNX `head/<j>`) is place j and `blocks/block_<j>` or `tail/block_<j>` (NNX `blocks/<j>`,
  `tail/<j>`) place head + j; a scanned single layer is place 0. Without a head both readings
  of NNX's `blocks/<j>` agree; with one, only a `scanned` model has a "head".
  """
  for before, name in zip([None, *names], names, strict=False):
    if isinstance(name, int) and before in ("head", "blocks", "tail"):
      index = name
    elif isinstance(name, str) and name.startswith("block_") and name[6:].isdigit():
      index = int(name[6:])
    else:
      continue
    if names[0] == "head":
      return index
    if scanned:
      return head + index
    return place_in_pattern(index, length, head)
  return 0


def parameter_labels(params: Any, layer: str | Sequence[str], head_blocks: int = 0) -> Any:
  """"ssm", "no_decay" or "decay" for every leaf of `params`, by its name and scope.

  Inside the layer of a block, the layer's `parameter_groups` decide: its recurrence
  parameters are "ssm", its no-decay ones "no_decay". Everywhere biases, norm scales (also
  a layer's own `*_norm_scale`), embeddings and experts' score biases are "no_decay"; every
  other parameter is "decay".

  Args:
    params: the "params" collection of a `SequenceModel` built with the layers `layer` names,
      or the `nnx.Param` state of an `ssmkit.nnx.SequenceModel` of them.
    layer: a key of `LAYERS`, or the keys of a layer pattern in order.
    head_blocks: the model's `head_blocks`: how many first places of the pattern are its first
      blocks' alone.

  Returns:
    A tree like `params` with one label string per leaf.
  """
  names = (layer,) if isinstance(layer, str) else tuple(layer)
  groups = [LAYERS[name].layer.parameter_groups for name in names]
  scanned = "head" in params

  def label(path: tuple[Any, ...], _: Any) -> str:
    # Dict keys name the scopes; in an NNX state each leaf is further a Variable's attribute.
    keys = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
    in_layer = any(scope in keys[:-1] for scope in _LAYER_SCOPES)
    own = groups[_pattern_position(keys, len(groups), head_blocks, scanned)]
    if in_layer and keys[-1] in own.recurrence:
      return "ssm"
    if ((in_layer and keys[-1] in own.no_decay) or keys[-1] in _NO_DECAY
        or keys[-1].endswith("_norm_scale")):
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
