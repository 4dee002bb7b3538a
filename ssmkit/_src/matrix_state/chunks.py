"""Chunk layout and the masks and decays shared by the chunkwise algorithms.

A sequence `(Z, T, H, ...)` is split into n chunks of C steps `(Z, H, n, C, ...)`, the
last one padded with steps that leave the state unchanged (zero keys, values and write
strengths, zero log-decay). Inside a chunk, `reset` flags split the steps into segments:
segment 0 continues the state that enters the chunk, the last segment is what the chunk
leaves. Decays between two steps of a segment are differences of the chunk's cumulative
log-decay b_t = g_0 + ... + g_t, exponentiated only where they are <= 0 (s <= t), so
nothing overflows and no product of decays underflows on the way.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src.matrix_state.inputs import Inputs

Array = jax.Array


class Chunks(NamedTuple):
  """Inputs split into chunks, `(Z, H, n, C, ...)`, or one chunk with n = 1.

  Attributes:
    q, k: `(Z, H, n, C, K)`.
    v: `(Z, H, n, C, V)`.
    log_decay: None, `(Z, H, n, C)` or `(Z, H, n, C, K)`.
    beta: None or `(Z, H, n, C)`.
    reset: None or `(Z, 1, n, C)`.
  """

  q: Array
  k: Array
  v: Array
  log_decay: Array | None
  beta: Array | None
  reset: Array | None


def split(x: Inputs, size: int, group: int | None = None) -> Chunks:
  """Splits `(Z, T, H, ...)` inputs into chunks of `size` steps, zero-padding the last.

  Without `group` the layout is `Chunks`'s, `(Z, H, n, C, ...)`. With `group` G (dividing
  n), groups of G chunks lead, `(n / G, Z, H, G, C, ...)`, for a loop over groups. Either
  takes one transpose of each input.
  """

  def one(a: Array | None) -> Array | None:
    if a is None:
      return None
    length = a.shape[1]
    count = -(-length // size)
    a = jnp.pad(a, [(0, 0), (0, count * size - length)] + [(0, 0)] * (a.ndim - 2))
    if group is None:
      a = a.reshape((a.shape[0], count, size, *a.shape[2:]))  # (Z, n, C, H, ...)
      return a.transpose((0, 3, 1, 2, *range(4, a.ndim)))
    a = a.reshape((a.shape[0], count // group, group, size, *a.shape[2:]))  # (Z, m, G, C, H, ...)
    return a.transpose((1, 0, 4, 2, 3, *range(5, a.ndim)))

  reset = None if x.reset is None else x.reset[:, :, None]  # a unit head axis
  return Chunks(one(x.q), one(x.k), one(x.v), one(x.log_decay), one(x.beta), one(reset))


def merge(out: Array, length: int, grouped: bool = False) -> Array:
  """`(Z, H, n, C, V)` (or grouped `(m, Z, H, G, C, V)`) outputs -> `(Z, T, H, V)`, unpadded."""
  out = out.transpose((1, 0, 3, 4, 2, 5) if grouped else (0, 2, 3, 1, 4))  # (Z, [m,] n, C, H, V)
  return out.reshape((out.shape[0], -1, *out.shape[-2:]))[:, :length]


class Segments(NamedTuple):
  """Where the resets of each chunk split it; masks broadcast against `(Z, H, n, C)`.

  Attributes:
    first: `(Z, 1, n, C)` steps that see the state entering the chunk (no reset at or
      before them), or None without resets.
    last: `(Z, 1, n, C)` steps whose writes reach the state leaving the chunk (no reset
      after them), or None.
    causal: `(1, 1, 1, C, C)`, or `(Z, 1, n, C, C)` with resets: True where step s (last
      axis) reaches step t: s <= t in the same segment.
    strict: `causal` without the diagonal (s < t).
    cut: `(Z, 1, n)` True where a reset cuts the chunk from the state entering it, or None.
  """

  first: Array | None
  last: Array | None
  causal: Array
  strict: Array
  cut: Array | None


def segments(reset: Array | None, size: int) -> Segments:
  """The segments of chunks of `size` steps; `reset` is `(Z, 1, n, C)` or None."""
  lower = jnp.tril(jnp.ones((1, 1, 1, size, size), bool))
  diagonal = jnp.eye(size, dtype=bool)[None, None, None]
  if reset is None:
    return Segments(None, None, lower, lower & ~diagonal, None)
  index = jnp.cumsum(reset, axis=-1, dtype=jnp.int32)
  causal = lower & (index[..., :, None] == index[..., None, :])
  return Segments(index == 0, index == index[..., -1:], causal, causal & ~diagonal,
                  index[..., -1] > 0)


def cumulative(g: Array) -> Array:
  """b_t = g_0 + ... + g_t along the chunk axis 3 of `(Z, H, n, C, ...)`."""
  return jnp.cumsum(g, axis=3)


def pairwise_decay(b: Array, causal: Array) -> Array:
  """exp(b_t - b_s) where `causal`, else 0; `b` `(Z, H, n, C)` -> `(Z, H, n, C, C)`.

  The masked differences are replaced before `exp`, so neither the values nor the
  gradients see the overflowing exp(b_t - b_s) of s > t.
  """
  diff = b[..., :, None] - b[..., None, :]
  return jnp.exp(jnp.where(causal, diff, -jnp.inf))


def masked(x: Array, mask: Array | None) -> Array:
  """`x` `(Z, H, n, C, ...)` set to zero where `mask` `(Z, 1, n, C)` is False (None: kept).

  A selection, not a product, so a NaN in a dropped entry stays out.
  """
  if mask is None:
    return x
  return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)), x, 0)


def poisoned(bad: Array, reset: Array) -> Array:
  """Steps whose state a non-finite input has reached within the chunk.

  `bad` `(Z, H, n, C)` flags steps with a non-finite input; `reset` `(Z, 1, n, C)`. Step t
  is poisoned when some bad step s <= t of the same chunk has no reset in (s, t].
  """
  position = lax.broadcasted_iota(jnp.int32, bad.shape, 3)
  last_bad = lax.cummax(jnp.where(bad, position, -1), axis=3)
  last_reset = lax.cummax(jnp.where(reset, position, -1), axis=3)
  return (last_bad >= 0) & (last_bad >= last_reset)
