"""Pallas kernels of chunked linear attention, forward and backward, one decay per head or per
key channel.

One program per (batch row, head) carries the `(K, V)` state through the chunks in float32.
Per chunk of C steps, with b_t the cumulative log-decay of t's segment (`segments`):

  o_t = sum_{s <= t in t's segment} (q_t . k_s e^{b_t - b_s}) v_s + [t in segment 0] (q_t e^{b_t}) S,
  S' = [no reset] e^{b_C} S + sum_{s in the last segment} (k_s e^{b_C - b_s})^T v_s.

With one decay per key channel the decay does not factor out of q_t . k_s, and e^{b_t} q_t,
e^{-b_s} k_s overflow over a chunk that decays strongly; the chunk is taken in blocks of at most
16 rows: the steps before block i are scored by one product of factors e^{b_t - e_i} and
e^{e_i - b_s} (e_i the cumulative decay entering block i, both factors <= 1) and the pairs
inside a block one by one, as flash-linear-attention's GLA kernels do.

The backward program recomputes the state entering each chunk (kept in an output buffer, one
per chunk), then walks the chunks back carrying dS:

  dq_t = sum_s dA_ts k_s e^{b_t - b_s} + [t in segment 0] e^{b_t} (do_t S^T),  dA = do v^T,
  dk_s = sum_t dA_ts q_t e^{b_t - b_s} + [s last] e^{b_C - b_s} (v_s dS^T),
  dv_s = sum_t A_ts do_t + [s last] (k_s e^{b_C - b_s}) dS,
  dS_in = [no reset] e^{b_C} dS + sum_{t in segment 0} (q_t e^{b_t})^T do_t,
  d b_t = q_t dq_t - k_t dk_t (+ <dS, S'> at the last step),   dg = the segment's reverse sum.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ssmkit._src.matrix_state.inputs import Inputs
from ssmkit._src.matrix_state.kernels import routed, segments

Array = jax.Array
F32 = jnp.float32

# Rows of a block of a chunk with one decay per key channel: the pairs inside a block are
# scored one by one (a (c, c, K) product), the rest by matrix products.
KEY_BLOCK = 16


def _dot(a: Array, b: Array, precision) -> Array:
  return jnp.dot(a, b, precision=precision, preferred_element_type=F32)


def _dot_nt(a: Array, b: Array, precision) -> Array:
  """a b^T."""
  return _dot(a, b.T, precision)


def _dot_tn(a: Array, b: Array, precision) -> Array:
  """a^T b."""
  return _dot(a.T, b, precision)


def _leaving(k: Array, v: Array, b: Array, last: Array, carried: Array, state: Array,
             precision) -> tuple[Array, Array, Array]:
  """The state leaving a chunk, with the decays that make it: the entering state's `(K, 1)` (or
  `()`) factor and the keys' `(C, K)` (or `(C, 1)`) factors e^{b_C - b_s} of the last segment."""
  size = k.shape[0]
  end = segments.pick(b, size - 1)
  through = jnp.where(carried, jnp.exp(end), 0.0)
  if b.ndim == 1:
    to_end = segments.decay(end - b, last)[:, None]
  else:
    through = through[:, None]
    to_end = segments.decay(end[None, :] - b, last[:, None])
  return through * state + _dot_tn(k * to_end, v, precision), through, to_end


class _KeyBlock:
  """Block i of a chunk with one decay per key channel: its rows' factors against the steps
  before it (`x_scale` `(c, K)`, `y_scale` `(C, K)`), its own pairs' decays (`inside`
  `(c, c, K)`) and its rows' reads of the entering state (`entering` `(c, K)`)."""

  def __init__(self, reset: Array, g: Array, b: Array, index: Array, i: int, sub: int):
    start = i * sub
    seg = segments.rows(reset, start, sub)
    b_i = segments.cumulative(g, seg.causal)
    before = start - 1
    e = segments.pick(b, before)  # (K,): 0 for block 0, which has no steps before it
    into = segments.pick(index, before)  # the segment that continues into the block
    self.x_scale = segments.decay(b_i - e[None, :], (seg.index == into)[:, None])
    s = lax.broadcasted_iota(jnp.int32, (b.shape[0], 1), 0)
    self.y_scale = segments.decay(e[None, :] - b, (s < start) & (index == into)[:, None])
    t_local = lax.broadcasted_iota(jnp.int32, (sub, sub), 0)
    s_local = lax.broadcasted_iota(jnp.int32, (sub, sub), 1)
    pairs = (s_local <= t_local) & (seg.index[:, None] == seg.index[None, :])
    self.inside = segments.decay(b_i[:, None, :] - b_i[None, :, :], pairs[:, :, None])
    self.entering = jnp.where(seg.first[:, None], jnp.exp(b_i), 0.0)

  def scores(self, q_i: Array, k_i: Array, k: Array, precision) -> tuple[Array, Array]:
    """`(c, C)` scores of the block's rows against the steps before it, `(c, c)` inside it."""
    between = _dot_nt(q_i * self.x_scale, k * self.y_scale, precision)
    within = jnp.sum(q_i[:, None, :] * k_i[None, :, :] * self.inside, axis=2)
    return between, within


def _head_forward(q, k, v, g, reset, state, precision):
  seg, last, carried = segments.whole(reset)
  b = segments.cumulative(g, seg.causal)
  scores = _dot_nt(q, k, precision) * segments.decay(b[:, None] - b[None, :], seg.causal)
  entering = jnp.where(seg.first, jnp.exp(b), 0.0)[:, None]
  out = _dot(scores, v, precision) + _dot(q * entering, state, precision)
  return out, _leaving(k, v, b, last, carried, state, precision)[0]


def _forward_kernel(q_ref, k_ref, v_ref, g_ref, r_ref, s0_ref, o_ref, s_ref, *, size: int,
                    sub: int, precision):
  def chunk(c, state):
    start = pl.multiple_of(c * size, size)
    at = lambda ref, offset=0, count=size: ref[pl.ds(start + offset, count)].astype(F32)
    q, k, v, g, reset = at(q_ref), at(k_ref), at(v_ref), at(g_ref), at(r_ref)
    if g.ndim == 1:
      out, state_out = _head_forward(q, k, v, g, reset, state, precision)
      o_ref[pl.ds(start, size)] = out
      return state_out
    seg, last, carried = segments.whole(reset)
    b = segments.cumulative(g, seg.causal)
    for i in range(size // sub):
      q_i, k_i, v_i = (at(ref, i * sub, sub) for ref in (q_ref, k_ref, v_ref))
      block = _KeyBlock(reset, g, b, seg.index, i, sub)
      between, within = block.scores(q_i, k_i, k, precision)
      o_ref[pl.ds(start + i * sub, sub)] = (
          _dot(between, v, precision) + _dot(within, v_i, precision)
          + _dot(q_i * block.entering, state, precision))
    return _leaving(k, v, b, last, carried, state, precision)[0]

  s_ref[...] = lax.fori_loop(0, q_ref.shape[0] // size, chunk, s0_ref[...].astype(F32))


def _head_backward(q, k, v, g, reset, state, do, ds, precision):
  """One chunk's (dq, dk, dv, dg, dS entering) with one decay per head."""
  seg, last, carried = segments.whole(reset)
  b = segments.cumulative(g, seg.causal)
  decays = segments.decay(b[:, None] - b[None, :], seg.causal)
  scores = _dot_nt(q, k, precision) * decays
  leaving, through, to_end = _leaving(k, v, b, last, carried, state, precision)
  entering = jnp.where(seg.first, jnp.exp(b), 0.0)[:, None]
  d_scores = _dot_nt(do, v, precision) * decays
  dq = _dot(d_scores, k, precision) + entering * _dot_nt(do, state, precision)
  dk = _dot_tn(d_scores, q, precision) + to_end * _dot_nt(v, ds, precision)
  dv = _dot_tn(scores, do, precision) + _dot(k * to_end, ds, precision)
  ds_in = through * ds + _dot_tn(q * entering, do, precision)
  at_end = lax.broadcasted_iota(jnp.int32, (q.shape[0],), 0) == q.shape[0] - 1
  db = jnp.sum(q * dq - k * dk, axis=1) + jnp.where(at_end, jnp.sum(ds * leaving), 0.0)
  return dq, dk, dv, segments.reverse_cumulative(db, seg.causal), ds_in


def _backward_kernel(q_ref, k_ref, v_ref, g_ref, r_ref, s0_ref, do_ref, dsn_ref, dq_ref, dk_ref,
                     dv_ref, dg_ref, ds0_ref, states_ref, *, size: int, sub: int, precision):
  n = q_ref.shape[0] // size

  def at(ref, start, offset=0, count=size):
    return ref[pl.ds(start + offset, count)].astype(F32)

  def forward(c, state):
    start = pl.multiple_of(c * size, size)
    states_ref[c] = state
    k, v, g, reset = at(k_ref, start), at(v_ref, start), at(g_ref, start), at(r_ref, start)
    seg, last, carried = segments.whole(reset)
    b = segments.cumulative(g, seg.causal)
    return _leaving(k, v, b, last, carried, state, precision)[0]

  lax.fori_loop(0, n, forward, s0_ref[...].astype(F32))

  def backward(j, ds):
    c = n - 1 - j
    start = pl.multiple_of(c * size, size)
    rows = pl.ds(start, size)
    state = states_ref[c]
    q, k, v, g, reset, do = (at(ref, start) for ref in (q_ref, k_ref, v_ref, g_ref, r_ref, do_ref))
    if g.ndim == 1:
      dq, dk, dv, dg, ds_in = _head_backward(q, k, v, g, reset, state, do, ds, precision)
      dq_ref[rows], dk_ref[rows], dv_ref[rows], dg_ref[rows] = dq, dk, dv, dg
      return ds_in
    seg, last, carried = segments.whole(reset)
    b = segments.cumulative(g, seg.causal)
    leaving, through, to_end = _leaving(k, v, b, last, carried, state, precision)
    dk = to_end * _dot_nt(v, ds, precision)
    dv = _dot(k * to_end, ds, precision)
    ds_in = through * ds
    inside_parts = []
    for i in range(size // sub):
      q_i, k_i, v_i, do_i = (at(ref, start, i * sub, sub) for ref in (q_ref, k_ref, v_ref, do_ref))
      block = _KeyBlock(reset, g, b, seg.index, i, sub)
      between, within = block.scores(q_i, k_i, k, precision)
      d_between = _dot_nt(do_i, v, precision)
      d_within = _dot_nt(do_i, v_i, precision)[:, :, None] * block.inside  # (c, c, K)
      k_scaled = k * block.y_scale
      dq_ref[pl.ds(start + i * sub, sub)] = (
          block.x_scale * _dot(d_between, k_scaled, precision)
          + jnp.sum(d_within * k_i[None, :, :], axis=1)
          + block.entering * _dot_nt(do_i, state, precision))
      dk = dk + block.y_scale * _dot_tn(d_between, q_i * block.x_scale, precision)
      dv = dv + _dot_tn(between, do_i, precision)
      ds_in = ds_in + _dot_tn(q_i * block.entering, do_i, precision)
      inside_parts.append((jnp.sum(d_within * q_i[:, None, :], axis=0),
                           _dot_tn(within, do_i, precision)))
    dk_ref[rows], dv_ref[rows] = dk, dv
    for i, (dk_i, dv_i) in enumerate(inside_parts):
      block_rows = pl.ds(start + i * sub, sub)
      dk_ref[block_rows] = dk_ref[block_rows] + dk_i
      dv_ref[block_rows] = dv_ref[block_rows] + dv_i
    at_end = lax.broadcasted_iota(jnp.int32, (size, 1), 0) == size - 1
    db = q * dq_ref[rows] - k * dk_ref[rows] + jnp.where(
        at_end, jnp.sum(ds * leaving, axis=1)[None, :], 0.0)
    dg_ref[rows] = segments.reverse_cumulative(db, seg.causal)
    return ds_in

  ds0_ref[...] = lax.fori_loop(0, n, backward, dsn_ref[...].astype(F32))


def _specs(q: Array, v: Array, g: Array):
  """Block specs over the grid (batch row, head): a whole sequence of one head per program."""
  length, dim_k, dim_v = q.shape[1], q.shape[3], v.shape[3]
  steps = lambda dim: pl.BlockSpec((None, length, None, dim), lambda z, h: (z, 0, h, 0))
  decay = steps(dim_k) if g.ndim == 4 else pl.BlockSpec((None, length, None),
                                                         lambda z, h: (z, 0, h))
  reset = pl.BlockSpec((None, length), lambda z, h: (z, 0))
  state = pl.BlockSpec((None, None, dim_k, dim_v), lambda z, h: (z, h, 0, 0))
  return steps(dim_k), steps(dim_v), decay, reset, state


def forward(q, k, v, g, reset, state, *, size: int, precision, interpret: bool):
  """Outputs `(Z, T, H, V)` and final state `(Z, H, K, V)`, float32, of inputs whose T is a
  multiple of `size`: `q, k` `(Z, T, H, K)`, `v` `(Z, T, H, V)`, `g` `(Z, T, H[, K])`, `reset`
  `(Z, T)` float32 (1.0 clears), `state` `(Z, H, K, V)`."""
  z, length, heads, _ = q.shape
  keys, values, decay, resets, states = _specs(q, v, g)
  kernel = functools.partial(_forward_kernel, size=size, sub=_block(size), precision=precision)
  return pl.pallas_call(
      kernel, grid=(z, heads), interpret=interpret,
      in_specs=[keys, keys, values, decay, resets, states], out_specs=[values, states],
      out_shape=[jax.ShapeDtypeStruct((z, length, heads, v.shape[3]), F32),
                 jax.ShapeDtypeStruct(state.shape, F32)],
  )(q, k, v, g, reset, state)


def backward(q, k, v, g, reset, state, d_out, d_state, *, size: int, precision,
             interpret: bool):
  """Gradients `(dq, dk, dv, dg, d_state_in)` in float32 of `forward`'s inputs, from the
  cotangents of its outputs `d_out` `(Z, T, H, V)` and final state `d_state` `(Z, H, K, V)`."""
  z, length, heads, dim_k = q.shape
  keys, values, decay, resets, states = _specs(q, v, g)
  n = length // size
  kept = pl.BlockSpec((None, None, n, dim_k, v.shape[3]), lambda z, h: (z, h, 0, 0, 0))
  kernel = functools.partial(_backward_kernel, size=size, sub=_block(size), precision=precision)
  shape = lambda a: jax.ShapeDtypeStruct(a.shape, F32)
  *grads, _ = pl.pallas_call(
      kernel, grid=(z, heads), interpret=interpret,
      in_specs=[keys, keys, values, decay, resets, states, values, states],
      out_specs=[keys, keys, values, decay, states, kept],
      out_shape=[shape(q), shape(k), shape(v), shape(g), shape(state),
                 jax.ShapeDtypeStruct((z, heads, n, dim_k, v.shape[3]), F32)],
  )(q, k, v, g, reset, state, d_out, d_state)
  return tuple(grads)


def _block(size: int) -> int:
  """Rows per block of a chunk of `size` steps: the largest divisor of it up to `KEY_BLOCK`."""
  return max(d for d in range(1, min(size, KEY_BLOCK) + 1) if size % d == 0)


def _chunk_size(length: int, chunk_size: int | None) -> int:
  """The kernels' chunk: `chunk_size` (default 64), or for a shorter sequence the power of two
  from 16 that holds it."""
  return min(chunk_size or 64, max(16, 1 << max(length - 1, 0).bit_length()))


def run(x: Inputs, chunk_size: int | None, precision,
        fallback: Callable[[Inputs], tuple[Array, Array]]) -> tuple[Array, Array]:
  """Linear attention of `x` (float32 accumulation, T > 0) by the kernels: `(Z, T, H, V)` outputs
  and the `(Z, H, K, V)` final state; `fallback` is the XLA form, for inputs (or cotangents)
  with a non-finite entry (`routed`)."""
  length = x.q.shape[1]
  size = _chunk_size(length, chunk_size)
  interpret = jax.default_backend() != "gpu"
  k = x.k if x.beta is None else x.k * x.beta[..., None]
  g = jnp.zeros(x.q.shape[:3], x.q.dtype) if x.log_decay is None else x.log_decay
  reset = jnp.zeros(x.q.shape[:2], F32) if x.reset is None else x.reset.astype(F32)
  extra = -length % size
  pad = lambda a: jnp.pad(a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2))
  cut = lambda a: a[:, :length]
  options = dict(size=size, precision=precision, interpret=interpret)

  def by_kernel(q, k, v, g, reset, state):
    out, last = forward(*map(pad, (q, k, v, g, reset)), state, **options)
    return cut(out), last

  def by_kernel_backward(q, k, v, g, reset, state, d_out, d_state):
    padded = map(pad, (q, k, v, g, reset))
    dq, dk, dv, dg, d_in = backward(*padded, state, pad(d_out), d_state, **options)
    return cut(dq), cut(dk), cut(dv), cut(dg), jnp.zeros_like(reset), d_in

  def by_xla(q, k, v, g, reset, state):
    return fallback(x._replace(q=q, k=k, v=v, log_decay=g, beta=None, state=state,
                               reset=None if x.reset is None else reset > 0.5))

  return routed.routed(by_kernel, by_kernel_backward, by_xla, x.q, k, x.v, g, reset, x.state)
