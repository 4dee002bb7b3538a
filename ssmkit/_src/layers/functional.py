"""Layers whose maths are pure functions of a configuration and a dict of parameters, and the
thin linen front end over them.

A layer module provides, for any `cfg` object with the layer's configuration attributes
(duck-typed: the linen module passes itself):

- `param_specs(cfg, features) -> dict[str, ParamSpec]`: every parameter by name, for inputs
  of `features` channels; it checks the configuration.
- `sequence(cfg, params, x, reset, mode, *, initial_state) -> (y, final_state)`.
- `step(cfg, params, state, x_t, reset) -> (state, y_t)`.
- `initialize_state(cfg, input_shape) -> state`.

Each front end (linen here) only creates the parameters and calls these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax

from ssmkit._src.layers import common
from ssmkit._src.modes import Mode

Array = jax.Array


class Maths(NamedTuple):
  """The pure functions of one layer (see the module docstring)."""

  param_specs: Callable[[Any, int], dict[str, common.ParamSpec]]
  sequence: Callable[..., tuple[Array, Any]]
  step: Callable[..., tuple[Any, Array]]
  initialize_state: Callable[[Any, tuple[int, ...]], Any]


def one_step(sequence: Callable[..., tuple[Array, Any]], cfg: Any, params: dict[str, Array],
             state: Any, x_t: Array, reset: Array | None) -> tuple[Any, Array]:
  """`step` as `sequence` over one step: `(state, y_t)` for `(*batch, features)` inputs `x_t`."""
  x_t, reset = common.check_step(x_t, reset)
  y, state = sequence(cfg, params, x_t[..., None, :], None if reset is None else reset[..., None],
                      Mode.SEQUENTIAL, initial_state=state)
  return state, y[..., 0, :]


def starting_state(initialize_state: Callable[[Any, tuple[int, ...]], Any], cfg: Any, x: Array,
                   initial_state: Any) -> Any:
  """The state a sequence `x` `(..., T, H)` starts from: `initial_state`, checked, or zeros."""
  zero = initialize_state(cfg, (*x.shape[:-2], x.shape[-1]))
  common.check_initial_state(initial_state, zero)
  return zero if initial_state is None else initial_state


class LinenLayer(nn.Module):
  """The linen front end of a layer whose `maths` are pure functions.

  A layer subclasses it with its configuration as dataclass fields (`param_dtype` among
  them) and its `Maths` as the class attribute `maths`.
  """

  maths = None

  @nn.compact
  def _params(self, features: int) -> dict[str, Array]:
    return common.linen_params(self, self.maths.param_specs(self, features), self.param_dtype)

  def __call__(self, x: Array, reset: Array | None = None, mode: str | Mode = "auto", *,
               initial_state: Any = None, return_state: bool = False) -> Array | tuple[Array, Any]:
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

    Returns:
      `(..., T, H)` outputs in `x`'s dtype; with `return_state`, `(outputs, state)`.
    """
    x, reset = common.check_sequence(x, reset)
    y, state = self.maths.sequence(self, self._params(x.shape[-1]), x, reset, mode,
                                   initial_state=initial_state)
    return (y, state) if return_state else y

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
    x_t, reset = common.check_step(x_t, reset)
    return self.maths.step(self, self._params(x_t.shape[-1]), state, x_t, reset)
