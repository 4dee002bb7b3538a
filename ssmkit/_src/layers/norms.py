"""The RMS norms inside the layers (Mamba-2's and Gated DeltaNet's output norms), and the one
scaled by 1 + w that Gemma-style models put between their blocks."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common

Array = jax.Array

# The epsilon of the reference modules' RMSNorm.
EPS = 1e-5


def rms_norm(y: Array, scale: Array, eps: float = EPS) -> Array:
  """RMSNorm over the last axis, scaled per channel by `scale` `(y.shape[-1],)`."""
  return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps) * common.leading_ones(
      scale, y.ndim)


def gated_rms_norm(y: Array, gate: Array, scale: Array, eps: float = EPS, groups: int = 1,
                   gate_after: bool = False) -> Array:
  """RMSNorm(y * SiLU(gate)) * scale over the last axis (the gate before the norm, as Mamba-2),
  each of `groups` equal groups of channels normalised on its own; with `gate_after`,
  RMSNorm(y) * scale * SiLU(gate) (Falcon-H1's `mamba_norm_before_gate`)."""
  u = y if gate_after else y * jax.nn.silu(gate)
  u = u.reshape(*u.shape[:-1], groups, u.shape[-1] // groups)
  u = u * jax.lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + eps)
  u = u.reshape(y.shape) * common.leading_ones(scale, y.ndim)
  return u * jax.nn.silu(gate) if gate_after else u


def rms_norm_plus_one(x: Array, weight: Array, eps: float, dtype: Any = None) -> Array:
  """RMSNorm over the last axis scaled by 1 + `weight`, in float32 (or `x`'s wider dtype), cast
  to `dtype` (None: `x`'s), as Gemma's, RecurrentGemma's and Qwen3-Next's norms compute it."""
  wide = jnp.promote_types(x.dtype, jnp.float32)
  y = x.astype(wide)
  y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
  y = y * common.leading_ones(1 + weight.astype(wide), y.ndim)
  return y.astype(x.dtype if dtype is None else dtype)


class RMSNormPlusOne(nn.Module):
  """RMSNorm scaled by 1 + w, w `(features,)` starting at 0 (a norm "rms_plus_one" of a model).

  Attributes:
    epsilon: added to the mean square.
    dtype: the outputs' dtype; None: the inputs'.
    param_dtype: w's dtype.
  """

  epsilon: float = 1e-6
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    weight = self.param("scale", nn.initializers.zeros, (x.shape[-1],), self.param_dtype)
    return rms_norm_plus_one(x, weight, self.epsilon, self.dtype)
