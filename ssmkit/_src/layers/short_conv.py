"""The gated short convolution of Liquid AI's LFM2: a depthwise causal convolution between two
input-dependent gates, with a window of `d_conv` steps as its whole state."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp

from ssmkit._src.layers import common, functional
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.layers.convolution import causal_conv, zero_window
from ssmkit._src.layers.initializers import uniform
from ssmkit._src.modes import Mode

Array = jax.Array


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The projections, convolution (and biases) over `features` channels, initialised as
  PyTorch's `nn.Linear` and `nn.Conv1d`."""
  common.check_positive_int(cfg.d_conv, "d_conv")
  specs = {"in_proj": ParamSpec((features, 3 * features), uniform(features**-0.5)),
           "conv_kernel": ParamSpec((cfg.d_conv, features), uniform(cfg.d_conv**-0.5)),
           "out_proj": ParamSpec((features, features), uniform(features**-0.5))}
  if cfg.use_bias:
    specs.update(in_bias=ParamSpec((3 * features,), uniform(features**-0.5)),
                 conv_bias=ParamSpec((features,), uniform(cfg.d_conv**-0.5)),
                 out_bias=ParamSpec((features,), uniform(features**-0.5)))
  return specs


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> Array:
  """The zero window `(*batch, d_conv - 1, H)` for inputs `(*batch, H)`."""
  *batch, features = input_shape
  return zero_window(tuple(batch), cfg.d_conv, features)


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: Array | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, Array]:
  """The gated short convolution over `(..., T, H)` inputs: `(y, window after the last step)`."""
  del mode
  window = functional.starting_state(initialize_state, cfg, x, initial_state)
  dtype = common.computation_dtype(x.dtype)

  def dense(u: Array, name: str, bias: str) -> Array:
    u = common.project(u, params[name], dtype)
    return u + common.leading_ones(params[bias], u.ndim) if bias in params else u

  b, c, v = jnp.split(dense(x, "in_proj", "in_bias"), 3, axis=-1)
  mixed, window = causal_conv(b * v, params["conv_kernel"], params.get("conv_bias"), window,
                              reset, axis_name)
  return dense(c * mixed, "out_proj", "out_bias").astype(x.dtype), window


def step(cfg: Any, params: dict[str, Array], state: Array, x_t: Array,
         reset: Array | None = None) -> tuple[Array, Array]:
  """One step on `(*batch, H)` inputs: `(window, y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class ShortConv(functional.LinenLayer):
  """LFM2's gated short convolution: `(..., T, H)` -> `(..., T, H)`.

  Per step, [b, c, v] = W_in x_t (three blocks of H channels), u_t = b_t * v_t, and

    y_t = W_out (c_t * sum_l kernel[-1 - l] u_{t-l}),

  a depthwise causal convolution of `d_conv` taps between the two gates, without activation.
  Its state is the last `d_conv - 1` gated inputs; `reset` hides the steps before it from the
  convolution, and `mode` changes nothing (there is no recurrence).

  Attributes:
    d_conv: the convolution's taps (LFM2's `conv_L_cache`).
    use_bias: biases on the projections and the convolution (LFM2's `conv_bias`).
    param_dtype: dtype of the parameters.

  References:
    Liquid AI, "LFM2" (2025); `transformers`' `Lfm2ShortConv`.
  """

  d_conv: int = 3
  use_bias: bool = False
  param_dtype: jnp.dtype = jnp.float32

  parameter_groups = common.ParameterGroups(no_decay=frozenset({"in_bias", "conv_bias",
                                                                "out_bias"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)
