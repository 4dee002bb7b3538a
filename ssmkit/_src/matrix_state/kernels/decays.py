"""Decayed products inside a chunk, as a kernel computes them: one decay per head or per key.

Both classes give, for rows x_t, y_s of a chunk and b_t its cumulative log-decays
(`segments.cumulative`),

  scores(x, y)_ts = sum_d x_td y_sd e^{b_td - b_sd}   for s <= t (s < t if `strict`) of one segment,

and the transpose of that map (`grads`), together with the factors every chunk's maths uses:
`entering` e^{b_t} for the steps that read the entering state, `to_end` e^{b_C - b_s} for the
steps the leaving state keeps, `through` e^{b_C} for the entering state kept to the end.

With one decay per head the decay factors out of the sum, a `(C, C)` matrix. With one per key
channel it does not, and e^{b_t} x_t, e^{-b_s} y_s overflow over a chunk that decays strongly:
the chunk is taken in blocks of at most 16 rows, the steps before block i scored by one product
of factors e^{b_t - e_i} and e^{e_i - b_s} (e_i the cumulative decay entering block i, both
<= 1) and the pairs inside a block one by one, as flash-linear-attention's GLA kernels do. Rows
of a block are taken from whole-chunk values by products with a selection matrix, which a
kernel computes where it cannot slice a value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src.matrix_state.kernels import segments
from ssmkit._src.matrix_state.kernels.segments import HIGHEST

Array = jax.Array
F32 = jnp.float32

# Rows of a block of a chunk with one decay per key channel.
KEY_BLOCK = 16


def dot(a: Array, b: Array, precision=None) -> Array:
  return jnp.dot(a, b, precision=precision, preferred_element_type=F32)


def dot_nt(a: Array, b: Array, precision=None) -> Array:
  """a b^T."""
  return dot(a, b.T, precision)


def dot_tn(a: Array, b: Array, precision=None) -> Array:
  """a^T b."""
  return dot(a.T, b, precision)


def block_rows(size: int) -> int:
  """Rows per block of a chunk of `size` steps: the largest divisor of it up to `KEY_BLOCK`."""
  return max(d for d in range(1, min(size, KEY_BLOCK) + 1) if size % d == 0)


class _Chunk:
  """What both decay kinds share: segments, cumulative decays and the state's factors."""

  def __init__(self, g: Array, reset: Array):
    self.seg, last, carried = segments.whole(reset)
    self.size = reset.shape[0]
    self.b = segments.cumulative(g, self.seg.causal)
    end = segments.pick(self.b, self.size - 1)
    per_key = g.ndim == 2
    self.entering = jnp.where(self.seg.first[:, None], jnp.exp(self.b if per_key
                                                               else self.b[:, None]), 0.0)
    self.through = jnp.where(carried, jnp.exp(end), 0.0)
    if per_key:
      self.through = self.through[:, None]
      self.to_end = segments.decay(end[None, :] - self.b, last[:, None])
    else:
      self.to_end = segments.decay(end - self.b, last)[:, None]

  def decay_gradient(self, db: Array) -> Array:
    """dg from the gradient `db` `(C, K)` of the cumulative decays (summed over keys for one
    decay per head)."""
    if self.b.ndim == 1:
      db = jnp.sum(db, axis=1)
    return segments.reverse_cumulative(db, self.seg.causal)


class HeadDecay(_Chunk):
  """One decay per head: `g` `(C,)`."""

  def __init__(self, g: Array, reset: Array):
    super().__init__(g, reset)
    strict = self.seg.causal & ~jnp.eye(self.size, dtype=bool)
    diff = self.b[:, None] - self.b[None, :]
    self._decays = (segments.decay(diff, self.seg.causal), segments.decay(diff, strict))

  def scores(self, x: Array, y: Array, precision, strict: bool = False) -> Array:
    return dot_nt(x, y, precision) * self._decays[strict]

  def grads(self, m: Array, x: Array, y: Array, precision,
            strict: bool = False) -> tuple[Array, Array]:
    """The cotangents of x and y from `m`, that of `scores(x, y)`."""
    m = m * self._decays[strict]
    return dot(m, y, precision), dot_tn(m, x, precision)


class _KeyBlock:
  """Block i of a chunk with one decay per key channel: the selection `pick` `(c, C)` of its
  rows, their factors against the steps before it (`x_scale` `(c, K)`, `y_scale` `(C, K)`)
  and its own pairs' decays (`inside`: `(c, c, K)` for s <= t, and for s < t)."""

  def __init__(self, chunk: _Chunk, reset: Array, i: int, sub: int):
    size, start = chunk.size, i * sub
    t = lax.broadcasted_iota(jnp.int32, (sub, size), 0) + start
    self.pick = (t == lax.broadcasted_iota(jnp.int32, (sub, size), 1)).astype(F32)
    seg = segments.rows(reset, start, sub)
    b_i = dot(self.pick, chunk.b, HIGHEST)
    e = segments.pick(chunk.b, start - 1)  # (K,): 0 for block 0, which has no steps before it
    into = segments.pick(chunk.seg.index, start - 1)  # the segment continuing into the block
    self.x_scale = segments.decay(b_i - e[None, :], (seg.index == into)[:, None])
    s = lax.broadcasted_iota(jnp.int32, (size, 1), 0)
    self.y_scale = segments.decay(e[None, :] - chunk.b,
                                  (s < start) & (chunk.seg.index == into)[:, None])
    t_local = lax.broadcasted_iota(jnp.int32, (sub, sub), 0)
    s_local = lax.broadcasted_iota(jnp.int32, (sub, sub), 1)
    same = seg.index[:, None] == seg.index[None, :]
    diff = b_i[:, None, :] - b_i[None, :, :]
    self.inside = (segments.decay(diff, ((s_local <= t_local) & same)[:, :, None]),
                   segments.decay(diff, ((s_local < t_local) & same)[:, :, None]))

  def rows(self, x: Array) -> Array:
    return dot(self.pick, x, HIGHEST)


class KeyDecay(_Chunk):
  """One decay per key channel: `g` `(C, K)`."""

  def __init__(self, g: Array, reset: Array):
    super().__init__(g, reset)
    sub = block_rows(self.size)
    self._blocks = [_KeyBlock(self, reset, i, sub) for i in range(self.size // sub)]

  def scores(self, x: Array, y: Array, precision, strict: bool = False) -> Array:
    out = 0.0
    for block in self._blocks:
      x_i, y_i = block.rows(x), block.rows(y)
      between = dot_nt(x_i * block.x_scale, y * block.y_scale, precision)  # (c, C)
      within = jnp.sum(x_i[:, None, :] * y_i[None, :, :] * block.inside[strict], axis=2)
      out = out + dot_tn(block.pick, between + dot(within, block.pick, HIGHEST), HIGHEST)
    return out

  def grads(self, m: Array, x: Array, y: Array, precision,
            strict: bool = False) -> tuple[Array, Array]:
    """The cotangents of x and y from `m`, that of `scores(x, y)`."""
    dx, dy = 0.0, 0.0
    for block in self._blocks:
      x_i, y_i, m_i = block.rows(x), block.rows(y), block.rows(m)  # m_i (c, C)
      m_within = dot_nt(m_i, block.pick, HIGHEST)[:, :, None] * block.inside[strict]  # (c, c, K)
      dx_i = (block.x_scale * dot(m_i, y * block.y_scale, precision)
              + jnp.sum(m_within * y_i[None, :, :], axis=1))
      dy_i = jnp.sum(m_within * x_i[:, None, :], axis=0)
      dx = dx + dot_tn(block.pick, dx_i, HIGHEST)
      dy = dy + block.y_scale * dot_tn(m_i, x_i * block.x_scale, precision) + dot_tn(
          block.pick, dy_i, HIGHEST)
    return dx, dy


def of(g: Array, reset: Array) -> HeadDecay | KeyDecay:
  """The chunk's decays: `g` `(C,)` one per head, `(C, K)` one per key channel."""
  return HeadDecay(g, reset) if g.ndim == 1 else KeyDecay(g, reset)
