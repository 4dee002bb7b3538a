"""Parameter initialisers that several layers draw from, as `jax.nn.initializers` functions
`init(key, shape, dtype) -> Array`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Initializer = jax.nn.initializers.Initializer


def constant(value: np.ndarray) -> Initializer:
  """An initialiser that returns `value` (a fixed, e.g. HiPPO-derived, start) broadcast to the shape."""

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    del key
    return jnp.broadcast_to(jnp.asarray(value, dtype), shape)

  return init


def uniform(bound: float) -> Initializer:
  """U(-bound, bound): with bound 1 / sqrt(fan_in), PyTorch's default for the papers' layers."""

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def dt_bias_init(dt_min: float, dt_max: float, floor: float = 1e-4) -> Initializer:
  """softplus^-1 of steps log-uniform in [dt_min, dt_max] (at least `floor`): the step bias of
  Mamba, Mamba-2 and Gated DeltaNet."""

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    log_dt = jax.random.uniform(key, shape, dtype, math.log(dt_min), math.log(dt_max))
    dt = jnp.maximum(jnp.exp(log_dt), floor)
    return dt + jnp.log(-jnp.expm1(-dt))  # the inverse of softplus

  return init


def a_log_init(low: float, high: float) -> Initializer:
  """log A for A uniform in (low, high]: the log of one decay rate per head (Mamba-2, Gated
  DeltaNet)."""

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    return jnp.log(high - (high - low) * jax.random.uniform(key, shape, dtype))

  return init


def orthogonal_init(gain: float) -> Initializer:
  """A random orthogonal matrix times `gain`, drawn in float32 whatever the parameters' dtype
  (the QR decomposition has no bfloat16 form)."""

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    return jax.nn.initializers.orthogonal(gain)(key, shape, jnp.float32).astype(dtype)

  return init
