"""minGRU (Feng et al., "Were RNNs all we needed?", 2024): a GRU whose gate and candidate depend
on the input only, so the whole sequence is one linear recurrence."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp

from ssmkit._src.layers import common, functional, initializers
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.linear_recurrence import linear_recurrence
from ssmkit._src.modes import Mode

Array = jax.Array


def _width(cfg: Any, features: int) -> int:
  return features if cfg.d_state is None else cfg.d_state


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The parameters of a minGRU over `features` channels (PyTorch's nn.Linear initialisation)."""
  if cfg.d_state is not None:
    common.check_positive_int(cfg.d_state, "d_state")
  width = _width(cfg, features)
  bound = initializers.uniform(features**-0.5)
  specs = {
      "z_proj": ParamSpec((features, width), bound),
      "z_bias": ParamSpec((width,), bound),
      "h_proj": ParamSpec((features, width), bound),
      "h_bias": ParamSpec((width,), bound),
  }
  if width != features:
    specs["out_proj"] = ParamSpec((width, features), initializers.uniform(width**-0.5))
  return specs


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> Array:
  """The zero state `(*batch, d_state)` float32 for inputs `(*batch, H)`."""
  *batch, features = input_shape
  return jnp.zeros((*batch, _width(cfg, features)), jnp.float32)


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: Array | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, Array]:
  """minGRU over `(..., T, H)` inputs: `(y, state after the last step)`."""
  state = functional.starting_state(initialize_state, cfg, x, initial_state)
  dtype = common.computation_dtype(x.dtype)
  dense = lambda name: (common.project(x, params[f"{name}_proj"], dtype)
                        + common.leading_ones(params[f"{name}_bias"], x.ndim))
  k, candidate = dense("z"), dense("h")
  # 1 - z = sigmoid(-k), exact where z is close to 1.
  h, last = linear_recurrence(jax.nn.sigmoid(-k), jax.nn.sigmoid(k) * candidate, state,
                              reset=reset, axis=-2, mode=mode, return_final_state=True,
                              axis_name=axis_name)
  y = common.project(h, params["out_proj"], dtype) if "out_proj" in params else h
  return y.astype(x.dtype), last


def step(cfg: Any, params: dict[str, Array], state: Array, x_t: Array,
         reset: Array | None = None) -> tuple[Array, Array]:
  """One minGRU step on `(*batch, H)` inputs: `(state, y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class MinGRU(functional.LinenLayer):
  """minGRU: h_t = (1 - z_t) * h_{t-1} + z_t * h~_t with z_t = sigmoid(W_z x_t + b_z) and
  h~_t = W_h x_t + b_h.

  Inputs `(..., T, H)` give outputs `(..., T, H)`: h_t itself when `d_state` is H (or None),
  else W_out h_t. Neither the gate nor the candidate reads h_{t-1}, so the sequence is one
  `ssmkit.scan.linear_recurrence` (decay 1 - z_t = sigmoid(-W_z x_t - b_z), computed
  without cancellation), in every mode. The paper's log-space form is not needed here: its
  purpose is a stable parallel scan from cumulative products, and the scan never forms
  them (a float32 run over 8192 steps with gates near 0 and 1 matches the float64 loop to
  float32 rounding; see the tests). `reset` clears the state.

  Attributes:
    d_state: width N of the hidden state; None: H (no output projection).
    param_dtype: dtype of the parameters.

  References:
    Feng, Tung, Ahmed, Bengio & Hajimirsadeghi, "Were RNNs all we needed?", 2024
    (arXiv:2410.01201), Sec. 3.2 (minGRU).
  """

  d_state: int | None = None
  param_dtype: jnp.dtype = jnp.float32

  parameter_groups = common.ParameterGroups(no_decay=frozenset({"z_bias", "h_bias"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)
