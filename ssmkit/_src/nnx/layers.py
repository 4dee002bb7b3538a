"""The SSM layers as Flax NNX modules, each made from its linen layer: it holds the parameters
the layer's `param_specs` lists and runs the layer's own functions (`maths`), the ones the
linen module runs.

`front_end(linen_layer_class)` gives the NNX module class of any layer of the one pattern
(a `functional.LinenLayer` with its `Maths`), so a new layer needs no NNX code of its own.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Hashable
from typing import Any, ClassVar

import flax.linen as nn
import jax
from flax import nnx

from ssmkit._src.layers import common, functional
from ssmkit._src.layers.attention import Attention as _Attention
from ssmkit._src.layers.feed_forward import FeedForward as _FeedForward
from ssmkit._src.layers.gated_deltanet import GatedDeltaNet as _GatedDeltaNet
from ssmkit._src.layers.gated_deltaproduct import GatedDeltaProduct as _GatedDeltaProduct
from ssmkit._src.layers.kimi_delta_attention import KimiDeltaAttention as _KimiDeltaAttention
from ssmkit._src.layers.latent_attention import LatentAttention as _LatentAttention
from ssmkit._src.layers.lru import LRU as _LRU
from ssmkit._src.layers.mamba import Mamba as _Mamba
from ssmkit._src.layers.mamba2 import Mamba2 as _Mamba2
from ssmkit._src.layers.mamba3 import Mamba3 as _Mamba3
from ssmkit._src.layers.mingru import MinGRU as _MinGRU
from ssmkit._src.layers.parallel import Parallel as _Parallel
from ssmkit._src.layers.rglru import RGLRU as _RGLRU
from ssmkit._src.layers.rwkv7 import RWKV7 as _RWKV7
from ssmkit._src.layers.s4d import S4D as _S4D
from ssmkit._src.layers.s5 import S5 as _S5
from ssmkit._src.layers.short_conv import ShortConv as _ShortConv
from ssmkit._src.modes import Mode

Array = jax.Array

# Each front end by the linen layer it mirrors.
_BY_LINEN: dict[type[nn.Module], type[Layer]] = {}


def option_names(linen: type[nn.Module]) -> tuple[str, ...]:
  """The options of a linen layer class: its dataclass fields but `parent` and `name`."""
  return tuple(f.name for f in dataclasses.fields(linen) if f.init and f.name not in ("parent", "name"))


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
  `initialize_state` run the layer's functions (`linen.maths`), so both front ends compute
  the same.

  Attributes:
    features: the input width H.
    parameter_groups: the linen layer's `ParameterGroups`.
  """

  linen: ClassVar[type[functional.LinenLayer]]
  maths: ClassVar[functional.Maths]
  parameter_groups: ClassVar[common.ParameterGroups]

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    if "linen" in cls.__dict__:  # a front end, not a user's subclass of one
      cls.maths = cls.linen.maths
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

  def _params(self, features: int | None = None) -> dict[str, Array]:
    del features  # the parameters exist already
    return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}

  def __call__(self, x: Array, reset: Array | None = None, mode: str | Mode = "auto", *,
               initial_state: Any = None, return_state: bool = False,
               axis_name: Hashable | None = None,
               value_residual: functional.ValueResidual | None = None) -> Any:
    """Runs the whole sequence, as the linen layer's `__call__` does.

    Args:
      x: `(..., T, H)` inputs.
      reset: optional `(..., T)` booleans; True clears the state before that step.
      mode: scan mode of the recurrence.
      initial_state: optional state to start from, as `step` makes it; default zeros.
      return_state: also return the state after the last step.
      axis_name: the mesh axis over which the time axis is split, as for the linen layer.
      value_residual: for a layer that shares values (RWKV7), the value residual of the
        layers before it, as for the linen layer.

    Returns:
      `(..., T, H)` outputs in `x`'s dtype; with `return_state`, `(outputs, state)`; with
      `value_residual`, the value residual after this layer last.
    """
    return functional.run_sequence(self.maths, self, self._params, x, reset, mode,
                                   initial_state=initial_state, return_state=return_state,
                                   axis_name=axis_name, value_residual=value_residual)

  def initialize_state(self, input_shape: tuple[int, ...]) -> Any:
    """The zero state for inputs `(*batch, H)` of one step."""
    return self.maths.initialize_state(self, tuple(input_shape))

  def step(self, state: Any, x_t: Array, reset: Array | None = None,
           value_residual: functional.ValueResidual | None = None) -> tuple[Any, ...]:
    """Advances one step from `state` on `(*batch, H)` inputs; `(state, y_t)`. Call it
    compiled: `nnx.jit(lambda layer, state, x_t: layer.step(state, x_t))`.

    `reset`: optional `(*batch,)` booleans; True clears the state before this step. With a
    `value_residual` (as the linen layer's `step` takes it), `(state, y_t, value_residual)`.
    """
    return functional.run_step(self.maths, self, self._params, state, x_t, reset, value_residual)


def _method(fn: functional.Method) -> Any:
  """`fn(cfg, params, *args)` as a method of an NNX layer."""

  def method(self: Layer, *args: Any) -> Any:
    return fn(self, self._params(), *args)

  method.__name__, method.__qualname__, method.__doc__ = fn.__name__, fn.__name__, fn.__doc__
  return method


def front_end(linen: type[nn.Module], argument: str = "layer") -> type[Layer]:
  """The NNX layer class of the linen layer class `linen` (or of the layer it subclasses).

  Made on first use from the linen layer's options, `Maths` and parameter groups, then kept.

  Args:
    linen: a linen layer class: a `LinenLayer` subclass with its `maths`, such as every
      layer of `ssmkit.layers`.
    argument: the name of the argument `linen` came from, for the error message.

  Raises:
    TypeError: naming `argument` when `linen` is not such a layer.
  """
  for cls in linen.__mro__:
    if cls in _BY_LINEN:
      return _BY_LINEN[cls]
  owner = next((cls for cls in linen.__mro__ if cls.__dict__.get("maths") is not None), None)
  if owner is None or not issubclass(owner, functional.LinenLayer):
    raise TypeError(f"`{argument}` must be a layer of ssmkit.layers (a LinenLayer with its `maths`), "
                    f"an SSMBlock or a SequenceModel, got {linen.__name__}.")
  name = owner.__name__
  doc = (f"`{name}` as an NNX module: `{name}(features, *, <the linen layer's options>, rngs)`, "
         f"the maths of the linen layer below.\n\n{owner.__doc__ or ''}")
  methods = {method: _method(fn) for method, fn in owner.maths.methods.items()}
  return type(name, (Layer,), {"linen": owner, "__doc__": doc, "__module__": "ssmkit.nnx",
                               "__qualname__": name, **methods})


Attention = front_end(_Attention)
LRU = front_end(_LRU)
S4D = front_end(_S4D)
S5 = front_end(_S5)
Mamba = front_end(_Mamba)
Mamba2 = front_end(_Mamba2)
Mamba3 = front_end(_Mamba3)
GatedDeltaNet = front_end(_GatedDeltaNet)
GatedDeltaProduct = front_end(_GatedDeltaProduct)
KimiDeltaAttention = front_end(_KimiDeltaAttention)
RWKV7 = front_end(_RWKV7)
RGLRU = front_end(_RGLRU)
MinGRU = front_end(_MinGRU)
FeedForward = front_end(_FeedForward)
ShortConv = front_end(_ShortConv)
Parallel = front_end(_Parallel)
LatentAttention = front_end(_LatentAttention)
