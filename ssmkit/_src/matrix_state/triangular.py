"""Solving (I + L) x = b for strictly lower-triangular L, the delta rule's UT transform.

XLA's triangular solve runs row by row and is slow for the many small systems of a
chunked delta rule (about 300x slower than this on CPU at 64 x 64). Here the inverse
(I + L)^{-1} is formed with matrix products only, its rows taken in blocks of 16: a
block's rows by the product form (I + N)^{-1} = (I - N)(I + N^2)(I + N^4)... of its
nilpotent part N, the blocks below it updated with one product each. Then x is one
product, and so is the derivative, a custom JVP dx = (I + L)^{-1} (db - dL x) whose
transpose JAX derives for the reverse mode: the inverse is formed once for all three.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array
_BLOCK = 16
# The inverse as the derivative names it, for a rematerialisation policy to keep.
INVERSE = "unit_lower_inverse"


def _block_solve(n: Array, b: Array, precision) -> Array:
  """(I + N)^{-1} b for a strictly lower-triangular `(..., c, c)` N, by repeated squaring."""
  x = b - jnp.matmul(n, b, precision=precision)
  power, reach = n, 2
  while reach < n.shape[-1]:
    power = jnp.matmul(power, power, precision=precision)
    x = x + jnp.matmul(power, x, precision=precision)
    reach *= 2
  return x


def _solve(lower: Array, b: Array, precision) -> Array:
  size = lower.shape[-1]
  blocks = []
  for start in range(0, size, _BLOCK):
    stop = min(start + _BLOCK, size)
    rhs = b[..., start:stop, :]
    if blocks:
      done = jnp.concatenate(blocks, axis=-2)
      rhs = rhs - jnp.matmul(lower[..., start:stop, :start], done, precision=precision)
    blocks.append(_block_solve(lower[..., start:stop, start:stop], rhs, precision))
  return jnp.concatenate(blocks, axis=-2)


def _inverse(lower: Array, precision) -> Array:
  eye = jnp.broadcast_to(jnp.eye(lower.shape[-1], dtype=lower.dtype), lower.shape)
  return _solve(lower, eye, precision)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def unit_lower_solve(lower: Array, b: Array, precision=None) -> Array:
  """x with (I + L) x = b, for `lower` L `(..., C, C)` zero on and above the diagonal.

  Args:
    lower: strictly lower-triangular matrices (entries on and above the diagonal must be 0).
    b: `(..., C, R)` right-hand sides.
    precision: matmul precision.
  """
  return jnp.matmul(_inverse(lower, precision), b, precision=precision)


@unit_lower_solve.defjvp
def _unit_lower_solve_jvp(precision, primals, tangents):
  lower, b = primals
  d_lower, d_b = tangents
  inverse = checkpoint_name(_inverse(lower, precision), INVERSE)
  x = jnp.matmul(inverse, b, precision=precision)
  dx = jnp.matmul(inverse, d_b - jnp.matmul(d_lower, x, precision=precision), precision=precision)
  return x, dx
