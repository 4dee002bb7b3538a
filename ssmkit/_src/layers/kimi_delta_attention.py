"""The Kimi Delta Attention layer (KDA, Kimi Linear): Gated DeltaNet with one decay per key
channel, computed chunkwise with matrix products."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common, delta_heads, functional
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.layers.convolution import ConvRecurrentState
from ssmkit._src.layers.initializers import a_log_init, dt_bias_init, uniform
from ssmkit._src.layers.norms import EPS
from ssmkit._src.linear_recurrence import accumulation_dtype
from ssmkit._src.matrix_state.delta_rule import delta_rule
from ssmkit._src.modes import Mode

Array = jax.Array


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The parameters of a KDA layer over `features` channels, initialised as the reference."""
  delta_heads.check_heads(cfg, features)
  if cfg.lower_bound is not None and not cfg.lower_bound < 0:
    raise ValueError(f"`lower_bound` must be None or < 0, got {cfg.lower_bound!r}.")
  k, v = delta_heads.sizes(cfg, features)
  heads, v_heads = cfg.num_heads, delta_heads.value_heads(cfg)
  linear = lambda fan_in, fan_out: ParamSpec((fan_in, fan_out), uniform(fan_in**-0.5))
  conv = lambda width: ParamSpec((cfg.d_conv, width), uniform(cfg.d_conv**-0.5))
  return {
      "q_proj": linear(features, heads * k),
      "k_proj": linear(features, heads * k),
      "v_proj": linear(features, v_heads * v),
      "q_conv": conv(heads * k),
      "k_conv": conv(heads * k),
      "v_conv": conv(v_heads * v),
      # The decay and the output gate go through a bottleneck of V channels.
      "f_down": linear(features, v),
      "f_up": linear(v, v_heads * k),
      "b_proj": linear(features, v_heads),
      "A_log": ParamSpec((v_heads,), nn.initializers.zeros if cfg.lower_bound is not None
                         else a_log_init(1.0, 16.0)),
      "dt_bias": ParamSpec((v_heads * k,), dt_bias_init(1e-3, 1e-1)),
      "g_down": linear(features, v),
      "g_up": linear(v, v_heads * v),
      **({"g_bias": ParamSpec((v_heads * v,), uniform(v**-0.5))} if cfg.gate_bias else {}),
      "norm_scale": ParamSpec((v,), nn.initializers.ones),
      "o_proj": linear(v_heads * v, features),
  }


def log_decay(cfg: Any, params: dict[str, Array], x: Array) -> Array:
  """g `(..., T, value heads, K)` of inputs `(..., T, H)`, in the accumulation dtype:
  -exp(A_log) softplus(f + dt_bias), or lower_bound sigmoid(exp(A_log) (f + dt_bias))."""
  xf = x.astype(accumulation_dtype(x.dtype))
  v_heads = delta_heads.value_heads(cfg)
  f = delta_heads.by_head(xf @ params["f_down"] @ params["f_up"]
                          + common.leading_ones(params["dt_bias"], xf.ndim), v_heads)
  rate = common.leading_ones(jnp.exp(params["A_log"]), xf.ndim)[..., None]
  if cfg.lower_bound is None:
    return -rate * jax.nn.softplus(f)
  return cfg.lower_bound * jax.nn.sigmoid(rate * f)


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: ConvRecurrentState | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, ConvRecurrentState]:
  """KDA over `(..., T, H)` inputs: `(y, state after the last step)`."""
  state = functional.starting_state(delta_heads.zero_state, cfg, x, initial_state)
  k_dim, _ = delta_heads.sizes(cfg, x.shape[-1])
  heads, v_heads = cfg.num_heads, delta_heads.value_heads(cfg)
  dtype = common.computation_dtype(x.dtype)
  (q, k, v), window = delta_heads.convolved(params, x, ("q", "k", "v"), state.conv, reset, dtype,
                                                axis_name)
  q, k = (delta_heads.unit(delta_heads.by_head(m, heads)) for m in (q, k))
  beta = delta_heads.write_strength(params, x, dtype, cfg.allow_neg_eigval)
  o, s = delta_rule(q * k_dim**-0.5, k, delta_heads.by_head(v, v_heads), beta,
                    log_decay(cfg, params, x), initial_state=state.recurrent, reset=reset,
                    mode=mode, chunk_size=cfg.chunk_size, return_final_state=True,
                    check_log_decay=False, axis_name=axis_name, impl=cfg.impl)
  gate = common.project(common.project(x, params["g_down"], dtype), params["g_up"], dtype)
  if "g_bias" in params:
    gate = gate + common.leading_ones(params["g_bias"], gate.ndim)
  gate = delta_heads.by_head(gate, v_heads)
  y = delta_heads.gated_output(params, o, gate, cfg.norm_eps, jax.nn.sigmoid, dtype)
  return y.astype(x.dtype), ConvRecurrentState(window, s)


def step(cfg: Any, params: dict[str, Array], state: ConvRecurrentState, x_t: Array,
         reset: Array | None = None) -> tuple[ConvRecurrentState, Array]:
  """One step of KDA on `(*batch, H)` inputs: `(state, y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class KimiDeltaAttention(functional.LinenLayer):
  """Kimi Delta Attention: the gated delta rule with one decay per key channel (Kimi Linear).

  Inputs `(..., T, H)` give outputs `(..., T, H)`. As `GatedDeltaNet`: q, k (`num_heads`
  heads of K = `d_state` channels) and v (heads of V = `expand_v` * K) are projections of
  the input, each through a short causal convolution and SiLU; q and k are scaled to unit
  length and q by K^-1/2; beta_t = sigmoid(W_beta x_t) (times 2 with `allow_neg_eigval`).
  The decay has one value per key channel, from a bottleneck of V channels:
  g_t = -exp(A_log) softplus(W_up W_down x_t + dt_bias) (or, with `lower_bound`,
  lower_bound sigmoid(exp(A_log) (W_up W_down x_t + dt_bias)), within (lower_bound, 0)):

    S_t = (I - beta_t k_t^T k_t) diag(exp(g_t)) S_{t-1} + beta_t k_t^T v_t,    o_t = q_t S_t,

  `ssmkit.scan.delta_rule` with a per-key `log_decay` (exact however strong the decay, in
  every mode). Each head's output is RMS-normalised, scaled, gated by
  sigmoid(W_up' W_down' x_t + b) (b with `gate_bias`) and the heads are projected back to H.
  `reset` clears the matrix state and the convolution windows; the state is a
  `ConvRecurrentState` whose `recurrent` part is `(*batch, value heads, K, V)`.

  Attributes:
    num_heads: number of query and key heads.
    d_state: key channels K per head; None: H / num_heads.
    expand_v: V = expand_v * K (the reference's default is 1).
    num_v_heads: heads of v, of the state and of the output, a multiple of `num_heads`;
      None: `num_heads`.
    allow_neg_eigval: beta in (0, 2): the transition may reflect.
    lower_bound: None, or a bound < 0 of each log-decay (the reference's `safe_gate` runs
      with -5); A_log then starts at 0.
    norm_eps: the epsilon of the output's per-head RMSNorm.
    gate_bias: a bias b in the output gate (flash-linear-attention's; Kimi Linear's
      checkpoints have none).
    d_conv: width of the causal convolutions.
    chunk_size: steps per chunk of the chunkwise algorithm; default 32.
    impl: what computes the recurrence: "auto", "xla" or "pallas", the Pallas kernels
      (`ssmkit.scan.delta_rule`'s `impl`; "auto" runs the XLA form everywhere today).
    param_dtype: dtype of the parameters.

  References:
    Kimi Team, "Kimi Linear: an expressive, efficient attention architecture", 2025
    (arXiv:2510.26692); the reference layer `fla/layers/kda.py` of flash-linear-attention.
  """

  num_heads: int = 2
  d_state: int | None = None
  expand_v: int = 1
  num_v_heads: int | None = None
  allow_neg_eigval: bool = False
  lower_bound: float | None = None
  norm_eps: float = EPS
  gate_bias: bool = True
  d_conv: int = 4
  chunk_size: int | None = None
  impl: str = "auto"
  param_dtype: jnp.dtype = jnp.float32

  parameter_groups = common.ParameterGroups(no_decay=frozenset({"A_log", "dt_bias", "norm_scale"}))
  maths = functional.Maths(param_specs, sequence, step, delta_heads.zero_state)
