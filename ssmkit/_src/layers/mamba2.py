"""The Mamba-2 block (Dao & Gu, "Transformers are SSMs: generalized models and efficient
algorithms through structured state space duality", ICML 2024): one scalar decay per head,
so the selective SSM is linear attention with a decay (SSD), computed with matrix products."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ssmkit._src.layers import common, functional
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.layers.convolution import ConvRecurrentState, causal_conv, zero_window
from ssmkit._src.layers.initializers import a_log_init, dt_bias_init, uniform
from ssmkit._src.layers.norms import EPS, gated_rms_norm
from ssmkit._src.matrix_state.linear_attention import linear_attention
from ssmkit._src.modes import Mode

Array = jax.Array

GATE_NORMS = ("norm_gated", "gate_normed", "gate")


def sizes(cfg: Any, features: int) -> tuple[int, int, int]:
  """(inner width, heads, width of B and C together) of a Mamba-2 block over `features`."""
  inner = cfg.expand * features if cfg.num_heads is None else cfg.num_heads * cfg.head_dim
  return inner, inner // cfg.head_dim, 2 * cfg.n_groups * cfg.d_state


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The parameters of a Mamba-2 block over `features` channels, initialised as in the paper's code."""
  for name in ("d_state", "d_conv", "expand", "head_dim", "n_groups"):
    common.check_positive_int(getattr(cfg, name), name)
  if cfg.num_heads is not None:
    common.check_positive_int(cfg.num_heads, "num_heads")
  inner, heads, bc = sizes(cfg, features)
  if inner % cfg.head_dim:
    raise ValueError(f"`head_dim`={cfg.head_dim} must divide the inner width expand * H = {inner}.")
  if heads % cfg.n_groups:
    raise ValueError(f"`n_groups`={cfg.n_groups} must divide the number of heads, {heads}.")
  low, high = cfg.dt_limit
  if not 0 <= low < high:
    raise ValueError(f"`dt_limit` must be (low, high) with 0 <= low < high, got {cfg.dt_limit!r}.")
  if not cfg.norm_eps > 0:
    raise ValueError(f"`norm_eps` must be > 0, got {cfg.norm_eps!r}.")
  common.check_choice(cfg.gate_norm, GATE_NORMS, "gate_norm")
  scales = cfg.in_proj_scales
  if scales is not None and (len(scales) != 5 or not all(
      isinstance(v, int | float) and not isinstance(v, bool) for v in scales)):
    raise ValueError(f"`in_proj_scales` must be five numbers (z, x, B, C, dt) or None, got "
                     f"{scales!r}.")
  conv = inner + bc
  # nn.Linear and nn.Conv1d initialise as U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  return {
      "in_proj": ParamSpec((features, 2 * inner + bc + heads), uniform(features**-0.5)),
      "conv_kernel": ParamSpec((cfg.d_conv, conv), uniform(cfg.d_conv**-0.5)),
      **({"conv_bias": ParamSpec((conv,), uniform(cfg.d_conv**-0.5))} if cfg.use_conv_bias else {}),
      "dt_bias": ParamSpec((heads,), dt_bias_init(cfg.dt_min, cfg.dt_max)),
      "A_log": ParamSpec((heads,), a_log_init(1.0, 16.0)),
      "D": ParamSpec((heads,), nn.initializers.ones),
      **({"norm_scale": ParamSpec((inner,), nn.initializers.ones)} if cfg.gate_norm != "gate"
         else {}),
      "out_proj": ParamSpec((inner, features), uniform(inner**-0.5)),
  }


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> ConvRecurrentState:
  """The zero state for inputs `(*batch, H)`: the window of (x, B, C), and `(*batch, heads, N, P)`."""
  *batch, features = input_shape
  inner, heads, bc = sizes(cfg, features)
  return ConvRecurrentState(
      zero_window(tuple(batch), cfg.d_conv, inner + bc),
      jnp.zeros((*batch, heads, cfg.d_state, cfg.head_dim), jnp.float32),
  )


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: ConvRecurrentState | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, ConvRecurrentState]:
  """The Mamba-2 block over `(..., T, H)` inputs: `(y, state after the last step)`."""
  features = x.shape[-1]
  state = functional.starting_state(initialize_state, cfg, x, initial_state)
  inner, heads, bc = sizes(cfg, features)
  dtype = common.computation_dtype(x.dtype)
  # The projection's order, as in the reference: [z, x, B, C, dt].
  projected = common.project(x, params["in_proj"], dtype)
  if cfg.in_proj_scales is not None:
    widths = (inner, inner, bc // 2, bc // 2, heads)
    scales = jnp.asarray(np.repeat(cfg.in_proj_scales, widths), projected.dtype)
    projected = projected * common.leading_ones(scales, projected.ndim)
  z, xbc, dt = jnp.split(projected, [inner, 2 * inner + bc], axis=-1)
  xbc, window = causal_conv(xbc, params["conv_kernel"], params.get("conv_bias"), state.conv,
                           reset, axis_name)
  u, b, c = jnp.split(jax.nn.silu(xbc), [inner, inner + bc // 2], axis=-1)
  u = u.reshape(*u.shape[:-1], heads, cfg.head_dim)
  # The heads of a group share its B and C (`linear_attention`'s grouped heads).
  groups = lambda m: m.reshape(*m.shape[:-1], cfg.n_groups, cfg.d_state)
  dt = jnp.clip(jax.nn.softplus(dt + common.leading_ones(params["dt_bias"], dt.ndim)), *cfg.dt_limit)
  a = -common.leading_ones(jnp.exp(params["A_log"]), dt.ndim)
  y, ssm = linear_attention(groups(c), groups(b), u * dt[..., None], dt * a,
                            initial_state=state.recurrent, reset=reset, mode=mode,
                            chunk_size=cfg.chunk_size, return_final_state=True,
                            check_log_decay=False, axis_name=axis_name, impl=cfg.impl)
  y = y + u * common.leading_ones(params["D"][:, None], u.ndim)
  y = y.reshape(*y.shape[:-2], inner)
  if cfg.gate_norm == "gate":
    y = y * jax.nn.silu(z)
  else:
    y = gated_rms_norm(y, z, params["norm_scale"], cfg.norm_eps,
                       cfg.n_groups if cfg.norm_per_group else 1,
                       gate_after=cfg.gate_norm == "gate_normed")
  return (common.project(y, params["out_proj"], dtype).astype(x.dtype),
          ConvRecurrentState(window, ssm))


def step(cfg: Any, params: dict[str, Array], state: ConvRecurrentState, x_t: Array,
         reset: Array | None = None) -> tuple[ConvRecurrentState, Array]:
  """One step of the Mamba-2 block on `(*batch, H)` inputs: `(state, y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class Mamba2(functional.LinenLayer):
  """Mamba-2 block: in-projection, causal convolution, SSD over heads, gated RMSNorm, out-projection.

  Inputs `(..., T, H)` give outputs `(..., T, H)`. One projection gives z, x, B, C and dt
  per step; x, B and C (`expand * H`, and `n_groups * d_state` each) pass a short causal
  convolution and SiLU. x is split into heads of `head_dim` channels; per head h, with
  dt_t = softplus(dt_t + dt_bias) and A = -exp(A_log) one number per head:

    S_t = exp(dt_t A) S_{t-1} + B_t^T (dt_t x_t),    y_t = C_t S_t + D x_t,

  a `(d_state, head_dim)` state S, the heads of a group sharing its B and C. This is
  `ssmkit.scan.linear_attention(C, B, x dt, dt A)`: on CPU "auto" computes the values step
  by step and the gradient chunkwise with matrix products (see docs/linear_attention.md),
  "chunked" and "parallel" run the chunkwise algorithm. The output is
  RMSNorm(y * SiLU(z)) scaled per channel (`gate_norm`), projected back to H. `reset` clears the SSM
  state and the convolution window; the state is a `ConvRecurrentState` whose `recurrent`
  part is `(*batch, heads, d_state, head_dim)`.

  Attributes:
    d_state: state size N per head (the size of B and C).
    d_conv: width of the causal convolution.
    use_conv_bias: a bias on the convolution, as `transformers`' `use_conv_bias`.
    expand: inner width = expand * H (unless `num_heads` is set).
    num_heads: the heads; the inner width is then num_heads * head_dim, whatever `expand`
      (Nemotron-H's and Falcon-H1's inner widths are no multiple of H). None: expand * H /
      head_dim.
    head_dim: channels P per head; must divide expand * H (32 divides it for any H that is a
      multiple of 16).
    n_groups: groups of heads that share B and C; must divide the number of heads.
    dt_min: smallest initial step.
    dt_max: largest initial step.
    dt_limit: (low, high): the step size clipped to it after the softplus, in the sequence and
      in `step` alike (`transformers`' `time_step_limit`); the default changes nothing.
    norm_eps: the epsilon of the gated RMSNorm.
    norm_per_group: the gated RMSNorm normalises each of the `n_groups` groups of channels on
      its own (as state-spaces/mamba and `transformers` do); False: the whole inner width at
      once (the same when `n_groups` is 1).
    gate_norm: how z gates the SSM's output y: "norm_gated", RMSNorm(y * SiLU(z)) (Mamba-2);
      "gate_normed", RMSNorm(y) * SiLU(z); "gate", y * SiLU(z) without a norm (the last two
      Falcon-H1's, by `mamba_rms_norm` and `mamba_norm_before_gate`).
    in_proj_scales: factors on the in-projection's five parts (z, x, B, C, dt) after it, or
      None (Falcon-H1's `ssm_multipliers`).
    chunk_size: steps per chunk of the chunkwise algorithm; default `linear_attention`'s.
    impl: what computes the recurrence: "auto", "xla" or "pallas", the Pallas kernels
      (`ssmkit.scan.linear_attention`'s `impl`; "auto" runs the XLA form everywhere today).
    param_dtype: dtype of the parameters.

  References:
    Dao & Gu, "Transformers are SSMs", ICML 2024 (arXiv:2405.21060); the reference module
    `mamba_ssm/modules/mamba2_simple.py` of state-spaces/mamba.
  """

  d_state: int = 64
  d_conv: int = 4
  use_conv_bias: bool = True
  expand: int = 2
  num_heads: int | None = None
  head_dim: int = 32
  n_groups: int = 1
  dt_min: float = 1e-3
  dt_max: float = 1e-1
  dt_limit: tuple[float, float] = (0.0, math.inf)
  norm_eps: float = EPS
  norm_per_group: bool = False
  gate_norm: str = "norm_gated"
  in_proj_scales: tuple[float, float, float, float, float] | None = None
  chunk_size: int | None = None
  impl: str = "auto"
  param_dtype: jnp.dtype = jnp.float32

  # As in the reference: A, D, the step bias and the norm at the base rate without weight decay.
  parameter_groups = common.ParameterGroups(
      no_decay=frozenset({"A_log", "dt_bias", "D", "conv_bias", "norm_scale"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)

