"""The Mamba block (Gu & Dao, "Mamba: Linear-time sequence modeling with selective state
spaces", 2023): a selective SSM (S6) whose step, B and C depend on the input, behind a
short causal convolution and a SiLU gate."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common, functional
from ssmkit._src.layers.convolution import ConvRecurrentState, causal_conv, zero_window
from ssmkit._src.layers.initializers import dt_bias_init, uniform
from ssmkit._src.modes import Mode
from ssmkit._src.selective_scan import selective_scan

Array = jax.Array


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
    in_proj `(H, 2 D)` for D = expand * H; conv_kernel `(d_conv, D)`; conv_bias `(D,)` (with
    `use_conv_bias`); x_proj `(D, R + 2 N)` for the step rank R; dt_proj `(R, D)`; dt_bias `(D,)`; A_log
    `(D, N)`; D `(D,)`; out_proj `(D, H)`; with `use_bias`, in_proj_bias `(2 D,)` and
    out_proj_bias `(H,)`.
  """
  for name in ("d_state", "d_conv", "expand"):
    common.check_positive_int(getattr(cfg, name), name)
  if cfg.dt_rank is not None:
    common.check_positive_int(cfg.dt_rank, "dt_rank")
  if cfg.selective_norm_eps is not None and not cfg.selective_norm_eps > 0:
    raise ValueError(f"`selective_norm_eps` must be > 0 or None, got {cfg.selective_norm_eps!r}.")
  if cfg.selective_norm_scale and cfg.selective_norm_eps is None:
    raise ValueError("`selective_norm_scale` scales the selective norms: it needs "
                     "`selective_norm_eps`.")
  if not 0 < cfg.dt_min <= cfg.dt_max:
    raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={cfg.dt_min}, dt_max={cfg.dt_max}.")
  inner, n, rank = cfg.expand * features, cfg.d_state, cfg.dt_rank or math.ceil(features / 16)
  return {
      "in_proj": common.ParamSpec((features, 2 * inner), uniform(features**-0.5)),
      "conv_kernel": common.ParamSpec((cfg.d_conv, inner), uniform(cfg.d_conv**-0.5)),
      **({"conv_bias": common.ParamSpec((inner,), uniform(cfg.d_conv**-0.5))}
         if cfg.use_conv_bias else {}),
      "x_proj": common.ParamSpec((inner, rank + 2 * n), uniform(inner**-0.5)),
      "dt_proj": common.ParamSpec((rank, inner), uniform(rank**-0.5)),
      "dt_bias": common.ParamSpec((inner,), dt_bias_init(cfg.dt_min, cfg.dt_max)),
      "A_log": common.ParamSpec((inner, n), _a_log_init),
      "D": common.ParamSpec((inner,), nn.initializers.ones),
      "out_proj": common.ParamSpec((inner, features), uniform(inner**-0.5)),
      **({"in_proj_bias": common.ParamSpec((2 * inner,), nn.initializers.zeros),
          "out_proj_bias": common.ParamSpec((features,), nn.initializers.zeros)}
         if cfg.use_bias else {}),
      **({f"{name}_norm_scale": common.ParamSpec((width,), nn.initializers.ones)
          for name, width in (("dt", rank), ("b", n), ("c", n))}
         if cfg.selective_norm_scale else {}),
  }


def _project(params: dict[str, Array], x: Array) -> tuple[Array, Array]:
  """The in-projection's two halves: the SSM branch v and the gate z, `(..., d_inner)` each,
  computed in `x`'s `computation_dtype`."""
  inner = params["D"].shape[0]
  w_in = params["in_proj"]
  dtype = common.computation_dtype(x.dtype)
  v, z = common.project(x, w_in[:, :inner], dtype), common.project(x, w_in[:, inner:], dtype)
  if "in_proj_bias" in params:
    bias = common.leading_ones(params["in_proj_bias"], v.ndim)
    v, z = v + bias[..., :inner], z + bias[..., inner:]
  return v, z


def _selective(cfg: Any, params: dict[str, Array], u: Array, dtype: Any
               ) -> tuple[Array, Array, Array]:
  """(dt `(..., d_inner)`, B `(..., N)`, C `(..., N)`) from the activated input u; the
  x-projection in `dtype`, the step size's own projection in u's."""
  rank = params["dt_proj"].shape[0]
  dbc = common.project(u, params["x_proj"], dtype)
  parts = dbc[..., :rank], dbc[..., rank : rank + cfg.d_state], dbc[..., rank + cfg.d_state :]
  if cfg.selective_norm_eps is not None:
    eps = cfg.selective_norm_eps
    parts = tuple(part * jax.lax.rsqrt(jnp.mean(part * part, axis=-1, keepdims=True) + eps)
                  for part in parts)
  if cfg.selective_norm_scale:
    parts = tuple(part * common.leading_ones(params[f"{name}_norm_scale"], part.ndim)
                  for part, name in zip(parts, ("dt", "b", "c"), strict=True))
  step_rank, b, c = parts
  dt = jax.nn.softplus(step_rank @ params["dt_proj"] + common.leading_ones(params["dt_bias"], u.ndim))
  return dt, b, c


def _gate_and_project(params: dict[str, Array], y: Array, u: Array, z: Array, dtype: Any) -> Array:
  y = y + u * common.leading_ones(params["D"], u.ndim)
  y = common.project(y * jax.nn.silu(z), params["out_proj"], dtype)
  return y + common.leading_ones(params["out_proj_bias"], y.ndim) if "out_proj_bias" in params else y


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: ConvRecurrentState | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, ConvRecurrentState]:
  """The Mamba block over `(..., T, H)` inputs: `(y, state after the last step)`."""
  state = functional.starting_state(initialize_state, cfg, x, initial_state)
  v, z = _project(params, x)
  conv, window = causal_conv(v, params["conv_kernel"], params.get("conv_bias"), state.conv,
                             reset, axis_name)
  u = jax.nn.silu(conv)
  dtype = common.computation_dtype(x.dtype)
  dt, b, c = _selective(cfg, params, u, dtype)
  y, last = selective_scan(u, dt, -jnp.exp(params["A_log"]), b, c, h0=state.recurrent, reset=reset,
                           mode=mode, axis_name=axis_name)
  return _gate_and_project(params, y, u, z, dtype).astype(x.dtype), ConvRecurrentState(window, last)


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> ConvRecurrentState:
  """The zero state for inputs `(*batch, H)`: the window of `d_inner` channels, and
  `(*batch, d_inner, d_state)`."""
  *batch, features = input_shape
  inner = cfg.expand * features
  return ConvRecurrentState(zero_window(tuple(batch), cfg.d_conv, inner),
                            jnp.zeros((*batch, inner, cfg.d_state), jnp.float32))


def step(cfg: Any, params: dict[str, Array], state: ConvRecurrentState, x_t: Array,
         reset: Array | None = None) -> tuple[ConvRecurrentState, Array]:
  """One step of the Mamba block on `(*batch, H)` inputs: `(state, y_t)`."""
  conv, ssm = common.clear(state, reset)
  v, z = _project(params, x_t)
  dtype = common.computation_dtype(x_t.dtype)
  window = jnp.concatenate([conv, v[..., None, :]], axis=-2)
  kernel = common.leading_ones(params["conv_kernel"], window.ndim)
  conv = jnp.sum(window * kernel, axis=-2)
  if "conv_bias" in params:
    conv = conv + common.leading_ones(params["conv_bias"], v.ndim)
  u = jax.nn.silu(conv)
  dt, b, c = _selective(cfg, params, u, dtype)
  a = -jnp.exp(params["A_log"])
  ssm = jnp.exp(dt[..., None] * common.leading_ones(a, dt.ndim + 1)) * ssm + (
      (dt * u)[..., None] * b[..., None, :]
  )
  y = jnp.einsum("...dn,...n->...d", ssm, c)
  y = _gate_and_project(params, y, u, z, dtype).astype(x_t.dtype)
  return ConvRecurrentState(window[..., 1:, :], ssm), y


class Mamba(functional.LinenLayer):
  """Mamba block: in-projection, causal depthwise convolution, S6 scan, SiLU gate, out-projection.

  Inputs `(..., T, H)` give outputs `(..., T, H)`. Per step t, with u_t the convolved and
  SiLU-activated input (`d_inner` channels): dt_t = softplus(W_dt W_x u_t + b), B_t and C_t
  are linear in u_t, h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t (ZOH for A, Euler for B, as
  the paper's code), y_t = C_t h_t + D u_t, gated by SiLU(z_t). The scan computes C_t h_t
  inside the recurrence and its gradient recomputes the states chunk by chunk, so the
  `(..., T, d_inner, N)` states are never all stored; `reset` clears both the SSM state and
  the convolution window. The state is a `ConvRecurrentState` whose `recurrent` part is
  `(*batch, d_inner, d_state)`.

  Modes of the selective scan: "sequential" runs one loop over time that contracts the
  state with C inside each step, its gradient replaying one chunk of about sqrt(T) steps at
  a time (the fastest on CPU); "chunked" runs each chunk's `(L, ..., d_inner, N)`
  recurrence in the parallel mode of `ssmkit.scan.linear_recurrence` and carries the state
  from chunk to chunk; "parallel" does so over the whole sequence at once (T states in
  memory); "auto" is "sequential" on CPU and for T <= 64, else "chunked".

  Attributes:
    d_state: SSM state size N per channel.
    d_conv: width of the causal convolution.
    expand: d_inner = expand * H.
    dt_rank: rank of the step projection; default ceil(H / 16).
    dt_min: smallest initial step.
    dt_max: largest initial step.
    use_bias: biases on the in- and out-projections (zero at first), as `transformers`'
      `use_bias` (published Mamba checkpoints have none).
    use_conv_bias: a bias on the convolution, as `transformers`' `use_conv_bias`.
    selective_norm_eps: RMS-normalise the step size's low-rank input, B and C (without a
      scale) with this epsilon before use, as Falcon-Mamba does (its `mixer_rms_eps`); None:
      Mamba's block, which does not.
    selective_norm_scale: those norms have learned scales (`dt_norm_scale`, `b_norm_scale`,
      `c_norm_scale`, from 1), as Jamba's do.
    param_dtype: dtype of the parameters.

  References:
    Gu & Dao, "Mamba: linear-time sequence modeling with selective state spaces", 2023
    (arXiv:2312.00752); `mamba_ssm/modules/mamba_simple.py` of state-spaces/mamba.
  """

  d_state: int = 16
  d_conv: int = 4
  expand: int = 2
  dt_rank: int | None = None
  dt_min: float = 1e-3
  dt_max: float = 1e-1
  use_bias: bool = False
  use_conv_bias: bool = True
  selective_norm_eps: float | None = None
  selective_norm_scale: bool = False
  param_dtype: jnp.dtype = jnp.float32

  # As in the Mamba code: A, D and the biases at the base learning rate without weight decay.
  parameter_groups = common.ParameterGroups(no_decay=frozenset(
      {"A_log", "dt_bias", "D", "conv_bias", "in_proj_bias", "out_proj_bias"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)
