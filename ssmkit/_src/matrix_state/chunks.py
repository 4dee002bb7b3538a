"""Chunk layout and the masks and decays shared by the chunkwise algorithms.

A sequence `(Z, T, H, ...)` is split into n chunks of C steps `(Z, H, n, C, ...)`, the
last one padded with steps that leave the state unchanged (zero keys, values and write
strengths, zero log-decay). Inside a chunk, `reset` flags split the steps into segments:
segment 0 continues the state that enters the chunk, the last segment is what the chunk
leaves. Decays between two steps of a segment are differences of the segment's cumulative
log-decay b_t = g_r + ... + g_t (r its first step), exponentiated only where they are <= 0
(s <= t), so nothing overflows and no product of decays underflows on the way. The sums
restart at each reset, so a segment's decays, and every output and state after a reset,
are the same to the last bit whatever came before it.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    a, b: None or `(Z, H, n, C, K)`.
  """

  q: Array
  k: Array
  v: Array
  log_decay: Array | None
  beta: Array | None
  reset: Array | None
  a: Array | None = None
  b: Array | None = None


def pad(x: Inputs, size: int) -> Inputs:
  """`x` with time zero-padded to whole chunks of `size` steps (a no-op if it has them).

  The padding steps leave the state unchanged: zero keys, values, write strengths, read
  and write vectors and log-decays, no reset.
  """
  extra = -x.q.shape[1] % size
  if extra == 0:
    return x
  grow = lambda a: None if a is None else jnp.pad(
      a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2))
  return x._replace(q=grow(x.q), k=grow(x.k), v=grow(x.v), log_decay=grow(x.log_decay),
                    beta=grow(x.beta), a=grow(x.a), b=grow(x.b), reset=grow(x.reset))


def split(x: Inputs, size: int, start=0, length: int | None = None, groups: int = 1) -> Chunks:
  """Chunks of `size` steps of the `length` steps of `x` from `start`, `(Z, H, n, C, ...)`.

  `length` (default: all of `x`'s steps) must be a multiple of `size` that fits in `x`
  (`pad`); `start` may be traced, so a loop can take one window of chunks per iteration
  without moving the whole sequence into the chunk layout first. With `groups` G, the heads
  are split into G groups moved to the batch axis, `(Z G, H / G, n, C, ...)` (`head_groups`).
  """
  length = x.q.shape[1] if length is None else length

  def one(a: Array | None, groups: int = groups) -> Array | None:
    if a is None:
      return None
    a = lax.dynamic_slice_in_dim(a, start, length, axis=1)
    z, heads, rest = a.shape[0], a.shape[2], a.shape[3:]
    # (Z, n, C, G, H / G, ...) -> (Z, G, H / G, n, C, ...)
    a = a.reshape((z, length // size, size, groups, heads // groups, *rest))
    a = a.transpose((0, 3, 4, 1, 2, *range(5, a.ndim)))
    return a.reshape((z * groups, heads // groups, length // size, size, *rest))

  reset = None if x.reset is None else jnp.repeat(one(x.reset[:, :, None], 1), groups, axis=0)
  return Chunks(one(x.q), one(x.k), one(x.v), one(x.log_decay), one(x.beta), reset, one(x.a),
                one(x.b))


def merge(out: Array, groups: int = 1) -> Array:
  """`(Z G, H / G, n, C, V)` outputs -> `(Z, n * C, H, V)` (`split`'s layout with `groups`)."""
  rows, heads, n, size, dim = out.shape
  out = out.reshape((rows // groups, groups, heads, n, size, dim))
  out = out.transpose((0, 3, 4, 1, 2, 5))  # (Z, n, C, G, H / G, V)
  return out.reshape((rows // groups, n * size, groups * heads, dim))


def head_groups(batch: int, heads: int) -> int:
  """How many groups of heads the chunk layout moves to its batch axis: with one batch row,
  the smallest G >= 2 that leaves at least two heads per group, else 1.

  XLA's CPU gradients ran slowly with a unit axis in the chunk layout: at B=1 T=4096 H=4
  K=V=64, two groups took 20-37% less time, side by side (linear attention 14.8 against
  23.4 ms, KDA 44.6 against 60.0 ms).
  """
  if batch > 1:
    return 1
  return next((g for g in range(2, heads // 2 + 1) if heads % g == 0), 1)


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
    index: `(Z, 1, n, C)` each step's segment (the resets at or before it), or None.
  """

  first: Array | None
  last: Array | None
  causal: Array
  strict: Array
  cut: Array | None
  index: Array | None


def segments(reset: Array | None, size: int) -> Segments:
  """The segments of chunks of `size` steps; `reset` is `(Z, 1, n, C)` or None."""
  lower = jnp.tril(jnp.ones((1, 1, 1, size, size), bool))
  diagonal = jnp.eye(size, dtype=bool)[None, None, None]
  if reset is None:
    return Segments(None, None, lower, lower & ~diagonal, None, None)
  index = jnp.cumsum(reset, axis=-1, dtype=jnp.int32)
  causal = lower & (index[..., :, None] == index[..., None, :])
  return Segments(index == 0, index == index[..., -1:], causal, causal & ~diagonal,
                  index[..., -1] > 0, index)


def cumulative(g: Array, seg: Segments, behind: bool = False) -> Array:
  """b_t = g_r + ... + g_t along the chunk axis 3 of `(Z, H, n, C, ...)`, from the first step
  r of t's segment (`seg`): the sums restart at each reset. With `behind`, b_{t-1}, up to the
  step before t (0 at a segment's first step), summed as such: b_t - g_t would carry the
  rounding of a large |g_t|.

  One product with the segments' lower-triangular mask of ones, in full precision: XLA's CPU
  cumulative sum (a windowed reduction) took a twentieth of KDA's gradient at B=2 T=4096 H=4
  K=V=64. The mask's zeros meet the steps of other segments, whose terms add exact zeros, so
  no rounding of an earlier segment reaches a later one. Per key, the triangle is batched over
  the chunks so that the sums come out in their layout: a product over the free axes put C
  last and cost a transpose (KDA's gradient: 178-181 ms against 190-199 ms).
  """
  if seg.index is None:
    ones = jnp.tril(jnp.ones((g.shape[3],) * 2, g.dtype), -1 if behind else 0)
    if g.ndim == 4:  # (Z, H, n, C): the rows times the triangle's transpose
      return jnp.einsum("zhns,ts->zhnt", g, ones, precision=lax.Precision.HIGHEST)
    ones = jnp.broadcast_to(ones, (*g.shape[:3], *ones.shape))
  else:
    mask = seg.strict if behind else seg.causal
    ones = jnp.broadcast_to(mask.astype(g.dtype), (*g.shape[:3], *mask.shape[-2:]))
    if g.ndim == 4:
      return jnp.einsum("zhnts,zhns->zhnt", ones, g, precision=lax.Precision.HIGHEST)
  return jnp.matmul(ones, g, precision=lax.Precision.HIGHEST)


def _sums_between(g: Array, steps: Array) -> Array:
  """sum_r steps[..., r] g_r: one product in full precision with a 0/1 mask.

  Per head, over the chunk axis 3 of `g` `(Z, H, n, C)`, with `steps` `(C, C)` or `(C, C, C)`,
  whose leading axes come out after n; per key, over the second last axis of `g` `(..., C, K)`,
  with `steps` `(P, C)`, or one such mask per leading row of `g`: `(..., P, K)`.

  Each sum adds the decays of its own steps, so it keeps float32's relative precision however
  far the chunk decayed before them. A difference of cumulative sums b_t - b_s would carry the
  rounding of |b_s|: after one step of log-decay -1000, b is -1000 and its spacing 6e-5, so
  the decays between the later steps came out up to that much off (Mamba-3 at saturating
  inputs: 2e-3 of the largest output from a float64 loop).
  """
  if g.ndim == 4:
    free = "ts"[:steps.ndim - 1]
    return jnp.einsum(f"zhnr,{free}r->zhn{free}", g, steps, precision=lax.Precision.HIGHEST)
  # per key: the mask batched over the chunks, as `cumulative` does
  return jnp.matmul(jnp.broadcast_to(steps, (*g.shape[:-2], *steps.shape[-2:])), g,
                    precision=lax.Precision.HIGHEST)


def decay_to_end(g: Array, seg: Segments, b: Array | None = None) -> Array:
  """exp(g_{t+1} + ... + g_C), the decay from each step t of the last segment to the chunk's
  end, and 0 before that segment; `g` `(Z, H, n, C[, K])` log-decays.

  Summed over each step's own later steps, not as b_C - b_t: per head by one product
  (`_sums_between`), per key as the sums inside t's block and over the blocks after it
  (`_block_sums`). Given `b` (`cumulative`) per key, as b_C - b_t: for chunks that decay by
  less than `per_key_scores`' limit in every channel (`factors`), whose rounding is then at
  most 60 x 2^-24, and where the sums cost KDA's gradient about a tenth more time (B=2 T=4096
  H=4 K=V=64, CPU, the default log-decays).
  Selected before `exp`: across a reset the sum may be far above what the segment decays,
  and its overflow would reach the gradients as 0 * inf.
  """
  step = jnp.arange(g.shape[3])
  if g.ndim == 4:
    later = _sums_between(g, (step[None, :] > step[:, None]).astype(g.dtype))
  elif b is not None:
    later = b[:, :, :, -1:] - b
  else:
    sub = _block_size(g.shape[3])
    block = jnp.arange(g.shape[3] // sub)
    totals = jnp.sum(g.reshape((*g.shape[:3], -1, sub, g.shape[-1])), axis=4)  # (Z, H, n, m, K)
    after = _sums_between(totals, (block[None, :] > block[:, None]).astype(g.dtype))
    later = _block_sums(g, sub, later=True) + jnp.repeat(after, sub, axis=3)
  if seg.last is None:
    return jnp.exp(later)
  last = seg.last if g.ndim == 4 else seg.last[..., None]
  return jnp.exp(jnp.where(last, later, -jnp.inf))


def pairwise_decay(g: Array, causal: Array) -> Array:
  """exp(g_{s+1} + ... + g_t) where `causal`, else 0; `g` `(Z, H, n, C)` log-decays ->
  `(Z, H, n, C, C)`.

  Each exponent is summed over its own steps (`_sums_between`), not taken as a difference of
  cumulative sums b_t - b_s, which loses the precision of the larger |b|. The masked exponents
  are replaced before `exp`, so neither the values nor the gradients see an overflowing
  exp of s > t.
  """
  between = _steps_between(g.shape[3]).astype(g.dtype)
  return jnp.exp(jnp.where(causal, _sums_between(g, between), -jnp.inf))


def _steps_between(size: int, strict: bool = False) -> Array:
  """`(t, s, r)` True where step r of `size` lies in (s, t], or in (s, t) with `strict`."""
  step = jnp.arange(size)
  return (step[None, None, :] > step[None, :, None]) & (
      step[None, None, :] <= step[:, None, None] - strict)


# How far a chunk may decay, per width of the accumulation dtype, for its scores to be one
# product of factors exp(<= 0) and exp(< limit): exp(limit) is far from overflow.
_FACTOR_LIMIT = {32: 60.0, 64: 480.0}


def _leading(x: Array, count: int) -> Array:
  """`x` behind `count` unit axes (broadcasting without rank promotion)."""
  return x.reshape((1,) * count + x.shape)


def per_key_scores(xs: Sequence[Array], ys: Sequence[Array], g: Array, bx: Array, by: Array,
                   precision, strict: bool = False, factored: bool = False,
                   index: Array | None = None) -> list[list[Array]]:
  """sum_d x_td y_sd exp(bx_td - by_sd) for s <= t (s < t if `strict`) inside each chunk.

  With one decay per key channel the decay does not factor out of the product, and
  scaling x by exp(bx) and y by exp(-by) overflows once a chunk decays by more than about
  88 nats (float32). Where every channel of every chunk decays by less than
  `_FACTOR_LIMIT`, the scores are that one product (its factors stay below exp of the
  limit). Otherwise the chunks are split into blocks of at most 8 steps, block i entered at
  cumulative log-decay e_i: the steps before block i are scored against it by one product
  of factors exp(bx_t - e_i) and exp(e_i - by_s), both <= 1, and inside the block by one
  product too while every block decays by less than the limit, else step pair by step pair
  (a group of chunks at a time). With resets (`index`), a segment that starts inside block i
  takes its own start (cumulative log-decay 0) in place of e_i. The choice is made for all
  the chunks at once (and all the rows of a `vmap`), by value (`lax.switch`), unless the
  caller has made it for the whole sequence (`factored`).

  Args:
    xs, ys: `(Z, H, n, C, K)` rows of each chunk; every pair is scored.
    g: `(Z, H, n, C, K)` the log-decays that bx and by sum; the blocks' exponents are sums of
      them over their own steps.
    bx, by: `(Z, H, n, C, K)` cumulative log-decays of the xs' and the ys' steps from the
      start of their segment (`cumulative`); bx_t - by_s and bx_t - e_i must be <= 0
      wherever they are used (by = bx, or bx one step behind it with `strict`).
    precision: matmul precision.
    strict: leave out s = t.
    factored: every chunk decays by less than the limit (`factors` said so): the one product,
      without the switch.
    index: `(Z, 1, n, C)` the steps' segments (`Segments.index`), or None without resets.

  Returns:
    `scores[a][b]` `(Z, H, n, C, C)` for xs[a] and ys[b], zero for s > t (and s = t if
    `strict`); scores of steps of different segments are finite, to be masked by the caller.
  """
  limit = _FACTOR_LIMIT[jnp.finfo(bx.dtype).bits]
  lower = _leading(jnp.tril(jnp.ones(bx.shape[3:4] * 2, bool), -1 if strict else 0), 3)

  def whole(_):  # the chunk decays by less than the limit: one product
    xs_hat = [x * jnp.exp(bx) for x in xs]
    ys_hat = [y * jnp.exp(-by) for y in ys]
    product = lambda x, y: jnp.einsum("zhntd,zhnsd->zhnts", x, y, precision=precision)
    return tuple(tuple(jnp.where(lower, product(x, y), 0) for y in ys_hat) for x in xs_hat)

  def pairwise(_):  # groups of chunks at a time: the rare path keeps the common ones' memory
    n, group = bx.shape[2], _pairwise_group(bx.shape)
    scores = lambda c: _blocked_scores(*c, precision, strict, False)
    if group == n:  # a loop of one iteration would only slow it down
      return scores((xs, ys, g, index))
    # (n / group, Z, H, group, C, K): the loop runs over the groups, each a window of chunks.
    grouped = lambda a: None if a is None else jnp.moveaxis(
        a.reshape((*a.shape[:2], n // group, group, *a.shape[3:])), 2, 0)
    out = lax.map(jax.checkpoint(scores), (tuple(map(grouped, xs)), tuple(map(grouped, ys)),
                                           grouped(g), grouped(index)))
    # (Z, H, n / group, group, C, C) -> (Z, H, n, C, C)
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 2).reshape((*a.shape[1:3], n, *a.shape[-2:])),
                        out)

  if factored:
    return [list(row) for row in whole(None)]
  blocks = lambda _: _blocked_scores(xs, ys, g, index, precision, strict, True)
  path = jnp.where(all_above(jnp.min(by, axis=3), -limit), 0,
                   jnp.where(all_above(by - _references(by, index), -limit), 1, 2))
  scores = lax.switch(path, [jax.checkpoint(f) for f in (whole, blocks, pairwise)], None)
  return [list(row) for row in scores]


def factors(x: Inputs, size: int) -> Array:
  """Whether every chunk of `size` steps of `x` decays by less than `per_key_scores`' limit in
  every channel (always, without decays), so that its scores are one product.

  Decided once for a whole sequence, it takes the choice out of the chunk loop: against a
  switch in every window, KDA's gradient took 135.0 against 144.3 ms and the generalized delta
  rule's 128.4 against 141.4 ms, in the same memory, and compiled in 0.2-0.5 s more (B=2
  T=4096 H=4 K=V=64, CPU, side by side).

  Under `vmap` the answer is one for the whole batch (every row factors), so the choice stays
  a `lax.cond` rather than becoming a selection that runs both loops: KDA's vmapped gradient
  took 180.9 ms and 65.2 MiB that way, 50.8 ms and 41.7 MiB this way (B=2 T=2048 H=4
  K=V=64, CPU).
  """
  g = pad(x, size).log_decay
  if g is None:
    return jnp.asarray(True)
  totals = jnp.sum(g.reshape((g.shape[0], -1, size, *g.shape[2:])), axis=2)
  return all_above(totals, -_FACTOR_LIMIT[jnp.finfo(g.dtype).bits])


def all_above(x: Array, bound: float) -> Array:
  """Whether every entry of `x` is above `bound`: one answer for a whole `vmap`ped batch, so
  that a `lax.cond` or `lax.switch` on it stays one, where a batched predicate would turn it
  into a selection that runs every branch."""
  return _all_above_batch(lax.stop_gradient(x), bound)


@jax.custom_batching.custom_vmap
def _all_above_batch(x: Array, bound: float) -> Array:
  return jnp.all(x > bound)


@_all_above_batch.def_vmap
def _(axis_size, in_batched, x, bound):
  del axis_size, in_batched
  return _all_above_batch(x, bound), False


def _block_size(size: int) -> int:
  """The largest divisor of a chunk of `size` steps that is at most 8.

  Smaller blocks factor over stronger decays (the middle form of `per_key_scores`) and make
  the pairwise form cheaper, but score more blocks: 8 against 16 took 4% more time in the
  middle form and 15% less in the pairwise one (KDA's gradient at B=2 T=4096 H=4 K=V=64).
  """
  return max(d for d in range(1, min(size, 8) + 1) if size % d == 0)


# The pairwise form's step pair by step pair decays of a group of chunks, `(Z, H, n, m, c, c, K)`,
# hold at most about this many numbers (16 MiB in float32).
_PAIRWISE_NUMBERS = 2**22


def _pairwise_group(shape: tuple[int, ...]) -> int:
  """How many chunks of `(Z, H, n, C, K)` cumulative log-decays the pairwise form takes at once:
  the largest divisor of n (no remainder to compile twice) whose pairwise decays fit in
  `_PAIRWISE_NUMBERS`. Groups, not single chunks: KDA's gradient took 1.39 s with a loop over
  one chunk at a time and 0.35 s with the four chunks of each window of "chunked" at once; in
  "parallel", 1.23 s and 0.49 s with groups of 32 (B=2 T=4096 H=4 K=V=64, log-decays in
  [-50, -47], CPU)."""
  z, h, n, size, k = shape
  most = max(1, _PAIRWISE_NUMBERS // (z * h * size * _block_size(size) * k))
  return max(g for g in range(1, min(n, most) + 1) if n % g == 0)


def _entries(by: Array, index: Array | None) -> tuple[Array, Array | None]:
  """`(Z, H, n, m, K)` cumulative log-decays e_i where each block of the chunks starts (the
  end of the block before it; 0 for the first), and `(Z, 1, n, m)` the segment each block
  starts in (None without resets)."""
  sub = _block_size(by.shape[3])
  leave = by[:, :, :, sub - 1::sub]
  enter = jnp.concatenate([jnp.zeros_like(leave[:, :, :, :1]), leave[:, :, :, :-1]], axis=3)
  return enter, None if index is None else _entry_segments(index, sub)


def _entry_segments(index: Array, sub: int) -> Array:
  """`(Z, 1, n, m)` the segment each block of `sub` steps starts in: that of the step before it."""
  ends = index[:, :, :, sub - 1::sub]
  return jnp.concatenate([jnp.zeros_like(ends[:, :, :, :1]), ends[:, :, :, :-1]], axis=3)


def _steps(x: Array, sub: int) -> Array:
  """Per-block values `(Z, H, n, m, ...)` repeated for each of a block's `sub` steps: `(Z, H,
  n, m * sub, ...)`."""
  return jnp.repeat(x, sub, axis=3)


def _references(by: Array, index: Array | None) -> Array:
  """`(Z, H, n, C, K)` each step's point of reference in its block: e_i where the step's
  segment began before its block i, else 0, the start of its segment (`_entries`)."""
  sub = _block_size(by.shape[3])
  enter, entry_segment = _entries(by, index)
  if index is None:
    return _steps(enter, sub)
  same = (index == _steps(entry_segment, sub))[..., None]
  return jnp.where(same, _steps(enter, sub), 0)


def _block_sums(g: Array, sub: int, index: Array | None = None, behind: bool = False,
                later: bool = False) -> Array:
  """`(Z, H, n, C, K)` the sums of the log-decays `g` `(Z, H, n, C, K)` over the steps r of each
  step t's block of `sub` steps: from the block's start, or the start of t's segment inside it
  (`index`), up to t (before t with `behind`); with `later`, after t to the block's end.

  One product per block with a `(sub, sub)` mask of ones: as `sub` elementwise sums one step
  after the other, KDA's chunked gradient compiled in 10-45% more time than before these sums
  (B=2 T=70 H=2 K=8 with resets, CPU), this way in the same time.
  """
  step = jnp.arange(sub)
  mask = _leading(step[None, :] > step[:, None] if later else step[None, :] < step[:, None]
                  if behind else step[None, :] <= step[:, None], 4)  # (1, 1, 1, 1, t, r)
  if index is not None:  # (Z, 1, n, m, t, r): the same segment
    segment = index.reshape((*index.shape[:3], -1, sub))
    mask = mask & (segment[..., :, None] == segment[..., None, :])
  blocked = g.reshape((-1, sub, g.shape[-1]))  # (Z H n m, c, K)
  mask = jnp.broadcast_to(mask, (*g.shape[:3], g.shape[3] // sub, sub, sub)).reshape((-1, sub, sub))
  return _sums_between(blocked, mask.astype(g.dtype)).reshape(g.shape)


def _blocked_scores(xs, ys, g, index, precision, strict, factored):
  """`per_key_scores` as nested tuples `[a][b]` of `(Z, H, n, C, C)`, through blocks of at
  most 8 steps; inside a block as one product if `factored` (the block decays by less than
  the limit), else step pair by step pair.

  Every exponent sums the log-decays `g` `(Z, H, n, C, K)` of its own steps (`_block_sums`,
  `_sums_between`), never a difference of two cumulative sums: after a step of log-decay -1000,
  such a difference of the later steps' decays carried the rounding of 1000 (6e-5), and the
  outputs of GLA, KDA and RWKV-7 came out up to 6e-3 of their value off in float32.
  """
  size = g.shape[3]
  sub = _block_size(size)
  m = size // sub
  blocks = lambda a: a.reshape((*a.shape[:3], m, sub, a.shape[-1]))  # (Z, H, n, m, c, K)
  step = jnp.arange(size)
  start = jnp.arange(0, size, sub)  # each block's first step
  # Block i's xs are scaled by exp(bx_t - e_i), e_i where their segment entered the block (or
  # where it began inside it): the steps of t's block and segment up to t (before t with
  # `strict`, whose xs are one step behind).
  local = _block_sums(g, sub, index)  # (Z, H, n, C, K)
  x_scale = jnp.exp(blocks(_block_sums(g, sub, index, behind=True) if strict else local))
  # The keys before block i of the segment it starts in, by exp(e_i - by_s): the steps r of
  # (s, start_i).
  earlier = (step[None, :] < start[:, None])[None, None, None]  # (1, 1, 1, m, C)
  if index is not None:  # (Z, 1, n, m, C)
    entry_segment = _entry_segments(index, sub)
    earlier = earlier & (index[:, :, :, None, :] == entry_segment[..., None])
  # Those of s's block after s, then the whole blocks up to block i: two sums <= 0, whose sum
  # keeps their precision.
  after = _block_sums(g, sub, later=True)  # (Z, H, n, C, K)
  block = jnp.arange(m)
  spans = (block[None, None, :] > block[None, :, None]) & (block[None, None, :] < block[:, None, None])
  crossed = _sums_between(jnp.sum(blocks(g), axis=4),  # (Z, H, n, m, K) per block, then (i, j)
                          spans.reshape((m * m, m)).astype(g.dtype))
  # (Z, H, n, i, j, c, K) -> (Z, H, n, m, C, K): s = j c + its step in block j
  gaps = (after.reshape((*g.shape[:3], 1, m, sub, -1))
          + crossed.reshape((*g.shape[:3], m, m, 1, -1))).reshape((*g.shape[:3], m, size, -1))
  y_scale = jnp.exp(jnp.where(earlier[..., None], gaps, -jnp.inf))  # (Z, H, n, m, C, K)
  lower = jnp.tril(jnp.ones((sub, sub), bool), -1 if strict else 0)[None, None, None, None]
  if factored:  # exp(e_i - by_s) < exp(limit) inside block i
    y_near = jnp.exp(-blocks(local))
  else:
    if index is not None:  # (Z, 1, n, m, t, s)
      segment = index.reshape((*index.shape[:3], m, sub))
      lower = lower & (segment[..., :, None] == segment[..., None, :])
    # (Z H n m, t, s, K): the chunks' blocks on one axis, as in `within` below. The seven-axis form
    # (Z, H, n, m, t, s, K) crashed the process in jaxlib 0.10.2's CPU runtime (jax-ml/jax#40412:
    # a segmentation fault in its YNNPACK sums over t or s, in the float32 gradient) under
    # `vmap` with one row per mapped element, and on an AVX2 processor where a block filled its
    # chunk (m = 1), as `jnp.sum(a * b, axis=5)` of two (2, 2, 9, 1, 8, 8, 5) arrays does.
    flat = lambda a: a.reshape((-1, sub, a.shape[-1]))  # (Z H n m, c, K)
    mask = flat(jnp.broadcast_to(lower, (*x_scale.shape[:4], sub, sub)))[..., None]
    # exp(bx_t - by_s): the steps r of (s, t] of the block, (s, t) with `strict`
    pair = _steps_between(sub, strict).reshape((sub * sub, sub))
    sums = _sums_between(flat(g), pair.astype(g.dtype))
    inside = jnp.exp(jnp.where(mask, sums.reshape(mask.shape[:3] + sums.shape[-1:]), -jnp.inf))
  eye = jnp.eye(m, dtype=g.dtype)

  def scores(x, y):
    x_hat = blocks(x) * x_scale
    between = jnp.einsum("zhnmtd,zhnmsd->zhnmts", x_hat, y[:, :, :, None] * y_scale,
                         precision=precision)  # (Z, H, n, m, c, C)
    if factored:
      within = jnp.einsum("zhnmtd,zhnmsd->zhnmts", x_hat, blocks(y) * y_near, precision=precision)
      within = jnp.where(lower, within, 0)
    else:
      within = jnp.sum(flat(x)[:, :, None] * flat(y)[:, None] * inside,
                       axis=-1).reshape((*x_scale.shape[:4], sub, sub))
    diagonal = jnp.einsum("zhnits,ij->zhnitjs", within, eye).reshape(between.shape)
    return (between + diagonal).reshape((*x.shape[:3], size, size))

  return tuple(tuple(scores(x, y) for y in ys) for x in xs)


def read_rows(x: Array | None, every: int) -> Array | None:
  """Steps every - 1, 2 every - 1, ... of each chunk of `(Z, H, n, C, ...)` `x` (None: None)."""
  return None if x is None else x[:, :, :, every - 1::every]


def masked(x: Array, mask: Array | None) -> Array:
  """`x` set to zero where `mask` is False (None: kept); `mask` broadcasts against the leading
  axes of `x`, e.g. `(Z, 1, n, C)` against `(Z, H, n, C, ...)`.

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


def poisoned_before(bad: Array, reset: Array) -> Array:
  """Steps whose state before their own write a non-finite input has reached within the chunk:
  some bad step s < t with no reset in (s, t] (`poisoned`'s flags one step on)."""
  after = poisoned(bad, reset)
  return jnp.concatenate([jnp.zeros_like(after[..., :1]), after[..., :-1]], axis=3) & ~reset
