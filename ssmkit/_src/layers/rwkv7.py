"""RWKV-7's time mixing ("Goose"): a token shift, low-rank data-dependent gates and the
generalized delta rule, a diagonal-plus-rank-one transition of a matrix state per head."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ssmkit._src.layers import common, delta_heads, functional
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.layers.convolution import ConvRecurrentState, causal_conv, zero_window
from ssmkit._src.layers.initializers import constant, orthogonal_init
from ssmkit._src.linear_recurrence import accumulation_dtype
from ssmkit._src.matrix_state.generalized_delta_rule import generalized_delta_rule
from ssmkit._src.modes import Mode

Array = jax.Array

# The strongest log-decay per step, -exp(-1/2): the reference's w = -exp(-1/2) sigmoid(.).
DECAY_LIMIT = math.exp(-0.5)
# Each token's input mixed with the previous one: into r, w (decay), k, v, a (in-context
# learning rate) and g (output gate).
MIXES = ("r", "w", "k", "v", "a", "g")


def low_rank_sizes(cfg: Any, features: int) -> dict[str, int]:
  """The bottleneck of the decay, in-context learning rate, value residual and gate LoRAs: the
  configured ones, or the reference's defaults (multiples of 32 that grow as sqrt(features))."""
  factor = head_dim(cfg, features) / 64
  default = lambda scale, by_head: max(
      32, round(scale * features**0.5 * (factor if by_head else 1) / 32) * 32)
  return {"w": cfg.decay_low_rank_dim or default(2.5, True),
          "a": cfg.a_low_rank_dim or default(2.5, True),
          "v": cfg.value_low_rank_dim or default(1.7, True),
          "g": cfg.gate_low_rank_dim or default(5.0, False)}


def head_dim(cfg: Any, features: int) -> int:
  """K, the key channels per head: `head_dim`, or 64 (the reference's) and at most H."""
  return min(64, features) if cfg.head_dim is None else cfg.head_dim


def sizes(cfg: Any, features: int) -> tuple[int, int, int]:
  """`(heads, K, V)`: K key channels per head, V value channels per head (the configuration
  checked first)."""
  _check(cfg, features)
  k = head_dim(cfg, features)
  heads = features // k
  return heads, k, (cfg.value_dim or features) // heads


def _check(cfg: Any, features: int) -> None:
  if cfg.head_dim is not None:
    common.check_positive_int(cfg.head_dim, "head_dim")
  k = head_dim(cfg, features)
  if features % k:
    raise ValueError(f"`head_dim`={k} must divide the {features} input channels.")
  heads = features // k
  if cfg.value_dim is not None:
    common.check_positive_int(cfg.value_dim, "value_dim")
    if cfg.value_dim % heads:
      raise ValueError(f"`value_dim`={cfg.value_dim} must be a multiple of the {heads} heads.")
  for name in ("decay_low_rank_dim", "a_low_rank_dim", "value_low_rank_dim", "gate_low_rank_dim"):
    if getattr(cfg, name) is not None:
      common.check_positive_int(getattr(cfg, name), name)
  if not 0 <= cfg.layer_index < cfg.num_layers:
    raise ValueError(
        f"`layer_index` must be in [0, num_layers={cfg.num_layers}), got {cfg.layer_index!r}.")
  if not cfg.norm_eps > 0:
    raise ValueError(f"`norm_eps` must be > 0, got {cfg.norm_eps!r}.")


def _linear(channels: int) -> np.ndarray:
  """-1/2 at the first of `channels`, rising evenly to 1/2 at the last."""
  return np.arange(channels, dtype=np.float64) / max(channels - 1, 1) - 0.5


def _depth_profile(cfg: Any, features: int) -> dict[str, np.ndarray]:
  """The reference's starting values, which depend on the channel and on the layer's depth."""
  n = np.arange(features, dtype=np.float64)
  early = cfg.layer_index / max(cfg.num_layers - 1, 1)  # 0 at the first layer, 1 at the last
  late = 1 - cfg.layer_index / cfg.num_layers  # 1 at the first layer, near 0 at the last
  linear = _linear(features)
  k = head_dim(cfg, features)
  half = (k - 1) / 2
  zigzag = ((n % k) - half) / half if half else np.zeros_like(n)
  zigzag = zigzag * np.abs(zigzag)
  ramp = n / features
  profile = {f"x_{name}": 1 - ramp**(power * late)
             for name, power in zip(MIXES, (0.2, 0.9, 0.7, 0.7, 0.9, 0.2), strict=True)}
  return profile | {
      "k_k": 0.71 - 0.1 * linear,
      "w_bias": -6 + 6 * (n / max(features - 1, 1))**(1 + early**0.3) + 0.5 + 2.5 * zigzag,
      "a_bias": -0.19 + 0.3 * zigzag + 0.4 * linear,
  }


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The parameters of RWKV-7's time mixing over `features` channels, initialised as the
  reference at layer `layer_index` of `num_layers`."""
  heads, k, v = sizes(cfg, features)
  ranks = low_rank_sizes(cfg, features)
  profile = _depth_profile(cfg, features)
  fixed = lambda name: ParamSpec((features,), constant(profile[name]))
  orthogonal = lambda fan_in, fan_out, gain: ParamSpec((fan_in, fan_out), orthogonal_init(gain))

  def lora(name: str, fan_out: int) -> dict[str, ParamSpec]:
    # The reference starts the bottleneck at zero and its way up at a small orthogonal matrix.
    rank = ranks[name]
    gain = 0.1 * (math.sqrt(rank / fan_out) if rank > fan_out else 1.0)
    return {f"{name}_down": ParamSpec((features, rank), nn.initializers.zeros),
            f"{name}_up": orthogonal(rank, fan_out, gain)}

  return {
      **{f"x_{name}": fixed(f"x_{name}") for name in MIXES},
      "r_proj": orthogonal(features, heads * k, 1.0),
      "k_proj": orthogonal(features, heads * k, 0.1),
      "v_proj": orthogonal(features, heads * v, 1.0),
      **lora("w", heads * k), "w_bias": fixed("w_bias"),
      **lora("a", heads * k), "a_bias": fixed("a_bias"),
      **lora("v", heads * v),
      # The value residual's mix starts at 0.63 to 0.72 of the first layer's values.
      "v_bias": ParamSpec((heads * v,), constant(0.73 - 0.4 * _linear(heads * v))),
      **lora("g", heads * v),
      "k_k": fixed("k_k"),
      "k_a": ParamSpec((heads * k,), nn.initializers.constant(1.02)),
      "r_k": ParamSpec((heads, k), nn.initializers.constant(-0.04)),
      "norm_scale": ParamSpec((heads * v,), nn.initializers.constant(
          ((cfg.layer_index + 1) / cfg.num_layers)**0.7)),
      "norm_bias": ParamSpec((heads * v,), nn.initializers.zeros),
      "o_proj": ParamSpec((heads * v, features), nn.initializers.zeros),
  }


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> ConvRecurrentState:
  """The zero state for inputs `(*batch, H)`: the previous input `(*batch, 1, H)` of the token
  shift and the `(*batch, heads, K, V)` matrix state."""
  *batch, features = input_shape
  heads, k, v = sizes(cfg, features)
  return ConvRecurrentState(zero_window(tuple(batch), 2, features),
                            jnp.zeros((*batch, heads, k, v), jnp.float32))


def unit(x: Array) -> Array:
  """`x / max(|x|, 1e-12)` along the last axis (PyTorch's `F.normalize`, as the reference)."""
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-24))


def group_norm(o: Array, scale: Array, bias: Array, eps: float) -> Array:
  """`(..., heads, V)` outputs normalised per head to zero mean and unit variance, then scaled
  and shifted per channel by `scale` and `bias` `(heads * V,)`: `(..., heads * V)`."""
  centred = o - jnp.mean(o, axis=-1, keepdims=True)
  o = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
  o = o.reshape(*o.shape[:-2], o.shape[-2] * o.shape[-1])
  return o * common.leading_ones(scale, o.ndim) + common.leading_ones(bias, o.ndim)


def value_width(cfg: Any, features: int) -> int:
  """The channels of the values RWKV-7 shares across layers: `value_dim`, or H."""
  return cfg.value_dim or features


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: ConvRecurrentState | None = None, axis_name: Hashable | None = None,
             value_residual: functional.ValueResidual
             ) -> tuple[Array, ConvRecurrentState, functional.ValueResidual]:
  """RWKV-7's time mixing over `(..., T, H)` inputs: `(y, state after the last step, value
  residual after the layer)`."""
  state = functional.starting_state(initialize_state, cfg, x, initial_state)
  heads, k_dim, _ = sizes(cfg, x.shape[-1])
  dtype = common.computation_dtype(x.dtype)
  acc = accumulation_dtype(x.dtype)
  shift = jnp.broadcast_to(jnp.asarray([[1.0], [-1.0]], x.dtype), (2, x.shape[-1]))
  delta, window = causal_conv(x, shift, None, state.conv, reset, axis_name)  # x_{t-1} - x_t
  mixed = {name: x + delta * common.leading_ones(params[f"x_{name}"].astype(x.dtype), x.ndim)
           for name in MIXES}
  lora = lambda name, inner: common.project(
      inner(common.project(mixed[name], params[f"{name}_down"], dtype)), params[f"{name}_up"], dtype)
  channel = lambda name: common.leading_ones(params[name].astype(acc), x.ndim)
  r, k, v = (common.project(mixed[name], params[f"{name}_proj"], dtype) for name in "rkv")
  first = jnp.where(value_residual.written, value_residual.values.astype(v.dtype), v)
  v = v + (first - v) * jax.nn.sigmoid(lora("v", lambda h: h) + channel("v_bias"))
  w = -DECAY_LIMIT * jax.nn.sigmoid(lora("w", jnp.tanh) + channel("w_bias"))
  a = jax.nn.sigmoid(lora("a", lambda h: h) + channel("a_bias"))
  g = lora("g", jax.nn.sigmoid)
  kk = unit(delta_heads.by_head(k * channel("k_k"), heads))
  k = k * (1 + (a - 1) * channel("k_a"))
  r, k, a, w = (delta_heads.by_head(m, heads) for m in (r, k, a, w))
  v = delta_heads.by_head(v, heads)
  o, s = generalized_delta_rule(r, k, v, -kk, kk * a, w, initial_state=state.recurrent, reset=reset,
                                mode=mode, chunk_size=cfg.chunk_size, return_final_state=True,
                                check_log_decay=False, axis_name=axis_name)
  o = group_norm(o, params["norm_scale"].astype(acc), params["norm_bias"].astype(acc),
                 k_dim * cfg.norm_eps)
  # The bonus: the current token's value, weighted by its own receptance-key match.
  bonus = jnp.sum(r * k * common.leading_ones(params["r_k"].astype(acc), r.ndim), axis=-1,
                  keepdims=True) * v
  y = common.project((o + bonus.reshape(o.shape)) * g, params["o_proj"], dtype)
  return y.astype(x.dtype), ConvRecurrentState(window, s), value_residual.passed(first)


def step(cfg: Any, params: dict[str, Array], state: ConvRecurrentState, x_t: Array,
         reset: Array | None, value_residual: functional.ValueResidual
         ) -> tuple[ConvRecurrentState, Array, functional.ValueResidual]:
  """One step of RWKV-7's time mixing on `(*batch, H)` inputs: `(state, y_t, value residual)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset, value_residual)


class RWKV7(functional.LinenLayer):
  """RWKV-7's time mixing: the generalized delta rule behind a token shift and low-rank gates.

  Inputs `(..., T, H)` give outputs `(..., T, H)`, over H / K heads of K = `head_dim` key
  channels and V = `value_dim` / heads value channels. Each input is mixed
  with the previous one, x^m_t = x_t + mu_m (x_{t-1} - x_t) for m in r, w, k, v, a, g, and:

    r_t = W_r x^r_t,  k_t = W_k x^k_t,  v_t = W_v x^v_t,
    w_t = -exp(-1/2) sigmoid(W_w2 tanh(W_w1 x^w_t) + b_w)  (the log-decay, per key channel),
    a_t = sigmoid(W_a2 W_a1 x^a_t + b_a),  g_t = W_g2 sigmoid(W_g1 x^g_t),
    kk_t = unit(k_t * k_k) per head,  k_t <- k_t (1 + (a_t - 1) k_a),
    S_t = (diag(exp(w_t)) - (kk_t * a_t)^T kk_t) S_{t-1} + k_t^T v_t,  o_t = r_t S_t,

  `ssmkit.scan.generalized_delta_rule` with a = -kk and b = kk * a (every mode exact).
  Each head's output goes through a GroupNorm (epsilon `head_dim` * `norm_eps`), gains the
  bonus (sum(r_t * k_t * r_k)) v_t, is gated by g_t and projected back to H. `reset`
  clears the matrix state and the token shift; the state is a `ConvRecurrentState` whose
  `conv` part is the previous input `(*batch, 1, H)` and whose `recurrent` part is
  `(*batch, heads, K, V)`.

  The value residual: in a model, the values v^1 of the first RWKV7 layer pass to every later
  one (a `ValueResidual`, which `SequenceModel` threads through its blocks), and each mixes
  them into its own,

    v_t <- v_t + (v^1_t - v_t) sigmoid(W_v2 W_v1 x^v_t + b_v),

  before the state update and the bonus. The first layer keeps its own values (its v LoRA
  changes nothing there, so every layer has the same parameters and `scan_blocks` stacks
  them); a layer called on its own is a model's first.

  Attributes:
    head_dim: key channels K per head; H must be a multiple. None: 64 (the reference's), or
      H for narrower inputs.
    value_dim: value channels over all heads; None: H.
    decay_low_rank_dim, a_low_rank_dim, value_low_rank_dim, gate_low_rank_dim: the
      bottlenecks of the decay, of a, of the value residual's mix and of the gate; None: the
      reference's defaults (32 and up, growing as sqrt(H)).
    layer_index, num_layers: the layer's place in its model, which sets its starting
      parameters as the reference's (they change nothing else); `SequenceModel` sets them
      to the block's place where the factory leaves them out.
    norm_eps: the GroupNorm's epsilon per key channel.
    chunk_size: steps per chunk of the chunkwise algorithm; default 32.
    param_dtype: dtype of the parameters.

  References:
    Peng et al., "RWKV-7 'Goose' with expressive dynamic state evolution", 2025
    (arXiv:2503.14456); the reference layer `fla/layers/rwkv7.py` of flash-linear-attention.
  """

  head_dim: int | None = None
  value_dim: int | None = None
  decay_low_rank_dim: int | None = None
  a_low_rank_dim: int | None = None
  value_low_rank_dim: int | None = None
  gate_low_rank_dim: int | None = None
  layer_index: int = 0
  num_layers: int = 1
  norm_eps: float = 1e-5
  chunk_size: int | None = None
  param_dtype: jnp.dtype = jnp.float32

  parameter_groups = common.ParameterGroups(no_decay=frozenset(
      {*(f"x_{name}" for name in MIXES), "w_bias", "a_bias", "v_bias", "k_k", "k_a", "r_k", "norm_scale",
       "norm_bias"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state, value_width=value_width)
