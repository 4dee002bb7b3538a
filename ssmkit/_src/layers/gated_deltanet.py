"""The Gated DeltaNet layer (Yang, Kautz & Hatamizadeh, "Gated delta networks: improving Mamba2
with delta rule", ICLR 2025): a matrix state per head that decays as Mamba-2's and is written
with the delta rule, computed chunkwise with matrix products."""

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
from ssmkit._src.matrix_state.delta_rule import delta_rule
from ssmkit._src.modes import Mode

Array = jax.Array


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The parameters of a Gated DeltaNet layer over `features` channels, initialised as the reference."""
  delta_heads.check_heads(cfg, features)
  k, v = delta_heads.sizes(cfg, features)
  heads, v_heads = cfg.num_heads, delta_heads.value_heads(cfg)
  linear = lambda fan_in, fan_out: ParamSpec((fan_in, fan_out), uniform(fan_in**-0.5))
  conv = lambda width: ParamSpec((cfg.d_conv, width), uniform(cfg.d_conv**-0.5))
  return {
      "q_proj": linear(features, heads * k),
      "k_proj": linear(features, heads * k),
      "v_proj": linear(features, v_heads * v),
      "a_proj": linear(features, v_heads),
      "b_proj": linear(features, v_heads),
      "g_proj": linear(features, v_heads * v),
      "q_conv": conv(heads * k),
      "k_conv": conv(heads * k),
      "v_conv": conv(v_heads * v),
      "A_log": ParamSpec((v_heads,), a_log_init(0.0, 16.0)),
      "dt_bias": ParamSpec((v_heads,), dt_bias_init(1e-3, 1e-1)),
      "norm_scale": ParamSpec((v,), nn.initializers.ones),
      "o_proj": linear(v_heads * v, features),
  }


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: ConvRecurrentState | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, ConvRecurrentState]:
  """Gated DeltaNet over `(..., T, H)` inputs: `(y, state after the last step)`."""
  state = functional.starting_state(delta_heads.zero_state, cfg, x, initial_state)
  k_dim, _ = delta_heads.sizes(cfg, x.shape[-1])
  heads, v_heads = cfg.num_heads, delta_heads.value_heads(cfg)
  dtype = common.computation_dtype(x.dtype)
  (q, k, v), window = delta_heads.convolved(params, x, ("q", "k", "v"), state.conv, reset, dtype,
                                                axis_name)
  # Each group of num_v_heads / num_heads value heads reads one query and key head, normalised
  # once (`delta_rule`'s grouped heads).
  q, k = (delta_heads.unit(delta_heads.by_head(m, heads)) for m in (q, k))
  beta = delta_heads.write_strength(params, x, dtype, cfg.allow_neg_eigval)
  g = delta_heads.head_decay(params, x)
  o, s = delta_rule(q * k_dim**-0.5, k, delta_heads.by_head(v, v_heads), beta, g,
                    initial_state=state.recurrent, reset=reset, mode=mode,
                    chunk_size=cfg.chunk_size, return_final_state=True, check_log_decay=False,
                    axis_name=axis_name, impl=cfg.impl)
  # The output gate after a per-head RMSNorm.
  gate = delta_heads.by_head(common.project(x, params["g_proj"], dtype), v_heads)
  y = delta_heads.gated_output(params, o, gate, cfg.norm_eps, jax.nn.silu, dtype)
  return y.astype(x.dtype), ConvRecurrentState(window, s)


def step(cfg: Any, params: dict[str, Array], state: ConvRecurrentState, x_t: Array,
         reset: Array | None = None) -> tuple[ConvRecurrentState, Array]:
  """One step of Gated DeltaNet on `(*batch, H)` inputs: `(state, y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class GatedDeltaNet(functional.LinenLayer):
  """Gated DeltaNet: q, k, v with short convolutions, the gated delta rule per head, gated RMSNorm.

  Inputs `(..., T, H)` give outputs `(..., T, H)`. q, k (`num_heads` heads of K = `d_state`
  channels) and v (heads of V = `expand_v` * K) are projections of the input, each through
  a short causal convolution and SiLU; q and k are scaled to unit length and q by K^-1/2.
  Per step and head, beta_t = sigmoid(W_beta x_t) (twice that with `allow_neg_eigval`) and
  the decay as in Mamba-2,
  g_t = -exp(A_log) softplus(W_a x_t + dt_bias):

    S_t = exp(g_t) (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,    o_t = q_t S_t,

  `ssmkit.scan.delta_rule` (every mode: "auto" computes values step by step and gradients
  chunkwise on CPU, "chunked" and "parallel" run the chunkwise algorithm). Each head's
  output is RMS-normalised, scaled, gated by SiLU(W_g x_t) and the heads are projected back
  to H. `reset` clears the matrix state and the convolution windows; the state is a
  `ConvRecurrentState` whose `recurrent` part is `(*batch, value heads, K, V)`.

  Attributes:
    num_heads: number of heads.
    d_state: key channels K per head (the state is K x V per head); None: H / num_heads,
      so q and k have H channels and v 2H, as the reference allocates them without a gate.
    expand_v: V = expand_v * K.
    num_v_heads: heads of v, of the state and of the output, a multiple of `num_heads` (as
      Qwen3-Next and flash-linear-attention's `num_v_heads`): each group of
      num_v_heads / num_heads of them reads one query and key head; None: `num_heads`.
    norm_eps: the epsilon of the output's per-head RMSNorm (Qwen3-Next: 1e-6).
    allow_neg_eigval: beta in (0, 2) rather than (0, 1), so a step's transition may reflect
      (a negative eigenvalue; Grazzi et al. 2025, OLMo Hybrid's `linear_allow_neg_eigval`).
    d_conv: width of the causal convolutions.
    chunk_size: steps per chunk of the chunkwise algorithm; default `delta_rule`'s.
    impl: what computes the recurrence: "auto", "xla" or "pallas", the Pallas kernels
      (`ssmkit.scan.delta_rule`'s `impl`; "auto" runs the XLA form everywhere today).
    param_dtype: dtype of the parameters.

  References:
    Yang, Kautz & Hatamizadeh, "Gated delta networks: improving Mamba2 with delta rule",
    ICLR 2025 (arXiv:2412.06464); the reference layer `fla/layers/gated_deltanet.py` of
    flash-linear-attention.
  """

  num_heads: int = 2
  d_state: int | None = None
  expand_v: int = 2
  num_v_heads: int | None = None
  norm_eps: float = EPS
  allow_neg_eigval: bool = False
  d_conv: int = 4
  chunk_size: int | None = None
  impl: str = "auto"
  param_dtype: jnp.dtype = jnp.float32

  # As in the reference: the decay's parameters and the norm without weight decay.
  parameter_groups = common.ParameterGroups(no_decay=frozenset({"A_log", "dt_bias", "norm_scale"}))
  maths = functional.Maths(param_specs, sequence, step, delta_heads.zero_state)
