"""The Linear Recurrent Unit (Orvieto et al., "Resurrecting recurrent neural networks for
long sequences", ICML 2023): a complex diagonal recurrence with an exponential
parametrisation, ring initialisation and gamma normalisation."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common, functional
from ssmkit._src.linear_recurrence import accumulation_dtype, linear_recurrence
from ssmkit._src.modes import Mode

Array = jax.Array


def nu_log_init(r_min: float, r_max: float) -> nn.initializers.Initializer:
  """log(-log r) for radii r with r^2 uniform in [r_min^2, r_max^2]: uniform on the ring."""

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    u = jax.random.uniform(key, shape, dtype)
    return jnp.log(-0.5 * jnp.log(u * (r_max**2 - r_min**2) + r_min**2))

  return init


def theta_log_init(max_phase: float) -> nn.initializers.Initializer:
  """log of phases uniform in [0, max_phase]."""

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    return jnp.log(max_phase * jax.random.uniform(key, shape, dtype))

  return init


def eigenvalues(nu_log: Array, theta_log: Array) -> Array:
  """lambda = exp(-exp(nu_log) + i exp(theta_log)), inside the unit disk for any parameters."""
  return jnp.exp(-jnp.exp(nu_log) + 1j * jnp.exp(theta_log))


def gamma_log_init(key: Array, shape, dtype, nu_log: Array, theta_log: Array) -> Array:
  """log sqrt(1 - |lambda|^2) of the initial eigenvalues: the input scale that keeps the state's
  variance that of the input."""
  del key, shape
  return jnp.log(jnp.sqrt(1 - jnp.abs(eigenvalues(nu_log, theta_log)) ** 2)).astype(dtype)


def param_specs(cfg: Any, features: int) -> dict[str, common.ParamSpec]:
  """The LRU's parameters for inputs of width `features` H, in `cfg`'s configuration.

  Args:
    cfg: any object with the attributes of `LRU` (d_state, r_min, r_max, max_phase).
    features: the input width H.

  Returns:
    nu_log, theta_log, gamma_log `(N,)`; B_re, B_im `(N, H)`; C_re, C_im `(H, N)`; D `(H,)`.
  """
  common.check_positive_int(cfg.d_state, "d_state")
  if not 0 <= cfg.r_min <= cfg.r_max < 1:
    raise ValueError(f"need 0 <= r_min <= r_max < 1, got r_min={cfg.r_min}, r_max={cfg.r_max}.")
  n = cfg.d_state
  b = common.ParamSpec((n, features), nn.initializers.normal(1 / math.sqrt(2 * features)))
  c = common.ParamSpec((features, n), nn.initializers.normal(1 / math.sqrt(n)))
  return {
      "nu_log": common.ParamSpec((n,), nu_log_init(cfg.r_min, cfg.r_max)),
      "theta_log": common.ParamSpec((n,), theta_log_init(cfg.max_phase)),
      "gamma_log": common.ParamSpec((n,), gamma_log_init, inputs=("nu_log", "theta_log")),
      "B_re": b,
      "B_im": b,
      "C_re": c,
      "C_im": c,
      "D": common.ParamSpec((features,), nn.initializers.normal(1.0)),
  }


def _input(params: dict[str, Array], x: Array) -> Array:
  """gamma * B x, complex `(..., N)`."""
  gamma = jnp.exp(params["gamma_log"])[:, None]
  # Two real products instead of one complex one: about 1.5x faster.
  return jax.lax.complex(x @ (params["B_re"] * gamma).T, x @ (params["B_im"] * gamma).T)


def _output(params: dict[str, Array], h: Array, x: Array) -> Array:
  """Re(C h) + D x."""
  return h.real @ params["C_re"].T - h.imag @ params["C_im"].T + x * common.leading_ones(
      params["D"], x.ndim)


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None = None,
             mode: str | Mode = "auto", *, initial_state: Array | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, Array]:
  """The LRU over `(..., T, H)` inputs: `(y, final_state)`; `axis_name` as `LRU` describes it."""
  lam = eigenvalues(params["nu_log"], params["theta_log"])
  xf = x.astype(accumulation_dtype(x.dtype))
  h, last = linear_recurrence(lam, _input(params, xf), initial_state, reset=reset, axis=-2,
                              mode=mode, return_final_state=True, axis_name=axis_name,
                              overwrite_b=True)
  return _output(params, h, xf).astype(x.dtype), last


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> Array:
  """The zero state `(*batch, d_state)` complex64 for inputs `(*batch, H)` of one step."""
  return jnp.zeros((*tuple(input_shape)[:-1], cfg.d_state), jnp.complex64)


def step(cfg: Any, params: dict[str, Array], state: Array, x_t: Array, reset: Array | None = None
         ) -> tuple[Array, Array]:
  """One LRU step: `(state, y_t)` (see `LRU.step`)."""
  del cfg
  state = common.clear(state, reset)
  lam = eigenvalues(params["nu_log"], params["theta_log"])
  xf = x_t.astype(accumulation_dtype(x_t.dtype))
  state = common.leading_ones(lam, state.ndim) * state + _input(params, xf)
  return state, _output(params, state, xf).astype(x_t.dtype)


class LRU(functional.LinenLayer):
  """Linear Recurrent Unit: h_t = lambda * h_{t-1} + gamma * B x_t, y_t = Re(C h_t) + D * x_t.

  Inputs `(..., T, H)` give outputs `(..., T, H)`; the state is `(*batch, d_state)`
  complex64. The recurrence runs through `ssmkit.scan.linear_recurrence`, so every scan
  mode, `reset` flags and the memory-light gradient apply.

  Sequence parallelism: `__call__` takes `axis_name=`. Inside `jax.shard_map` with the time
  axis of `x` and `reset` split over the mesh axis of this name (consecutive slices of equal
  length in mesh order) and the parameters replicated, each device returns its slice of the
  outputs for the whole sequence (see `ssmkit.scan.linear_recurrence`). `initial_state` is
  read on the device holding the first steps; the returned state is the whole sequence's,
  the same on every device.

  Attributes:
    d_state: number of complex state dimensions N.
    r_min: smallest initial eigenvalue modulus.
    r_max: largest initial eigenvalue modulus (< 1).
    max_phase: initial eigenvalue phases are uniform in [0, max_phase].
    param_dtype: dtype of the parameters.

  References:
    Orvieto et al., "Resurrecting recurrent neural networks for long sequences", ICML 2023
    (arXiv:2303.06349).
  """

  d_state: int = 64
  r_min: float = 0.9
  r_max: float = 0.999
  max_phase: float = 2 * math.pi
  param_dtype: jnp.dtype = jnp.float32

  # Trained with the SSM learning rate and no weight decay, as in the LRU paper.
  parameter_groups = common.ParameterGroups(
      recurrence=frozenset({"nu_log", "theta_log", "gamma_log", "B_re", "B_im"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)
