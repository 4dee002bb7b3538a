"""The SSM layers as Flax NNX modules: each holds the parameters its layer's `param_specs` lists
and runs the layer's own functions, the ones its linen module runs.

An NNX front end for a layer of `ssmkit/_src/layers/` is a subclass of `Layer` that names the
layer's module of functions and its linen module:

    class LRU(Layer):
      maths = lru
      linen = lru.LRU
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any, ClassVar

import flax.linen as nn
import jax
from flax import nnx

from ssmkit._src.layers import common, gated_deltanet, lru, mamba, mamba2, mingru, rglru, s4d, s5
from ssmkit._src.modes import Mode

Array = jax.Array

# Each front end by the linen layer it mirrors, for the conversions.
_BY_LINEN: dict[type[nn.Module], type[Layer]] = {}


def option_names(linen: type[nn.Module]) -> tuple[str, ...]:
  """The options of a linen layer class: its dataclass fields but `parent` and `name`."""
  return tuple(f.name for f in dataclasses.fields(linen) if f.init and f.name not in ("parent", "name"))


def front_end(linen: type[nn.Module], argument: str) -> type[Layer]:
  """The NNX layer class of the linen layer class `linen` (or of the layer it subclasses).

  Raises:
    TypeError: naming `argument` when `linen` is not a layer of `ssmkit.layers`.
  """
  for cls in linen.__mro__:
    if cls in _BY_LINEN:
      return _BY_LINEN[cls]
  raise TypeError(f"`{argument}` must be a layer of ssmkit.layers, an SSMBlock or a SequenceModel, "
                  f"got {linen.__name__}.")


def _signature(linen: type[nn.Module]) -> inspect.Signature:
  """`(features, *, <the linen layer's options with their defaults>, rngs)`."""
  keyword = inspect.Parameter.KEYWORD_ONLY
  fields = {f.name: f for f in dataclasses.fields(linen)}
  return inspect.Signature([
      inspect.Parameter("features", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=int),
      *(inspect.Parameter(name, keyword, default=fields[name].default) for name in option_names(linen)),
      inspect.Parameter("rngs", keyword, annotation=nnx.Rngs),
  ])


class Layer(nnx.Module):
  """An SSM layer as an NNX module: `Layer(features, *, <options>, rngs)`.

  The options are the fields of the linen layer (`linen`), with its defaults and its checks;
  the parameters are those of the layer's `param_specs`, by the same names as in the linen
  layer's parameter tree, drawn from `rngs.params()`; `__call__`, `step` and
  `initialize_state` run the layer's functions (`maths`), so both front ends compute the same.

  Attributes:
    features: the input width H.
    parameter_groups: the linen layer's `ParameterGroups`.
  """

  maths: ClassVar[types.ModuleType]
  linen: ClassVar[type[nn.Module]]
  parameter_groups: ClassVar[common.ParameterGroups]

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    if "linen" in cls.__dict__:
      cls.parameter_groups = cls.linen.parameter_groups
      cls.__signature__ = _signature(cls.linen)
      _BY_LINEN[cls.linen] = cls

  def __init__(self, features: int, *, rngs: nnx.Rngs, **options: Any):
    common.check_positive_int(features, "features")
    names = option_names(self.linen)
    unknown = sorted(set(options) - set(names))
    if unknown:
      raise TypeError(f"{type(self).__name__} got unknown options {unknown}; its options are {names}.")
    # The linen layer checks the values and fills in the defaults.
    config = self.linen(**options, parent=None)
    for name in names:
      setattr(self, name, getattr(config, name))
    self.features = features
    params = common.create_params(self.maths.param_specs(self, features), self.param_dtype,
                                  lambda name, init, shape, dtype: init(rngs.params(), shape, dtype))
    for name, value in params.items():
      setattr(self, name, nnx.Param(value))

  def _params(self) -> dict[str, Array]:
    return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}

  def __call__(self, x: Array, reset: Array | None = None, mode: str | Mode = "auto", *,
               initial_state: Any = None, return_state: bool = False, **options: Any) -> Any:
    """Runs the whole sequence, as the linen layer's `__call__` does.

    Args:
      x: `(..., T, H)` inputs.
      reset: optional `(..., T)` booleans; True clears the state before that step.
      mode: scan mode of the recurrence.
      initial_state: optional state to start from, as `step` makes it; default zeros.
      return_state: also return the state after the last step.
      **options: further keyword arguments of the layer (LRU: `axis_name`).

    Returns:
      `(..., T, H)` outputs in `x`'s dtype; with `return_state`, `(outputs, state)`.
    """
    y, last = self.maths.sequence(self, self._params(), x, reset, mode, initial_state=initial_state,
                                  **options)
    return (y, last) if return_state else y

  def initialize_state(self, input_shape: tuple[int, ...]) -> Any:
    """The zero state for inputs `(*batch, H)` of one step."""
    return self.maths.initialize_state(self, input_shape)

  def step(self, state: Any, x_t: Array, reset: Array | None = None) -> tuple[Any, Array]:
    """Advances one step from `state` on `(*batch, H)` inputs; `(state, y_t)`.

    `reset`: optional `(*batch,)` booleans; True clears the state before this step.
    """
    return self.maths.step(self, self._params(), state, x_t, reset)


class _StatefulOnRequest(Layer):
  """A layer whose final state exists only when asked for (S4D's convolution, bidirectional S5)."""

  def __call__(self, x: Array, reset: Array | None = None, mode: str | Mode = "auto", *,
               initial_state: Any = None, return_state: bool = False) -> Any:
    """Runs the whole sequence, as the linen layer's `__call__` does (see `Layer.__call__`)."""
    y, last = self.maths.sequence(self, self._params(), x, reset, mode, initial_state=initial_state,
                                  return_state=return_state)
    return (y, last) if return_state else y


class LRU(Layer):
  """`ssmkit.layers.LRU` as an NNX module: `LRU(features, d_state=64, ..., rngs=nnx.Rngs(0))`."""

  maths = lru
  linen = lru.LRU


class S4D(_StatefulOnRequest):
  """`ssmkit.layers.S4D` as an NNX module: `S4D(features, d_state=64, ..., rngs=nnx.Rngs(0))`."""

  maths = s4d
  linen = s4d.S4D

  def kernel(self, length: int) -> Array:
    """The convolution kernel `(directions, length, H)`, float32."""
    return s4d.kernel(self, self._params(), length)


class S5(_StatefulOnRequest):
  """`ssmkit.layers.S5` as an NNX module: `S5(features, d_state=64, ..., rngs=nnx.Rngs(0))`."""

  maths = s5
  linen = s5.S5


class Mamba(Layer):
  """`ssmkit.layers.Mamba` as an NNX module: `Mamba(features, d_state=16, ..., rngs=nnx.Rngs(0))`."""

  maths = mamba
  linen = mamba.Mamba


class Mamba2(Layer):
  """`ssmkit.layers.Mamba2` as an NNX module: `Mamba2(features, d_state=64, ..., rngs=nnx.Rngs(0))`."""

  maths = mamba2.Mamba2.maths
  linen = mamba2.Mamba2


class GatedDeltaNet(Layer):
  """`ssmkit.layers.GatedDeltaNet` as an NNX module: `GatedDeltaNet(features, ..., rngs=nnx.Rngs(0))`."""

  maths = gated_deltanet.GatedDeltaNet.maths
  linen = gated_deltanet.GatedDeltaNet


class RGLRU(Layer):
  """`ssmkit.layers.RGLRU` as an NNX module: `RGLRU(features, ..., rngs=nnx.Rngs(0))`."""

  maths = rglru.RGLRU.maths
  linen = rglru.RGLRU


class MinGRU(Layer):
  """`ssmkit.layers.MinGRU` as an NNX module: `MinGRU(features, ..., rngs=nnx.Rngs(0))`."""

  maths = mingru.MinGRU.maths
  linen = mingru.MinGRU
