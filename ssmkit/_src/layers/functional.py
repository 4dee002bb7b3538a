"""The one pattern of every layer: its maths as pure functions of a configuration and a dict of
parameters, and the thin linen front end over them.

A layer's file provides, for any `cfg` object with the layer's configuration attributes
(duck-typed: each front end passes itself), a `Maths` of four functions:

- `param_specs(cfg, features) -> dict[str, ParamSpec]`: every parameter by name, for inputs
  of `features` channels; it checks the configuration.
- `sequence(cfg, params, x, reset, mode, *, initial_state, axis_name) -> (y, final_state)`,
  on inputs already checked (`run_sequence` checks them, and `initial_state`); with
  `axis_name`, the time axis is split over that mesh axis (see `LinenLayer.__call__`).
- `step(cfg, params, state, x_t, reset) -> (state, y_t)`, on checked inputs and state.
- `initialize_state(cfg, input_shape) -> state`.

and its linen module: a `LinenLayer` subclass with the configuration as dataclass fields.
The NNX front end (`ssmkit.nnx`) is made from the linen module, so both compute the same.

A layer that takes part in the value residual (RWKV-7) also gives `value_width`; its `sequence`
then takes a `ValueResidual` as `value_residual` and returns `(y, final_state, value_residual)`,
and its `step` takes it last and returns `(state, y_t, value_residual)`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common
from ssmkit._src.linear_recurrence import accumulation_dtype
from ssmkit._src.modes import Mode

Array = jax.Array
# `cfg, params, *args -> value`: a function of a layer's parameters that both front ends offer
# as a method (S4D's `kernel`).
Method = Callable[..., Any]


class ValueResidual(NamedTuple):
  """The values the first value-sharing layer of a model passes to the later ones, beside the
  residual stream (RWKV-7's `v_first`): each later layer mixes them into its own values.

  A model starts it with `start` and threads it through its blocks; a layer on its own
  starts its own, so it is the model's first.

  Attributes:
    values: `(..., T, C)` values per step (`(*batch, C)` for one step), in the accumulation
      dtype of the layers' inputs (float32 for bfloat16 or float32, float64 for float64).
    written: `()` bool: whether a layer has written `values` (zeros until then); the next
      sharing layer writes its own when it is False.
  """

  values: Array
  written: Array

  @classmethod
  def start(cls, x: Array, width: int) -> ValueResidual:
    """Nothing written yet, for inputs `x` `(..., T, H)` (or `(*batch, H)`) of layers sharing
    `width` channels."""
    dtype = accumulation_dtype(x.dtype)
    return cls(jnp.zeros((*x.shape[:-1], width), dtype), jnp.zeros((), bool))

  def passed(self, first: Array) -> ValueResidual:
    """The value residual after a sharing layer whose first values (its own, when nothing was
    written) are `first`."""
    return ValueResidual(first.astype(self.values.dtype), jnp.ones((), bool))


class Maths(NamedTuple):
  """The pure functions of one layer (see the module docstring).

  Attributes:
    param_specs: `(cfg, features) -> dict[str, ParamSpec]`.
    sequence: `(cfg, params, x, reset, mode, *, initial_state, axis_name) -> (y, state)`.
    step: `(cfg, params, state, x_t, reset) -> (state, y_t)`.
    initialize_state: `(cfg, input_shape) -> state`.
    final_state_on_request: `sequence` takes `return_state` and computes the final state
      only when it is True, else returns None (S4D's convolution, a bidirectional S5).
    methods: further functions `(cfg, params, *args)` that the NNX front end offers as
      methods of the same names.
    value_width: for a layer that takes part in the value residual, `(cfg, features) -> C`,
      the channels of the values it shares; None for the others.
  """

  param_specs: Callable[[Any, int], dict[str, common.ParamSpec]]
  sequence: Callable[..., tuple[Array, Any]]
  step: Callable[..., tuple[Any, Array]]
  initialize_state: Callable[[Any, tuple[int, ...]], Any]
  final_state_on_request: bool = False
  methods: Mapping[str, Method] = {}
  value_width: Callable[[Any, int], int] | None = None


def shares_values(layer: Any) -> bool:
  """Whether `layer` (a linen or NNX layer, or any other module) takes part in the value
  residual."""
  maths = getattr(layer, "maths", None)
  return isinstance(maths, Maths) and maths.value_width is not None


def one_step(sequence: Callable[..., tuple[Array, Any]], cfg: Any, params: dict[str, Array],
             state: Any, x_t: Array, reset: Array | None,
             value_residual: ValueResidual | None = None) -> tuple[Any, ...]:
  """`step` as `sequence` over one step: `(state, y_t)` for `(*batch, features)` inputs `x_t`;
  with a `value_residual` of one step, `(state, y_t, value_residual)`."""
  reset = None if reset is None else reset[..., None]
  if value_residual is None:
    y, state = sequence(cfg, params, x_t[..., None, :], reset, Mode.SEQUENTIAL, initial_state=state)
    return state, y[..., 0, :]
  value_residual = value_residual._replace(values=value_residual.values[..., None, :])
  y, state, value_residual = sequence(cfg, params, x_t[..., None, :], reset, Mode.SEQUENTIAL,
                                      initial_state=state, value_residual=value_residual)
  return state, y[..., 0, :], value_residual._replace(values=value_residual.values[..., 0, :])


def starting_state(initialize_state: Callable[[Any, tuple[int, ...]], Any], cfg: Any, x: Array,
                   initial_state: Any) -> Any:
  """The state a sequence `x` `(..., T, H)` starts from: `initial_state`, or zeros."""
  if initial_state is not None:
    return initial_state
  return initialize_state(cfg, (*x.shape[:-2], x.shape[-1]))


def _check_state(maths: Maths, cfg: Any, state: Any, input_shape: tuple[int, ...], name: str) -> None:
  """Checks `state` (None passes) against the zero state of inputs `input_shape`, from shapes
  alone: nothing is built."""
  if state is not None:
    common.check_state(state, jax.eval_shape(lambda: maths.initialize_state(cfg, input_shape)), name)


def _value_residual(maths: Maths, cfg: Any, value_residual: ValueResidual | None, x: Array
                    ) -> ValueResidual | None:
  """The checked `value_residual` for inputs `x` `(..., T, H)` or `(*batch, H)`, a fresh one
  for a sharing layer given none, None for a layer that does not share."""
  if maths.value_width is None:
    if value_residual is not None:
      raise ValueError(f"`value_residual`: {type(cfg).__name__} shares no values; only layers with "
                       "a value residual (RWKV7) take one.")
    return None
  fresh = ValueResidual.start(x, maths.value_width(cfg, x.shape[-1]))
  if value_residual is None:
    return fresh
  if not isinstance(value_residual, ValueResidual):
    raise ValueError(f"`value_residual` must be a ValueResidual, got {type(value_residual).__name__}.")
  common.check_state(value_residual, fresh, "value_residual")
  return value_residual


def run_sequence(maths: Maths, cfg: Any, params: Callable[[int], dict[str, Array]], x: Array,
                 reset: Array | None, mode: str | Mode, *, initial_state: Any, return_state: bool,
                 axis_name: Hashable | None, value_residual: ValueResidual | None = None) -> Any:
  """A layer's `__call__` for either front end: inputs checked, then `maths.sequence`.

  Args:
    maths: the layer's functions.
    cfg: the layer's configuration.
    params: `params(features)`: the parameters for inputs of that width.
    x, reset, mode, initial_state, return_state, axis_name, value_residual: as
      `LinenLayer.__call__`.

  Returns:
    The outputs, or `(outputs, state)` with `return_state`; with `value_residual`, the value
    residual after the layer appended.
  """
  x, reset = common.check_sequence(x, reset)
  values = params(x.shape[-1])  # checks the configuration first
  _check_state(maths, cfg, initial_state, (*x.shape[:-2], x.shape[-1]), "initial_state")
  given = value_residual is not None
  value_residual = _value_residual(maths, cfg, value_residual, x)
  options = {"return_state": return_state} if maths.final_state_on_request else {}
  if value_residual is not None:
    options["value_residual"] = value_residual
  y, state, *shared = maths.sequence(cfg, values, x, reset, mode, initial_state=initial_state,
                                     axis_name=axis_name, **options)
  outputs = (y, state) if return_state else (y,)
  outputs += tuple(shared) if given else ()
  return outputs if len(outputs) > 1 else y


def run_step(maths: Maths, cfg: Any, params: Callable[[int], dict[str, Array]], state: Any, x_t: Array,
             reset: Array | None, value_residual: ValueResidual | None = None) -> tuple[Any, ...]:
  """A layer's `step` for either front end: input and state checked, then `maths.step`; with
  `value_residual`, `(state, y_t, value_residual)`."""
  x_t, reset = common.check_step(x_t, reset)
  if state is None:
    raise ValueError("`state` must be a state like `initialize_state` makes for these inputs, got None.")
  values = params(x_t.shape[-1])
  _check_state(maths, cfg, state, x_t.shape, "state")
  given = value_residual is not None
  value_residual = _value_residual(maths, cfg, value_residual, x_t)
  if value_residual is None:
    return maths.step(cfg, values, state, x_t, reset)
  outputs = maths.step(cfg, values, state, x_t, reset, value_residual)
  return outputs if given else outputs[:2]


class LinenLayer(nn.Module):
  """The linen front end of a layer whose `maths` are pure functions.

  A layer subclasses it with its configuration as dataclass fields (`param_dtype` among
  them), its `Maths` as the class attribute `maths` and its `ParameterGroups` as
  `parameter_groups`.
  """

  maths = None
  parameter_groups = common.ParameterGroups()

  @nn.compact
  def _params(self, features: int) -> dict[str, Array]:
    return common.linen_params(self, self.maths.param_specs(self, features), self.param_dtype)

  def __call__(self, x: Array, reset: Array | None = None, mode: str | Mode = "auto", *,
               initial_state: Any = None, return_state: bool = False,
               axis_name: Hashable | None = None, value_residual: ValueResidual | None = None) -> Any:
    """Runs the whole sequence.

    Args:
      x: `(..., T, H)` inputs.
      reset: optional `(..., T)` booleans; True clears the state (the convolution window
        included) before that step.
      mode: "auto", "sequential", "parallel" or "chunked": how the recurrence is scanned
        (see the layer's docstring). Every mode gives the same outputs.
      initial_state: optional state to start from, as `initialize_state` or `step` make it;
        default zeros.
      return_state: also return the state after the last step.
      axis_name: sequence parallelism. Inside `jax.shard_map` with the time axis of `x` and
        `reset` split over the mesh axis of this name (consecutive slices of equal length in
        mesh order) and the parameters replicated, each device returns its slice of the
        outputs of the whole sequence. `initial_state` is read on the device holding the
        first steps; the returned state is the whole sequence's, the same on every device.
      value_residual: for a layer that shares values (RWKV7), the `ValueResidual` of the
        layers before it in a model, `(..., T, C)`; without it the layer is a model's first.

    Returns:
      `(..., T, H)` outputs in `x`'s dtype; with `return_state`, `(outputs, state)`; with
      `value_residual`, the value residual after this layer last.
    """
    return run_sequence(self.maths, self, self._params, x, reset, mode, initial_state=initial_state,
                        return_state=return_state, axis_name=axis_name,
                        value_residual=value_residual)

  def initialize_state(self, input_shape: tuple[int, ...]) -> Any:
    """The zero state for inputs `(*batch, H)` of one step; needs no parameters."""
    return self.maths.initialize_state(self, tuple(input_shape))

  def step(self, state: Any, x_t: Array, reset: Array | None = None,
           value_residual: ValueResidual | None = None) -> tuple[Any, ...]:
    """Advances one step; call it compiled, as a loop over steps does:
    `step = jax.jit(functools.partial(layer.apply, method="step"))`, then
    `state, y_t = step(params, state, x_t)` (eagerly every operation dispatches on its own).

    Args:
      state: the state of the previous step.
      x_t: `(*batch, H)` input of this step.
      reset: optional `(*batch,)` booleans; True clears the state before this step.
      value_residual: for a layer that shares values, the `ValueResidual` of this step
        `(*batch, C)`, as `__call__` takes it.

    Returns:
      `(state, y_t)`: the new state and the `(*batch, H)` output; with `value_residual`,
      `(state, y_t, value_residual)`.
    """
    return run_step(self.maths, self, self._params, state, x_t, reset, value_residual)
