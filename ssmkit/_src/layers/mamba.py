"""The Mamba block (Gu & Dao, "Mamba: Linear-time sequence modeling with selective state
spaces", 2023): a selective SSM (S6) whose step, B and C depend on the input, behind a
short causal convolution and a SiLU gate."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common
from ssmkit._src.layers.convolution import causal_conv
from ssmkit._src.layers.selective_scan import selective_scan
from ssmkit._src.linear_recurrence import accumulation_dtype
from ssmkit._src.modes import Mode

Array = jax.Array


class MambaState(NamedTuple):
  """The state of one step.

  Attributes:
    conv: `(*batch, d_conv - 1, d_inner)` the last inputs of the causal convolution.
    ssm: `(*batch, d_inner, d_state)` the selective SSM's state.
  """

  conv: Array
  ssm: Array


def dt_bias_init(dt_min: float, dt_max: float, floor: float = 1e-4) -> nn.initializers.Initializer:
  """softplus^-1 of steps log-uniform in [dt_min, dt_max] (at least `floor`), as in Mamba."""

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    log_dt = jax.random.uniform(key, shape, dtype, math.log(dt_min), math.log(dt_max))
    dt = jnp.maximum(jnp.exp(log_dt), floor)
    return dt + jnp.log(-jnp.expm1(-dt))  # the inverse of softplus

  return init


def _a_log_init(key: Array, shape, dtype=jnp.float32) -> Array:
  """S4D-Real: A_n = -(n + 1) for every channel, stored as log(n + 1)."""
  del key
  return jnp.log(jnp.broadcast_to(jnp.arange(1, shape[-1] + 1, dtype=dtype), shape))


def param_specs(cfg: Any, features: int) -> dict[str, common.ParamSpec]:
  """The Mamba block's parameters for inputs of width `features` H, in `cfg`'s configuration.

  Args:
    cfg: any object with the attributes of `Mamba` (d_state, d_conv, expand, dt_rank,
      dt_min, dt_max).
    features: the input width H.

  Returns:
    in_proj `(H, 2 D)` for D = expand * H; conv_kernel `(d_conv, D)`; conv_bias `(D,)`;
    x_proj `(D, R + 2 N)` for the step rank R; dt_proj `(R, D)`; dt_bias `(D,)`; A_log
    `(D, N)`; D `(D,)`; out_proj `(D, H)`.
  """
  inner, n, rank = cfg.expand * features, cfg.d_state, cfg.dt_rank or math.ceil(features / 16)
  return {
      "in_proj": common.ParamSpec((features, 2 * inner), common.uniform(features**-0.5)),
      "conv_kernel": common.ParamSpec((cfg.d_conv, inner), common.uniform(cfg.d_conv**-0.5)),
      "conv_bias": common.ParamSpec((inner,), common.uniform(cfg.d_conv**-0.5)),
      "x_proj": common.ParamSpec((inner, rank + 2 * n), common.uniform(inner**-0.5)),
      "dt_proj": common.ParamSpec((rank, inner), common.uniform(rank**-0.5)),
      "dt_bias": common.ParamSpec((inner,), dt_bias_init(cfg.dt_min, cfg.dt_max)),
      "A_log": common.ParamSpec((inner, n), _a_log_init),
      "D": common.ParamSpec((inner,), nn.initializers.ones),
      "out_proj": common.ParamSpec((inner, features), common.uniform(inner**-0.5)),
  }


def _project(params: dict[str, Array], x: Array) -> tuple[Array, Array]:
  """The in-projection's two halves: the SSM branch v and the gate z, `(..., d_inner)` each."""
  inner = params["D"].shape[0]
  w_in = params["in_proj"]
  return x @ w_in[:, :inner], x @ w_in[:, inner:]


def _selective(cfg: Any, params: dict[str, Array], u: Array) -> tuple[Array, Array, Array]:
  """(dt `(..., d_inner)`, B `(..., N)`, C `(..., N)`) from the activated input u."""
  rank = params["dt_proj"].shape[0]
  dbc = u @ params["x_proj"]
  dt = jax.nn.softplus(dbc[..., :rank] @ params["dt_proj"]
                       + common.leading_ones(params["dt_bias"], u.ndim))
  return dt, dbc[..., rank : rank + cfg.d_state], dbc[..., rank + cfg.d_state :]


def _gate_and_project(params: dict[str, Array], y: Array, u: Array, z: Array) -> Array:
  y = y + u * common.leading_ones(params["D"], u.ndim)
  return (y * jax.nn.silu(z)) @ params["out_proj"]


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None = None,
             mode: str | Mode = "auto", *, initial_state: MambaState | None = None
             ) -> tuple[Array, MambaState]:
  """The Mamba block over a whole sequence: `(y, final_state)` (see `Mamba.__call__`)."""
  x, reset = common.check_sequence(x, reset)
  zero = initialize_state(cfg, x.shape[:-2] + x.shape[-1:])
  common.check_initial_state(initial_state, zero)
  xf = x.astype(accumulation_dtype(x.dtype))
  v, z = _project(params, xf)
  conv, window = causal_conv(v, params["conv_kernel"], params["conv_bias"],
                             (initial_state or zero).conv, reset)
  u = jax.nn.silu(conv)
  dt, b, c = _selective(cfg, params, u)
  h0 = None if initial_state is None else initial_state.ssm
  y, last = selective_scan(u, dt, -jnp.exp(params["A_log"]), b, c, h0=h0, reset=reset, mode=mode)
  return _gate_and_project(params, y, u, z).astype(x.dtype), MambaState(window, last)


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> MambaState:
  """Zero convolution window and SSM state for inputs `(*batch, H)` of one step."""
  batch, inner = tuple(input_shape)[:-1], cfg.expand * input_shape[-1]
  return MambaState(
      jnp.zeros((*batch, cfg.d_conv - 1, inner), jnp.float32),
      jnp.zeros((*batch, inner, cfg.d_state), jnp.float32),
  )


def step(cfg: Any, params: dict[str, Array], state: MambaState, x_t: Array,
         reset: Array | None = None) -> tuple[MambaState, Array]:
  """One step of the Mamba block: `(state, y_t)` (see `Mamba.step`)."""
  x_t, reset = common.check_step(x_t, reset)
  conv, ssm = common.clear(state, reset)
  xf = x_t.astype(accumulation_dtype(x_t.dtype))
  v, z = _project(params, xf)
  window = jnp.concatenate([conv, v[..., None, :]], axis=-2)
  kernel = common.leading_ones(params["conv_kernel"], window.ndim)
  u = jax.nn.silu(jnp.sum(window * kernel, axis=-2)
                  + common.leading_ones(params["conv_bias"], v.ndim))
  dt, b, c = _selective(cfg, params, u)
  a = -jnp.exp(params["A_log"])
  ssm = jnp.exp(dt[..., None] * common.leading_ones(a, dt.ndim + 1)) * ssm + (
      (dt * u)[..., None] * b[..., None, :]
  )
  y = jnp.einsum("...dn,...n->...d", ssm, c)
  return MambaState(window[..., 1:, :], ssm), _gate_and_project(params, y, u, z).astype(x_t.dtype)


class Mamba(nn.Module):
  """Mamba block: in-projection, causal depthwise convolution, S6 scan, SiLU gate, out-projection.

  Inputs `(..., T, H)` give outputs `(..., T, H)`. Per step t, with u_t the convolved and
  SiLU-activated input (`d_inner` channels): dt_t = softplus(W_dt W_x u_t + b), B_t and C_t
  are linear in u_t, h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t (ZOH for A, Euler for B, as
  the paper's code), y_t = C_t h_t + D u_t, gated by SiLU(z_t). The scan computes C_t h_t
  inside the recurrence and its gradient recomputes the states chunk by chunk, so the
  `(..., T, d_inner, N)` states are never all stored; `reset` clears both the SSM state and
  the convolution window.

  Attributes:
    d_state: SSM state size N per channel.
    d_conv: width of the causal convolution.
    expand: d_inner = expand * H.
    dt_rank: rank of the step projection; default ceil(H / 16).
    dt_min: smallest initial step.
    dt_max: largest initial step.
    param_dtype: dtype of the parameters.
  """

  d_state: int = 16
  d_conv: int = 4
  expand: int = 2
  dt_rank: int | None = None
  dt_min: float = 1e-3
  dt_max: float = 1e-1
  param_dtype: jnp.dtype = jnp.float32

  # As in the Mamba code: A, D and the biases at the base learning rate without weight decay.
  parameter_groups = common.ParameterGroups(no_decay=frozenset({"A_log", "dt_bias", "D", "conv_bias"}))

  def __post_init__(self) -> None:
    common.check_positive_int(self.d_state, "d_state")
    super().__post_init__()

  @nn.compact
  def _params(self, features: int) -> dict[str, Array]:
    return common.linen_params(self, param_specs(self, features), self.param_dtype)

  def __call__(self, x: Array, reset: Array | None = None, mode: str | Mode = "auto", *,
               initial_state: MambaState | None = None, return_state: bool = False
               ) -> Array | tuple[Array, MambaState]:
    """Runs the whole sequence.

    Args:
      x: `(..., T, H)` inputs.
      reset: optional `(..., T)` booleans; True starts a new episode at that step.
      mode: scan mode of the selective recurrence. "sequential" runs one loop over time
        that contracts the state with C inside each step, its gradient replaying one chunk
        of about sqrt(T) steps at a time (the fastest on CPU); "chunked" runs each chunk's
        `(L, ..., d_inner, N)` recurrence in the parallel mode of
        `ssmkit.scan.linear_recurrence` and carries the state from chunk to chunk;
        "parallel" does so over the whole sequence at once (T states in memory); "auto"
        is "sequential" on CPU and for T <= 64, else "chunked". Every mode gives the same
        outputs.
      initial_state: optional `MambaState` to start from, as `step` makes it; default zeros.
      return_state: also return the state after the last step.

    Returns:
      `(..., T, H)` outputs in `x`'s dtype; with `return_state`, `(outputs, state)`.
    """
    x, reset = common.check_sequence(x, reset)
    y, last = sequence(self, self._params(x.shape[-1]), x, reset, mode,
                       initial_state=initial_state)
    return (y, last) if return_state else y

  def initialize_state(self, input_shape: tuple[int, ...]) -> MambaState:
    """Zero convolution window and SSM state for inputs `(*batch, H)` of one step."""
    return initialize_state(self, input_shape)

  def step(
      self, state: MambaState, x_t: Array, reset: Array | None = None
  ) -> tuple[MambaState, Array]:
    """Advances one step.

    Args:
      state: the `MambaState` of the previous step.
      x_t: `(*batch, H)` input of this step.
      reset: optional `(*batch,)` booleans; True starts a new episode at this step.

    Returns:
      `(state, y_t)`: the new state and the `(*batch, H)` output.
    """
    x_t, reset = common.check_step(x_t, reset)
    return step(self, self._params(x_t.shape[-1]), state, x_t, reset)
