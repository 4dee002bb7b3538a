"""The Mamba block (Gu & Dao, "Mamba: Linear-time sequence modeling with selective state
spaces", 2023): a selective SSM (S6) whose step, B and C depend on the input, behind a
short causal convolution and a SiLU gate."""

from __future__ import annotations

import math
from typing import NamedTuple

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


class _Params(NamedTuple):
  w_in: Array
  conv_kernel: Array
  conv_bias: Array
  w_x: Array
  w_dt: Array
  b_dt: Array
  a: Array
  d: Array
  w_out: Array


def dt_bias_init(dt_min: float, dt_max: float, floor: float = 1e-4) -> nn.initializers.Initializer:
  """softplus^-1 of steps log-uniform in [dt_min, dt_max] (at least `floor`), as in Mamba."""

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    log_dt = jax.random.uniform(key, shape, dtype, math.log(dt_min), math.log(dt_max))
    dt = jnp.maximum(jnp.exp(log_dt), floor)
    return dt + jnp.log(-jnp.expm1(-dt))  # the inverse of softplus

  return init


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
  def _parameters(self, features: int) -> _Params:
    inner, n, dtype = self.expand * features, self.d_state, self.param_dtype
    rank = self.dt_rank or math.ceil(features / 16)
    w_in = self.param("in_proj", common.uniform(features**-0.5), (features, 2 * inner), dtype)
    conv_init = common.uniform(self.d_conv**-0.5)
    conv_kernel = self.param("conv_kernel", conv_init, (self.d_conv, inner), dtype)
    conv_bias = self.param("conv_bias", conv_init, (inner,), dtype)
    w_x = self.param("x_proj", common.uniform(inner**-0.5), (inner, rank + 2 * n), dtype)
    w_dt = self.param("dt_proj", common.uniform(rank**-0.5), (rank, inner), dtype)
    b_dt = self.param("dt_bias", dt_bias_init(self.dt_min, self.dt_max), (inner,), dtype)
    # S4D-Real: A_n = -(n + 1) for every channel.
    a_log = self.param(
        "A_log",
        lambda _, shape, dtype: jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=dtype), shape)),
        (inner, n),
        dtype,
    )
    d = self.param("D", nn.initializers.ones, (inner,), dtype)
    w_out = self.param("out_proj", common.uniform(inner**-0.5), (inner, features), dtype)
    return _Params(w_in, conv_kernel, conv_bias, w_x, w_dt, b_dt, -jnp.exp(a_log), d, w_out)

  def _selective(self, p: _Params, u: Array) -> tuple[Array, Array, Array]:
    """(dt `(..., d_inner)`, B `(..., N)`, C `(..., N)`) from the activated input u."""
    rank = p.w_dt.shape[0]
    dbc = u @ p.w_x
    dt = jax.nn.softplus(dbc[..., :rank] @ p.w_dt + common.leading_ones(p.b_dt, u.ndim))
    return dt, dbc[..., rank : rank + self.d_state], dbc[..., rank + self.d_state :]

  def _gate_and_project(self, p: _Params, y: Array, u: Array, z: Array) -> Array:
    y = y + u * common.leading_ones(p.d, u.ndim)
    return (y * jax.nn.silu(z)) @ p.w_out

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
    zero = self.initialize_state(x.shape[:-2] + x.shape[-1:])
    common.check_initial_state(initial_state, zero)
    p = self._parameters(x.shape[-1])
    xf = x.astype(accumulation_dtype(x.dtype))
    inner = p.d.shape[0]
    v, z = xf @ p.w_in[:, :inner], xf @ p.w_in[:, inner:]
    conv, window = causal_conv(v, p.conv_kernel, p.conv_bias, (initial_state or zero).conv, reset)
    u = jax.nn.silu(conv)
    dt, b, c = self._selective(p, u)
    h0 = None if initial_state is None else initial_state.ssm
    y, last = selective_scan(u, dt, p.a, b, c, h0=h0, reset=reset, mode=mode)
    y = self._gate_and_project(p, y, u, z).astype(x.dtype)
    return (y, MambaState(window, last)) if return_state else y

  def initialize_state(self, input_shape: tuple[int, ...]) -> MambaState:
    """Zero convolution window and SSM state for inputs `(*batch, H)` of one step."""
    batch, inner = tuple(input_shape)[:-1], self.expand * input_shape[-1]
    return MambaState(
        jnp.zeros((*batch, self.d_conv - 1, inner), jnp.float32),
        jnp.zeros((*batch, inner, self.d_state), jnp.float32),
    )

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
    p = self._parameters(x_t.shape[-1])
    conv, ssm = common.clear(state, reset)
    xf = x_t.astype(accumulation_dtype(x_t.dtype))
    inner = p.d.shape[0]
    v, z = xf @ p.w_in[:, :inner], xf @ p.w_in[:, inner:]
    window = jnp.concatenate([conv, v[..., None, :]], axis=-2)
    kernel = common.leading_ones(p.conv_kernel, window.ndim)
    u = jax.nn.silu(jnp.sum(window * kernel, axis=-2) + common.leading_ones(p.conv_bias, v.ndim))
    dt, b, c = self._selective(p, u)
    ssm = jnp.exp(dt[..., None] * common.leading_ones(p.a, dt.ndim + 1)) * ssm + (
        (dt * u)[..., None] * b[..., None, :]
    )
    y = jnp.einsum("...dn,...n->...d", ssm, c)
    return MambaState(window[..., 1:, :], ssm), self._gate_and_project(p, y, u, z).astype(x_t.dtype)
