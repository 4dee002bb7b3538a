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
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax

from ssmkit._src.layers import common
from ssmkit._src.modes import Mode

Array = jax.Array
# `cfg, params, *args -> value`: a function of a layer's parameters that both front ends offer
# as a method (S4D's `kernel`).
Method = Callable[..., Any]


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
  """

  param_specs: Callable[[Any, int], dict[str, common.ParamSpec]]
  sequence: Callable[..., tuple[Array, Any]]
  step: Callable[..., tuple[Any, Array]]
  initialize_state: Callable[[Any, tuple[int, ...]], Any]
  final_state_on_request: bool = False
  methods: Mapping[str, Method] = {}


def one_step(sequence: Callable[..., tuple[Array, Any]], cfg: Any, params: dict[str, Array],
             state: Any, x_t: Array, reset: Array | None) -> tuple[Any, Array]:
  """`step` as `sequence` over one step: `(state, y_t)` for `(*batch, features)` inputs `x_t`."""
  y, state = sequence(cfg, params, x_t[..., None, :], None if reset is None else reset[..., None],
                      Mode.SEQUENTIAL, initial_state=state)
  return state, y[..., 0, :]


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


def run_sequence(maths: Maths, cfg: Any, params: Callable[[int], dict[str, Array]], x: Array,
                 reset: Array | None, mode: str | Mode, *, initial_state: Any, return_state: bool,
                 axis_name: Hashable | None) -> Any:
  """A layer's `__call__` for either front end: inputs checked, then `maths.sequence`.

  Args:
    maths: the layer's functions.
    cfg: the layer's configuration.
    params: `params(features)`: the parameters for inputs of that width.
    x, reset, mode, initial_state, return_state, axis_name: as `LinenLayer.__call__`.

  Returns:
    The outputs, or `(outputs, state)` with `return_state`.
  """
  x, reset = common.check_sequence(x, reset)
  values = params(x.shape[-1])  # checks the configuration first
  _check_state(maths, cfg, initial_state, (*x.shape[:-2], x.shape[-1]), "initial_state")
  options = {"return_state": return_state} if maths.final_state_on_request else {}
  y, state = maths.sequence(cfg, values, x, reset, mode, initial_state=initial_state,
                            axis_name=axis_name, **options)
  return (y, state) if return_state else y


def run_step(maths: Maths, cfg: Any, params: Callable[[int], dict[str, Array]], state: Any, x_t: Array,
             reset: Array | None) -> tuple[Any, Array]:
  """A layer's `step` for either front end: input and state checked, then `maths.step`."""
  x_t, reset = common.check_step(x_t, reset)
  if state is None:
    raise ValueError("`state` must be a state like `initialize_state` makes for these inputs, got None.")
  values = params(x_t.shape[-1])
  _check_state(maths, cfg, state, x_t.shape, "state")
  return maths.step(cfg, values, state, x_t, reset)


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
               axis_name: Hashable | None = None) -> Any:
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

    Returns:
      `(..., T, H)` outputs in `x`'s dtype; with `return_state`, `(outputs, state)`.
    """
    return run_sequence(self.maths, self, self._params, x, reset, mode, initial_state=initial_state,
                        return_state=return_state, axis_name=axis_name)

  def initialize_state(self, input_shape: tuple[int, ...]) -> Any:
    """The zero state for inputs `(*batch, H)` of one step; needs no parameters."""
    return self.maths.initialize_state(self, tuple(input_shape))

  def step(self, state: Any, x_t: Array, reset: Array | None = None) -> tuple[Any, Array]:
    """Advances one step.

    Args:
      state: the state of the previous step.
      x_t: `(*batch, H)` input of this step.
      reset: optional `(*batch,)` booleans; True clears the state before this step.

    Returns:
      `(state, y_t)`: the new state and the `(*batch, H)` output.
    """
    return run_step(self.maths, self, self._params, state, x_t, reset)
