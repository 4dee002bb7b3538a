"""The Gated DeltaProduct layer (Siems et al., 2025): Gated DeltaNet with several delta-rule
steps per token, a product of Householder transitions."""

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
from ssmkit._src.matrix_state.delta_product import delta_product
from ssmkit._src.modes import Mode

Array = jax.Array


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The parameters of a Gated DeltaProduct layer over `features` channels."""
  delta_heads.check_heads(cfg, features)
  common.check_positive_int(cfg.num_householder, "num_householder")
  k, v = delta_heads.sizes(cfg, features)
  n, heads, v_heads = cfg.num_householder, cfg.num_heads, delta_heads.value_heads(cfg)
  linear = lambda fan_in, fan_out: ParamSpec((fan_in, fan_out), uniform(fan_in**-0.5))
  conv = lambda width: ParamSpec((cfg.d_conv, width), uniform(cfg.d_conv**-0.5))
  return {
      "q_proj": linear(features, heads * k),
      "k_proj": linear(features, n * heads * k),
      "v_proj": linear(features, n * v_heads * v),
      "q_conv": conv(heads * k),
      "k_conv": conv(n * heads * k),
      "v_conv": conv(n * v_heads * v),
      "b_proj": linear(features, n * v_heads),
      "a_proj": linear(features, v_heads),
      "A_log": ParamSpec((v_heads,), a_log_init(0.0, 16.0)),
      "dt_bias": ParamSpec((v_heads,), dt_bias_init(1e-3, 1e-1)),
      "g_proj": linear(features, v_heads * v),
      "norm_scale": ParamSpec((v,), nn.initializers.ones),
      "o_proj": linear(v_heads * v, features),
  }


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> ConvRecurrentState:
  """The zero state for inputs `(*batch, H)`: the window of q and the n keys and values, and
  `(*batch, value heads, K, V)`."""
  return delta_heads.zero_state(cfg, input_shape, cfg.num_householder)


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: ConvRecurrentState | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, ConvRecurrentState]:
  """Gated DeltaProduct over `(..., T, H)` inputs: `(y, state after the last step)`."""
  state = functional.starting_state(initialize_state, cfg, x, initial_state)
  k_dim, _ = delta_heads.sizes(cfg, x.shape[-1])
  n, heads, v_heads = cfg.num_householder, cfg.num_heads, delta_heads.value_heads(cfg)
  dtype = common.computation_dtype(x.dtype)
  (q, k, v), window = delta_heads.convolved(params, x, ("q", "k", "v"), state.conv, reset, dtype,
                                                axis_name)
  # The n keys, values and strengths of a token are laid out step-major: (n, heads, channels).
  steps = lambda m, count: delta_heads.by_head(delta_heads.by_head(m, n), count)
  shared = lambda m: delta_heads.unit_heads(m, heads, v_heads)
  beta = delta_heads.write_strength(params, x, dtype, cfg.allow_neg_eigval)
  g = delta_heads.head_decay(params, x)
  o, s = delta_product(shared(delta_heads.by_head(q, heads)) * k_dim**-0.5, shared(steps(k, heads)),
                       steps(v, v_heads), delta_heads.by_head(beta, n), g,
                       initial_state=state.recurrent, reset=reset, mode=mode,
                       chunk_size=cfg.chunk_size, return_final_state=True, check_log_decay=False,
                       axis_name=axis_name)
  gate = delta_heads.by_head(common.project(x, params["g_proj"], dtype), v_heads)
  y = delta_heads.gated_output(params, o, gate, cfg.norm_eps, jax.nn.silu, dtype)
  return y.astype(x.dtype), ConvRecurrentState(window, s)


def step(cfg: Any, params: dict[str, Array], state: ConvRecurrentState, x_t: Array,
         reset: Array | None = None) -> tuple[ConvRecurrentState, Array]:
  """One step of Gated DeltaProduct on `(*batch, H)` inputs: `(state, y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class GatedDeltaProduct(functional.LinenLayer):
  """Gated DeltaProduct: Gated DeltaNet with `num_householder` delta-rule steps per token.

  Inputs `(..., T, H)` give outputs `(..., T, H)`. As `GatedDeltaNet`, with n =
  `num_householder` keys, values and write strengths per token: q (`num_heads` heads of
  K = `d_state` channels), n keys and n values (heads of V = `expand_v` * K) are
  projections of the input, each through a short causal convolution and SiLU; q and the
  keys are scaled to unit length and q by K^-1/2; beta_{t,j} = sigmoid(W_beta x_t)_j (times
  2 with `allow_neg_eigval`, so each step may reflect). Per token the state decays once,
  g_t = -exp(A_log) softplus(W_a x_t + dt_bias), then takes the n steps
  S <- (I - beta_{t,j} k_{t,j}^T k_{t,j}) S + beta_{t,j} k_{t,j}^T v_{t,j}, and o_t = q_t S_t
  (`ssmkit.scan.delta_product`). Each head's output is RMS-normalised, scaled, gated by
  SiLU(W_g x_t) and the heads are projected back to H. `reset` clears the matrix state and
  the convolution windows; the state is a `ConvRecurrentState` whose `recurrent` part is
  `(*batch, value heads, K, V)`.

  Attributes:
    num_heads: number of query and key heads.
    num_householder: delta-rule steps per token (1 is Gated DeltaNet with `allow_neg_eigval`).
    d_state: key channels K per head; None: H / num_heads.
    expand_v: V = expand_v * K.
    num_v_heads: heads of v, of the state and of the output, a multiple of `num_heads`;
      None: `num_heads`.
    allow_neg_eigval: beta in (0, 2) (the reference's default) rather than (0, 1).
    norm_eps: the epsilon of the output's per-head RMSNorm.
    d_conv: width of the causal convolutions.
    chunk_size: delta-rule steps per chunk of the chunkwise algorithm; default `delta_rule`'s.
    param_dtype: dtype of the parameters.

  References:
    Siems et al., "DeltaProduct: improving state-tracking in linear RNNs via Householder
    products", 2025 (arXiv:2502.10297); the reference layer `fla/layers/gated_deltaproduct.py`
    of flash-linear-attention.
  """

  num_heads: int = 2
  num_householder: int = 2
  d_state: int | None = None
  expand_v: int = 2
  num_v_heads: int | None = None
  allow_neg_eigval: bool = True
  norm_eps: float = EPS
  d_conv: int = 4
  chunk_size: int | None = None
  param_dtype: jnp.dtype = jnp.float32

  parameter_groups = common.ParameterGroups(no_decay=frozenset({"A_log", "dt_bias", "norm_scale"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)
