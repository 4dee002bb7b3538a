"""What a kernel computes about one chunk before its products: segments and cumulative decays.

Inside a chunk of C steps, `reset` flags split the steps into segments (as `chunks.Segments`
does for the XLA forms): segment 0 continues the state that enters the chunk, the last one is
what the chunk leaves. Everything here is computed from whole-chunk values with iotas,
selections, reductions and products (no cumulative sums, gathers or value slices), so that a
kernel body lowers to Triton as well as it runs in Pallas' interpret mode.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

HIGHEST = lax.Precision.HIGHEST


class Rows(NamedTuple):
  """The segments of some rows t of a chunk, against all its steps s.

  Attributes:
    index: `(R,)` float32, how many resets the chunk has at or before each row.
    causal: `(R, C)` bool, s <= t in t's segment.
    first: `(R,)` bool, the rows that read the state entering the chunk.
  """

  index: Array
  causal: Array
  first: Array


def rows(reset: Array, start: int, count: int) -> Rows:
  """The segments of rows `start` ... `start + count - 1` of a chunk with `reset` `(C,)` float32
  flags (1.0 where the state is cleared before the step)."""
  size = reset.shape[0]
  t = lax.broadcasted_iota(jnp.int32, (count, size), 0) + start
  s = lax.broadcasted_iota(jnp.int32, (count, size), 1)
  every = lax.broadcasted_iota(jnp.int32, (size, size), 0) >= lax.broadcasted_iota(
      jnp.int32, (size, size), 1)
  index_all = jnp.sum(jnp.where(every, reset[None, :], 0.0), axis=1)  # (C,)
  index = jnp.sum(jnp.where(s <= t, reset[None, :], 0.0), axis=1)  # (R,)
  causal = (s <= t) & (index[:, None] == index_all[None, :])
  return Rows(index, causal, index == 0)


def whole(reset: Array) -> tuple[Rows, Array, Array]:
  """The segments of every step of a chunk, the `(C,)` bool steps the leaving state keeps (the
  last segment) and whether the entering state reaches the chunk's end (no reset), `()`."""
  seg = rows(reset, 0, reset.shape[0])
  end = jnp.sum(reset)
  return seg, seg.index == end, end == 0


def pick(x: Array, row) -> Array:
  """Row `row` of `x` `(C, ...)` by a masked sum (0 for a row outside the chunk)."""
  at = lax.broadcasted_iota(jnp.int32, x.shape, 0) == row
  return jnp.sum(jnp.where(at, x, 0), axis=0)


def cumulative(g: Array, causal: Array) -> Array:
  """b_t = g_r + ... + g_t over t's segment (r its first step): `causal` `(R, C)`, `g` `(C,)`
  or `(C, K)` -> `(R,)` or `(R, K)`."""
  if g.ndim == 1:
    return jnp.sum(jnp.where(causal, g[None, :], 0.0), axis=1)
  return jnp.dot(causal.astype(g.dtype), g, precision=HIGHEST)


def reverse_cumulative(db: Array, causal: Array) -> Array:
  """The transpose of `cumulative`: dg_s = sum of db_t over the t >= s of s's segment."""
  if db.ndim == 1:
    return jnp.sum(jnp.where(causal, db[:, None], 0.0), axis=0)
  return jnp.dot(causal.astype(db.dtype).T, db, precision=HIGHEST)


def decay(diff: Array, mask: Array) -> Array:
  """exp(diff) where `mask`, else 0, selected before `exp` so that nothing overflows."""
  return jnp.exp(jnp.where(mask, diff, -jnp.inf))
