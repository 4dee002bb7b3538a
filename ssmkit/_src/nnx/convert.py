"""Trained parameters across the front ends: `from_linen` and `to_linen`.

A linen layer's parameter tree and its NNX module's state have the same names. Around the
layers the paths differ only in three ways: linen's `Norm` holds its norm as `LayerNorm_0`,
`RMSNorm_0`, `RMSNormPlusOne_0` or `BatchNorm_0`; linen's unrolled blocks are `block_<i>`
where NNX has `blocks/<i>`; linen's scanned blocks are `blocks/block` where NNX has `blocks`,
or for a layer pattern `blocks/block_<j>`, `tail/block_<j>` and `head/block_<j>` where NNX
has `blocks/<j>`, `tail/<j>` and `head/<j>`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import numpy as np
from flax import nnx, traverse_util

from ssmkit._src.layers import block as linen_block
from ssmkit._src.layers import model as linen_model
from ssmkit._src.nnx.block import NORM_MODULES, MixerBlock, SSMBlock, norm_kind
from ssmkit._src.nnx.layers import Layer, front_end, option_names
from ssmkit._src.nnx.model import SequenceModel

Array = jax.Array
Module = Layer | SSMBlock | MixerBlock | SequenceModel
# The options of a `SequenceModel` beside its layers, by the same names in both front ends.
_MODEL_OPTIONS = ("num_outputs", "features", "num_blocks", "vocab_size", "pooling", "block", "norm",
                  "norm_eps", "activation", "mlp", "mlp_expansion", "mlp_bias", "experts",
                  "dropout_rate", "prenorm", "scan_blocks", "head_blocks", "tie_embeddings",
                  "decoder_bias", "scale_embeddings", "logit_cap", "logits_scaling",
                  "residual_scale", "mlp_scales", "norm_position", "dtype", "param_dtype")

# The linen collection of each kind of NNX variable that a conversion moves.
_COLLECTIONS: dict[type[nnx.Variable], str] = {nnx.Param: "params", nnx.BatchStat: "batch_stats"}
# Where linen's `Norm` keeps the flax norm of each kind.
_LINEN_NORM_SCOPES = {"layer": "LayerNorm_0", "rms": "RMSNorm_0",
                      "rms_plus_one": "RMSNormPlusOne_0", "batch": "BatchNorm_0"}


def _options(layer: Any) -> dict[str, Any]:
  """The options of a layer of either front end, by name."""
  linen = front_end(type(layer), "module").linen if isinstance(layer, nn.Module) else type(layer).linen
  return {name: getattr(layer, name) for name in option_names(linen)}


def _layer_width(cls: type[Layer], config: nn.Module, params: dict[str, Any]) -> int:
  """The input width H for which the layer's parameters have the shapes of `params`."""
  shapes = {name: tuple(np.shape(value)) for name, value in params.items()}
  for width in sorted({size for shape in shapes.values() for size in shape}):
    try:
      specs = cls.maths.param_specs(config, width)
    except ValueError:  # a width this configuration refuses (e.g. not a multiple of its heads)
      continue
    if {name: spec.shape for name, spec in specs.items()} == shapes:
      return width
  raise ValueError(f"`variables` do not hold the parameters of a {cls.__name__} configured as "
                   f"{_options(config)}: got shapes {shapes}.")


def _linen_path(model: Module, path: tuple[Any, ...]) -> tuple[Any, ...]:
  """The path in the linen variables (collection left out) of the NNX variable at `path`."""
  owner = model
  for key in path[:-1]:
    owner = owner[key] if isinstance(key, int) else getattr(owner, key)
  head = path[:-1]
  if isinstance(model, SequenceModel) and path[0] in ("blocks", "tail", "head"):
    if not model.scan_blocks:
      head = (f"block_{path[1]}", *path[2:-1])
    elif callable(model.layer):
      head = ("blocks", "block", *path[1:-1])
    else:
      head = (path[0], f"block_{path[1]}", *path[2:-1])
  if isinstance(owner, tuple(NORM_MODULES.values())):
    head = (*head, _LINEN_NORM_SCOPES[norm_kind(owner)])
  return (*head, path[-1])


def _without_parameters(make: Callable[..., Module], rngs: nnx.Rngs) -> Module:
  """`make(rngs=rngs)` with its parameters and statistics as shapes only (the caller sets them all),
  its random streams as `make` leaves them, and `rngs` advanced as `make` advances it.

  Drawing a checkpoint's model at random only to overwrite it took a second copy of its
  weights in memory and the time of their draws; here `make` is traced twice, for its shapes
  and for its streams' keys (a program from which XLA drops the draws), and nothing else is
  computed. One trace would do for both, but a module merged from the keys' trace holds
  variables that flax then refuses to update outside it.
  """
  graph, streams = nnx.split(rngs)

  def keys(streams):
    rngs = nnx.merge(graph, streams)
    return nnx.state(make(rngs=rngs), nnx.RngState), nnx.state(rngs)

  model = nnx.eval_shape(lambda streams: make(rngs=nnx.merge(graph, streams)), streams)
  model_keys, advanced = jax.jit(keys)(streams)
  nnx.update(model, model_keys)
  nnx.update(rngs, advanced)
  return model


def _moved(model: Module) -> list[tuple[tuple[Any, ...], tuple[Any, ...], Array]]:
  """`(NNX path, linen path with its collection, value or its shape)` of every parameter and
  BatchNorm statistic of `model`."""
  state = nnx.state(model, nnx.Any(*_COLLECTIONS))
  return [(path, (_COLLECTIONS[type(variable)], *_linen_path(model, path)), variable.get_value())
          for path, variable in nnx.to_flat_state(state)]


def _front_end_factory(linen_factory: Callable[..., nn.Module]) -> Callable[..., Layer]:
  """The NNX layer factory (class and options) of a linen block's `layer`."""
  layer = linen_factory(parent=None)
  return functools.partial(front_end(type(layer), "module.layer"), **_options(layer))


def _linen_factory(layer: Layer) -> Callable[..., nn.Module]:
  """The linen layer factory (class and options) of an NNX layer."""
  return functools.partial(type(layer).linen, **_options(layer))


def _block_options(block: Any) -> dict[str, Any]:
  """The options of a linen block, but its layer."""
  kind = "mixer" if isinstance(block, linen_block.MixerBlock) else "ssm"
  own = ("norm_position",) if kind == "mixer" else ()
  return {name: getattr(block, name) for name in (*linen_model.BLOCK_OPTIONS[kind], *own)}


def _pattern_layers(model: SequenceModel) -> list[Layer]:
  """The NNX layer of each position of a model's layer pattern (stacked under `scan_blocks`)."""
  if model.scan_blocks and callable(model.layer):
    blocks = [model.blocks]
  else:
    blocks = [*(model.head or ()), *model.blocks][:len(linen_model.layer_pattern(model.layer))]
  return [getattr(block, block._layer_name) for block in blocks]


def from_linen(module: nn.Module, variables: Any, *, rngs: nnx.Rngs | None = None) -> Module:
  """The NNX module of a linen layer, `SSMBlock` or `SequenceModel`, with its parameters.

  The module is built without drawing parameters of its own (their shapes are traced, the
  draws dropped), so converting a large model holds no second, random copy of its weights.

  Args:
    module: a layer of `ssmkit.layers` (or a subclass of one), an `ssmkit.layers.SSMBlock` or an
      `ssmkit.layers.SequenceModel`.
    variables: its variables, `{"params": ...}` plus "batch_stats" with BatchNorm.
    rngs: random streams of the NNX module's dropout; default `nnx.Rngs(0)`.

  Returns:
    The `ssmkit.nnx` module of the same configuration, input width and parameters (BatchNorm
    running averages included), in training mode as every new NNX module.

  Raises:
    TypeError: for a module of another kind.
    ValueError: for variables that do not fit the module, naming what is missing or extra.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from ssmkit import layers, nnx
    >>> layer = layers.LRU(d_state=4)
    >>> variables = layer.init(jax.random.key(0), jnp.ones((5, 3)))
    >>> nnx.from_linen(layer, variables).features
    3
  """
  rngs = nnx.Rngs(0) if rngs is None else rngs
  if not isinstance(variables, dict | flax.core.FrozenDict) or "params" not in variables:
    raise ValueError("`variables` must be the module's variables, `{\"params\": ...}` as `init` "
                     f"returns them, got {type(variables).__name__} with keys "
                     f"{sorted(variables) if hasattr(variables, 'keys') else None}.")
  params = variables["params"]
  if isinstance(module, linen_model.SequenceModel):
    in_features = None if module.vocab_size is not None else np.shape(params["encoder"]["kernel"])[0]
    layer = tuple(map(_front_end_factory, linen_model.layer_pattern(module.layer)))
    make = functools.partial(SequenceModel, in_features,
                             layer=layer[0] if callable(module.layer) else layer,
                             **{name: getattr(module, name) for name in _MODEL_OPTIONS})
  elif isinstance(module, linen_block.SSMBlock | linen_block.MixerBlock):
    norm = params["norm"][_LINEN_NORM_SCOPES[module.norm]]
    cls = MixerBlock if isinstance(module, linen_block.MixerBlock) else SSMBlock
    make = functools.partial(cls, np.shape(norm["scale"])[-1],
                             layer=_front_end_factory(module.layer), **_block_options(module))
  else:
    cls = front_end(type(module), "module")
    make = functools.partial(cls, _layer_width(cls, module, params), **_options(module))
  model = _without_parameters(make, rngs)
  given = traverse_util.flatten_dict({c: variables[c] for c in _COLLECTIONS.values() if c in variables})
  values = {}
  for path, linen_path, value in _moved(model):
    if linen_path not in given:
      raise ValueError(f"`variables` lack {'/'.join(map(str, linen_path))} of {type(module).__name__}.")
    # `device_put`, not `jnp.asarray`: the latter compiles a program per shape for NumPy
    # arrays (a published checkpoint's parameters).
    new = jax.device_put(given.pop(linen_path))
    if new.shape != value.shape:
      raise ValueError(f"`variables` hold {'/'.join(map(str, linen_path))} of shape {new.shape}; "
                       f"{type(module).__name__} needs {value.shape}.")
    values[path] = new
  if given:
    extra = ", ".join("/".join(map(str, path)) for path in given)
    raise ValueError(f"`variables` hold {extra}, which {type(module).__name__} does not have.")
  nnx.update(model, nnx.State.from_flat_path(values))
  return model


def to_linen(model: Module) -> tuple[nn.Module, dict[str, Any]]:
  """The linen module of an `ssmkit.nnx` layer, `SSMBlock` or `SequenceModel`, and its variables.

  Args:
    model: an `ssmkit.nnx` module.

  Returns:
    `(module, variables)`: the `ssmkit.layers` module of the same configuration and its
    variables, `{"params": ...}` plus "batch_stats" with BatchNorm, for `module.apply`.

  Raises:
    TypeError: for a module of another kind.
  """
  if isinstance(model, SequenceModel):
    layer = tuple(map(_linen_factory, _pattern_layers(model)))
    module = linen_model.SequenceModel(layer=layer[0] if callable(model.layer) else layer,
                                       **{name: getattr(model, name) for name in _MODEL_OPTIONS})
  elif isinstance(model, SSMBlock):
    module = linen_block.SSMBlock(
        layer=_linen_factory(model.ssm), norm=norm_kind(model.norm), norm_eps=model.norm_eps,
        activation=model.activation, dropout_rate=model.dropout.rate, prenorm=model.prenorm,
        dtype=model.dtype, param_dtype=model.param_dtype)
  elif isinstance(model, MixerBlock):
    module = linen_block.MixerBlock(
        layer=_linen_factory(model.mixer), norm=norm_kind(model.norm), norm_eps=model.norm_eps,
        mlp=model.mlp, mlp_expansion=model.mlp_expansion, mlp_bias=model.mlp_bias,
        experts=model.experts, residual_scale=model.residual_scale, mlp_scales=model.mlp_scales,
        norm_position=model.norm_position,
        dropout_rate=model.dropout.rate, dtype=model.dtype,
        param_dtype=model.param_dtype)
  elif isinstance(model, Layer):
    module = type(model).linen(**_options(model))
  else:
    raise TypeError(f"`model` must be a module of ssmkit.nnx, got {type(model).__name__}.")
  variables = traverse_util.unflatten_dict({linen_path: value for _, linen_path, value in _moved(model)})
  return module, variables
