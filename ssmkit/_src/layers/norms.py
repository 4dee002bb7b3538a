"""The RMS norms inside the layers (Mamba-2's and Gated DeltaNet's output norms)."""

from __future__ import annotations

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


def gated_rms_norm(y: Array, gate: Array, scale: Array, eps: float = EPS, groups: int = 1) -> Array:
  """RMSNorm(y * SiLU(gate)) * scale over the last axis (the gate before the norm, as Mamba-2),
  each of `groups` equal groups of channels normalised on its own."""
  u = y * jax.nn.silu(gate)
  u = u.reshape(*u.shape[:-1], groups, u.shape[-1] // groups)
  u = u * jax.lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + eps)
  return u.reshape(y.shape) * common.leading_ones(scale, y.ndim)
