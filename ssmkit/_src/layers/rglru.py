"""The Real-Gated Linear Recurrent Unit inside Griffin's recurrent block (De et al., "Griffin:
mixing gated linear recurrences with local attention for efficient language models", 2024)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.engine import axis_position
from ssmkit._src.layers import common, functional
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.layers.convolution import causal_conv, zero_window
from ssmkit._src.linear_recurrence import linear_recurrence
from ssmkit._src.modes import Mode

Array = jax.Array

# The recurrence gate's exponent scale c in a_t = a^(c r_t).
C = 8.0
# sqrt's derivative is capped at this value (near a = 1 it grows without bound).
MAX_SQRT_GRADIENT = 1000.0


class RGLRUState(NamedTuple):
  """The state of `RGLRU`.

  Attributes:
    conv: `(*batch, d_conv - 1, d_state)` float32, the convolution's last inputs.
    recurrent: `(*batch, d_state)` float32, the RG-LRU's state.
    started: `(*batch,)` bool, False until a step has been taken: as in recurrentgemma,
      the first step of a sequence is a reset (it takes its input without the
      sqrt(1 - a^2) factor), so a sequence from `initialize_state` starts with one.
  """

  conv: Array
  recurrent: Array
  started: Array


def ring_init(r_min: float, r_max: float) -> nn.initializers.Initializer:
  """softplus^-1(-log a) for a uniform on the ring r_min <= |a| <= r_max (a^2 uniform)."""

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    u = jax.random.uniform(key, shape, dtype)
    neg_log_a = -0.5 * jnp.log(u * (r_max**2 - r_min**2) + r_min**2)
    return neg_log_a + jnp.log(-jnp.expm1(-neg_log_a))  # the inverse of softplus

  return init


@jax.custom_jvp
def bounded_sqrt(x: Array) -> Array:
  """sqrt(x), with the derivative capped at `MAX_SQRT_GRADIENT` as the reference does."""
  return jnp.sqrt(x)


@bounded_sqrt.defjvp
def _bounded_sqrt_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  floor = 1 / (4 * MAX_SQRT_GRADIENT**2)
  return jnp.sqrt(x), dx * 0.5 * jax.lax.rsqrt(jnp.maximum(x, floor))


def _width(cfg: Any, features: int) -> int:
  return features if cfg.d_state is None else cfg.d_state


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The parameters of Griffin's recurrent block over `features` channels, as recurrentgemma's."""
  for name in ("num_heads", "d_conv"):
    common.check_positive_int(getattr(cfg, name), name)
  if cfg.d_state is not None:
    common.check_positive_int(cfg.d_state, "d_state")
  width = _width(cfg, features)
  if width % cfg.num_heads:
    raise ValueError(f"`num_heads`={cfg.num_heads} must divide the recurrence width {width}.")
  if not 0 < cfg.r_min <= cfg.r_max < 1:
    raise ValueError(f"need 0 < r_min <= r_max < 1, got r_min={cfg.r_min}, r_max={cfg.r_max}.")
  block = width // cfg.num_heads
  lecun = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
  zeros = nn.initializers.zeros
  gate = ParamSpec((cfg.num_heads, block, block), lecun)
  return {
      "y_proj": ParamSpec((features, width), lecun),
      "y_bias": ParamSpec((width,), zeros),
      "x_proj": ParamSpec((features, width), lecun),
      "x_bias": ParamSpec((width,), zeros),
      "conv_kernel": ParamSpec((cfg.d_conv, width), nn.initializers.variance_scaling(0.01, "fan_in",
                                                                                     "normal")),
      "conv_bias": ParamSpec((width,), zeros),
      "input_gate": gate,
      "input_gate_bias": ParamSpec((cfg.num_heads, block), zeros),
      "a_gate": gate,
      "a_gate_bias": ParamSpec((cfg.num_heads, block), zeros),
      "a_param": ParamSpec((width,), ring_init(cfg.r_min, cfg.r_max)),
      "out_proj": ParamSpec((width, features), lecun),
      "out_bias": ParamSpec((features,), zeros),
  }


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> RGLRUState:
  """The state before a sequence's first step, for inputs `(*batch, H)`."""
  *batch, features = input_shape
  width = _width(cfg, features)
  return RGLRUState(zero_window(tuple(batch), cfg.d_conv, width),
                    jnp.zeros((*batch, width), jnp.float32), jnp.zeros(tuple(batch), bool))


def _block_diagonal(x: Array, w: Array, b: Array) -> Array:
  """x W + b with W block-diagonal: `(..., heads * block)` inputs, `(heads, block, block)` blocks."""
  heads, block = b.shape
  y = jnp.einsum("...hi,hij->...hj", x.reshape(*x.shape[:-1], heads, block), w)
  y = y + common.leading_ones(b, y.ndim)
  return y.reshape(x.shape)


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: RGLRUState | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, RGLRUState]:
  """Griffin's recurrent block over `(..., T, H)` inputs: `(y, state after the last step)`."""
  state = functional.starting_state(initialize_state, cfg, x, initial_state)
  length = x.shape[-2]
  position = jax.lax.broadcasted_iota(jnp.int32, (*state.started.shape, length), state.started.ndim)
  if axis_name is not None:  # the step numbers of the whole sequence
    index, _ = axis_position(axis_name)
    position = position + index * length
  first = (position == 0) & ~state.started[..., None]  # a sequence's first step
  reset = first if reset is None else reset | first

  dtype = common.computation_dtype(x.dtype)

  def dense(v: Array, name: str) -> Array:
    return (common.project(v, params[f"{name}_proj"], dtype)
            + common.leading_ones(params[f"{name}_bias"], v.ndim))

  gate_branch = jax.nn.gelu(dense(x, "y"))
  u, window = causal_conv(dense(x, "x"), params["conv_kernel"], params["conv_bias"], state.conv, reset,
                          axis_name)
  gate_x = jax.nn.sigmoid(_block_diagonal(u, params["input_gate"], params["input_gate_bias"]))
  gate_a = jax.nn.sigmoid(_block_diagonal(u, params["a_gate"], params["a_gate_bias"]))
  log_a = -C * gate_a * common.leading_ones(jax.nn.softplus(params["a_param"]), u.ndim)
  # sqrt(1 - a^2) with 1 - a^2 = -expm1(2 log a), exact even for a near 1. As in the
  # reference, the first step of an episode takes its input whole.
  norm = bounded_sqrt(-jnp.expm1(2 * log_a))
  if reset is not None:
    norm = jnp.where(reset[..., None], jnp.ones_like(norm), norm)
  h, last = linear_recurrence(jnp.exp(log_a), u * gate_x * norm, state.recurrent, reset=reset, axis=-2,
                              mode=mode, return_final_state=True, axis_name=axis_name)
  y = dense(h * gate_branch, "out")
  return y.astype(x.dtype), RGLRUState(window, last, state.started | (length > 0))


def step(cfg: Any, params: dict[str, Array], state: RGLRUState, x_t: Array,
         reset: Array | None = None) -> tuple[RGLRUState, Array]:
  """One step of Griffin's recurrent block on `(*batch, H)` inputs: `(state, y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class RGLRU(functional.LinenLayer):
  """Griffin's recurrent block around the RG-LRU: a GeLU gate branch times a convolved, gated
  linear recurrence, projected back.

  Inputs `(..., T, H)` give outputs `(..., T, H)`. Two linear branches of `d_state` channels:
  the gate g_t = GeLU(W_y x_t + b_y), and u_t, the short causal convolution of W_x x_t + b_x.
  The RG-LRU on u_t, with block-diagonal gates (`num_heads` blocks)
  r_t = sigmoid(W_a u_t + b_a), i_t = sigmoid(W_i u_t + b_i), a_t = a^(c r_t) (c = 8,
  a = sigmoid(-a_param) per channel, so log a_t = -c r_t softplus(a_param)):

    h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * u_t),

  runs through `ssmkit.scan.linear_recurrence` in the given mode. The output is
  W_out (h_t * g_t) + b_out. As in recurrentgemma, the step a reset flags takes its input
  without the sqrt(1 - a_t^2) factor, and the factor's derivative is capped at 1000. `reset`
  clears the recurrence and the convolution window. The state is an `RGLRUState`; the first
  step of a sequence from no state (or from `initialize_state`) is a reset, as in
  recurrentgemma, so a left-padded sequence with a reset at its first real step gives the
  unpadded outputs.

  Attributes:
    d_state: width of the recurrence (recurrentgemma's `lru_width`); None: H.
    num_heads: diagonal blocks of the gates; must divide `d_state`.
    d_conv: width of the causal convolution.
    r_min: smallest initial |a|.
    r_max: largest initial |a| (< 1).
    param_dtype: dtype of the parameters.

  References:
    De et al., "Griffin: mixing gated linear recurrences with local attention for efficient
    language models", 2024 (arXiv:2402.19427); `recurrentgemma/jax/layers.py` and
    `modules.py` of google-deepmind/recurrentgemma.
  """

  d_state: int | None = None
  num_heads: int = 1
  d_conv: int = 4
  r_min: float = 0.9
  r_max: float = 0.999
  param_dtype: jnp.dtype = jnp.float32

  # The recurrence's parameter and the biases without weight decay.
  parameter_groups = common.ParameterGroups(no_decay=frozenset(
      {"a_param", "x_bias", "y_bias", "conv_bias", "input_gate_bias", "a_gate_bias", "out_bias"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)

