"""What the delta-rule layers (Gated DeltaNet, KDA, Gated DeltaProduct) share: their head sizes
and checks, the zero state, convolved q, k, v projections, unit-length queries and keys
shared over groups of value heads, Mamba-2's per-head decay, and the gated per-head norm of
the outputs."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ssmkit._src.layers import common
from ssmkit._src.layers.convolution import ConvRecurrentState, causal_conv, zero_window
from ssmkit._src.layers.norms import rms_norm
from ssmkit._src.linear_recurrence import accumulation_dtype

Array = jax.Array

# Added to the squared norm of q and k before the square root, as flash-linear-attention's l2norm.
L2_EPS = 1e-6


def sizes(cfg: Any, features: int) -> tuple[int, int]:
  """(K, V): key channels per head (`d_state`, or H / num_heads) and V = expand_v * K."""
  k = features // cfg.num_heads if cfg.d_state is None else cfg.d_state
  return k, cfg.expand_v * k


def value_heads(cfg: Any) -> int:
  """The heads of v, of the state and of the output: `num_v_heads`, or `num_heads`."""
  return cfg.num_heads if cfg.num_v_heads is None else cfg.num_v_heads


def check_heads(cfg: Any, features: int) -> None:
  """Refuses head counts and sizes that do not fit `features` input channels, naming them."""
  for name in ("num_heads", "expand_v", "d_conv"):
    common.check_positive_int(getattr(cfg, name), name)
  if cfg.d_state is None:
    if features % cfg.num_heads:
      raise ValueError(f"`num_heads`={cfg.num_heads} must divide the input width {features} when "
                       "`d_state` is None.")
  else:
    common.check_positive_int(cfg.d_state, "d_state")
  if cfg.num_v_heads is not None:
    common.check_positive_int(cfg.num_v_heads, "num_v_heads")
    if cfg.num_v_heads % cfg.num_heads:
      raise ValueError(f"`num_v_heads`={cfg.num_v_heads} must be a multiple of `num_heads`="
                       f"{cfg.num_heads}.")
  if not cfg.norm_eps > 0:
    raise ValueError(f"`norm_eps` must be > 0, got {cfg.norm_eps!r}.")


def zero_state(cfg: Any, input_shape: tuple[int, ...], steps: int = 1) -> ConvRecurrentState:
  """The zero state for inputs `(*batch, H)`: the convolution window of q and of `steps` keys
  and values per token, and the `(*batch, value heads, K, V)` matrix state."""
  *batch, features = input_shape
  k, v = sizes(cfg, features)
  heads, v_heads = cfg.num_heads, value_heads(cfg)
  width = heads * k + steps * (heads * k + v_heads * v)
  return ConvRecurrentState(zero_window(tuple(batch), cfg.d_conv, width),
                            jnp.zeros((*batch, v_heads, k, v), jnp.float32))


def head_decay(params: dict[str, Array], x: Array) -> Array:
  """Mamba-2's decay, one per value head: -exp(A_log) softplus(W_a x + dt_bias) for inputs
  `(..., T, H)`, in the accumulation dtype."""
  xf = x.astype(accumulation_dtype(x.dtype))
  step_size = jax.nn.softplus(xf @ params["a_proj"] + common.leading_ones(params["dt_bias"], xf.ndim))
  return -common.leading_ones(jnp.exp(params["A_log"]), xf.ndim) * step_size


def by_head(m: Array, count: int) -> Array:
  """`(..., count * D)` -> `(..., count, D)`."""
  return m.reshape(*m.shape[:-1], count, m.shape[-1] // count)


def unit(x: Array) -> Array:
  """`x` scaled to unit length along its last axis."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def convolved(params: dict[str, Array], x: Array, names: Sequence[str], window: Array,
              reset: Array | None, dtype, axis_name: Hashable | None = None
              ) -> tuple[list[Array], Array]:
  """SiLU of the projections `params[name + "_proj"]` of `x`, each through its short causal
  convolution `params[name + "_conv"]` (one convolution over all of them side by side), across
  the devices of the mesh axis `axis_name` as `causal_conv` describes.

  Returns:
    The convolved projections in the order of `names`, and the convolution's new window.
  """
  projected = [common.project(x, params[f"{name}_proj"], dtype) for name in names]
  kernel = jnp.concatenate([params[f"{name}_conv"] for name in names], axis=-1)
  out, window = causal_conv(jnp.concatenate(projected, axis=-1), kernel, None, window, reset,
                            axis_name)
  edges = np.cumsum([p.shape[-1] for p in projected])[:-1]
  return jnp.split(jax.nn.silu(out), edges, axis=-1), window


def unit_heads(m: Array, heads: int, value_heads: int) -> Array:
  """`(..., heads, K)` query or key heads scaled to unit length, then repeated for their groups
  of value heads, each group of value_heads / heads reading one, as flash-linear-attention's
  `repeat('... h d -> ... (h g) d')`: normalised once per head."""
  return jnp.repeat(unit(m), value_heads // heads, axis=-2)


def write_strength(params: dict[str, Array], x: Array, dtype, reflect: bool = False) -> Array:
  """beta = sigmoid(W_beta x) in (0, 1), or 2 sigmoid(W_beta x) in (0, 2) with `reflect` (the
  delta rule's transition may then reflect: negative eigenvalues)."""
  beta = jax.nn.sigmoid(common.project(x, params["b_proj"], dtype))
  return 2 * beta if reflect else beta


def gated_output(params: dict[str, Array], o: Array, gate: Array, eps: float,
                 activation: Callable[[Array], Array], dtype) -> Array:
  """`(..., heads, V)` outputs RMS-normalised per head, scaled by `norm_scale`, gated by
  `activation(gate)` and projected by `o_proj`."""
  o = rms_norm(o, params["norm_scale"], eps) * activation(gate)
  return common.project(o.reshape(*o.shape[:-2], o.shape[-2] * o.shape[-1]), params["o_proj"], dtype)
