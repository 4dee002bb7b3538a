"""The linear recurrence h_t = a_t * h_{t-1} + b_t, with a custom JVP whose transpose is one
reverse scan."""

from __future__ import annotations

import functools
import operator
from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ssmkit._src import checks, state_pass
from ssmkit._src.engine import (
    axis_position,
    reduce_leading,
    scan_along,
    vary_alike,
)
from ssmkit._src.modes import Inner, Mode, parse_inner, parse_mode, resolve_mode
from ssmkit._src.operators import affine, with_resets

Array = jax.Array
# The decay as factors whose product is a_t, each with time leading (length T or 1).
Decay = tuple[Array, ...]


class _Config(NamedTuple):
  reverse: bool
  mode: Mode
  chunk_size: int | None
  inner: Inner | None
  in_place: bool  # whether the sequential mode may overwrite `b`


def _edge(reverse: bool) -> int:
  """Index of the first step of the scan (where h0 enters)."""
  return -1 if reverse else 0


def _row(x: Array, t: Array) -> Array:
  return lax.dynamic_index_in_dim(x, t, keepdims=False)


def _decay_row(a: Decay, t: Array) -> Array:
  """a_t, multiplied from the factors' rows (a time-invariant factor has one row)."""
  return functools.reduce(operator.mul, [x[0] if x.shape[0] == 1 else _row(x, t) for x in a])


def _decay(a: Decay, shape: tuple[int, ...]) -> Array:
  """The product of the factors, broadcast to `shape`."""
  return jnp.broadcast_to(functools.reduce(operator.mul, a), shape)


def _zeros_if_none(h0: Array | None, like: Array) -> Array:
  """`h0`, or the zero state of a time-leading `like` when there is none."""
  return jnp.zeros_like(like[0]) if h0 is None else h0


def _in_place(a: Decay, b: Array, h0: Array | None, reset: Array | None, reverse: bool):
  """A loop that overwrites `b` with `h` in place, reading a_t from the factors of `a`.

  Writing into `b` saves the zero-filled output buffer of a `lax.scan` when `b` is a buffer
  of this program that nothing reads afterwards; XLA would copy an argument of the program
  first, which costs more than the buffer saved. The carry is read back from the written
  row: were it computed beside the write, XLA could schedule a read of the old row after
  the write and would copy the whole buffer every step to stay correct.
  """
  length = b.shape[0]

  def body(i, carry):
    h, out = carry
    t = length - 1 - i if reverse else i
    b_t = _row(out, t)
    h = _decay_row(a, t) * h + b_t
    if reset is not None:
      h = jnp.where(_row(reset, t), b_t, h)
    out = lax.dynamic_update_index_in_dim(out, h, t, 0)
    return _row(out, t), out

  return lax.fori_loop(0, length, body, (_zeros_if_none(h0, b), b))


def _stacked(a: Decay, b: Array, h0: Array | None, reset: Array | None, reverse: bool):
  """`lax.scan` over the steps, stacking the states; returns `(h_last, h)`.

  Time-varying factors of `a` are scanned as they are and time-invariant ones enter as
  constants, so reverse mode, transposing this scan into a reverse `lax.scan`, stores no
  copy of a_t.
  """
  varying = tuple(x for x in a if x.shape[0] != 1)
  fixed = [x[0] for x in a if x.shape[0] == 1]

  def body(h, xs):
    a_t, b_t, r_t = xs
    decayed = functools.reduce(operator.mul, [*a_t, *fixed]) * h
    if r_t is not None:
      decayed = jnp.where(r_t, jnp.zeros_like(decayed), decayed)
    h = decayed + b_t
    return h, h

  return lax.scan(body, _zeros_if_none(h0, b), (varying, b, reset), reverse=reverse)


def _cumsum_chunk(chunk, reverse: bool):
  """Closed-form affine scan of a chunk: (P, P * cumsum(b / P)), P the running product."""
  a, b = chunk
  p = lax.cumprod(a, axis=0, reverse=reverse)
  return p, p * lax.cumsum(b / p, axis=0, reverse=reverse)


def _scanned(a: Array, b: Array, h0: Array | None, reset: Array | None, cfg: _Config):
  """The parallel and chunked modes: the affine operator through the scan engine."""
  first = _edge(cfg.reverse)
  # Without `h0` (zeros) the first element is already h at the first step: writing it, and
  # with it copying a `b` that is an argument of the program, is skipped.
  if h0 is not None:
    entry = a[first] * h0 + b[first]
    if reset is not None:
      entry = jnp.where(reset[first], b[first], entry)
    b = b.at[first].set(entry)
  if reset is None:
    op, elems = affine, (a, b)
  else:
    op, elems = with_resets(affine), (reset, (a, b))
  out = scan_along(
      op,
      elems,
      axis=0,
      mode=cfg.mode,
      reverse=cfg.reverse,
      chunk_size=cfg.chunk_size,
      inner=cfg.inner,
      scan_chunk=_cumsum_chunk if cfg.inner is Inner.CUMSUM else None,
  )
  h = out[1] if reset is None else out[1][1]
  return h[0 if cfg.reverse else -1], h


def _forward(cfg: _Config, a: Decay, b, h0, reset):
  match cfg.mode:
    case Mode.SEQUENTIAL if cfg.in_place:
      return _in_place(a, b, h0, reset, cfg.reverse)
    case Mode.SEQUENTIAL:
      return _stacked(a, b, h0, reset, cfg.reverse)
  return _scanned(_decay(a, b.shape), b, h0, reset, cfg)


def _shift(x: Array, reverse: bool, fill: Array) -> Array:
  """x_{t+1} along the scan direction (x_{t-1} when reversed), `fill` past the end."""
  fill = fill[None]
  return jnp.concatenate([fill, x[:-1]]) if reverse else jnp.concatenate([x[1:], fill])


def _tangent(cfg: _Config, a: Decay, u: Array, dh0: Array | None, reset: Array | None):
  """(dh_last, dh) of dh_t = a_t * dh_{t-1} + u_t from dh0: the recurrence's tangent map.

  It is linear in `u` and `dh0` and written with operations JAX transposes into one
  reverse recurrence: `lax.scan` in the sequential mode (the in-place loop would transpose
  into a loop that stores a copy of every a_t), the engine's scan in the others.
  """
  if cfg.mode is Mode.SEQUENTIAL:
    return _stacked(a, u, dh0, reset, cfg.reverse)
  return _scanned(_decay(a, u.shape), u, dh0, reset, cfg)


def nonzero_tangents(tangents):
  """The tangents a `symbolic_zeros` JVP rule gets, with None for each symbolic zero."""
  return jax.tree.map(lambda t: None if isinstance(t, SymbolicZero) else t, tangents,
                      is_leaf=lambda t: isinstance(t, SymbolicZero))


def _tangent_input(cfg: _Config, a: Decay, da, db, h: Array, h0: Array | None,
                   reset: Array | None):
  """u_t = da_t * h_{t-1} + db_t, with da_t the tangent of the product of the factors.

  `da` holds one tangent per factor and `db` one for `b`, None where it is zero. h_{t-1} is
  zeroed at a reset, where the step reads no state: a NaN state before the reset then gives
  no NaN tangent (or gradient) after it.
  """
  u = jnp.zeros_like(h) if db is None else db
  terms = [
      functools.reduce(operator.mul, [*a[:i], *a[i + 1 :]], dx)
      for i, dx in enumerate(da)
      if dx is not None
  ]
  if not terms:
    return u
  h_prev = _shift(h, not cfg.reverse, _zeros_if_none(h0, h))
  if reset is not None:
    h_prev = jnp.where(reset, jnp.zeros_like(h_prev), h_prev)
  return u + functools.reduce(operator.add, terms).astype(h.dtype) * h_prev


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _recurrence(cfg: _Config, a, b, h0, reset):
  h_last, h = _forward(cfg, a, b, h0, reset)
  return h, h_last


@functools.partial(_recurrence.defjvp, symbolic_zeros=True)
def _recurrence_jvp(cfg, primals, tangents):
  a, b, h0, reset = primals
  da, db, dh0, _ = nonzero_tangents(tangents)
  h, h_last = _recurrence(cfg, a, b, h0, reset)
  u = _tangent_input(cfg, a, da, db, h, h0, reset)
  dh_last, dh = _tangent(cfg, a, u, dh0, reset)
  return (h, h_last), (dh, dh_last)


def _fold(cfg: _Config, a: Decay, b, h0, reset):
  """The last state, folding the steps without storing the states."""
  a = _decay(a, b.shape)
  if reset is None:
    total_a, total_b = reduce_leading(affine, (a, b), mode=cfg.mode, reverse=cfg.reverse,
                                      chunk_size=cfg.chunk_size)
    return total_b if h0 is None else total_a * h0 + total_b
  reset = jnp.broadcast_to(reset, b.shape)
  cut, (total_a, total_b) = reduce_leading(with_resets(affine), (reset, (a, b)), mode=cfg.mode,
                                           reverse=cfg.reverse, chunk_size=cfg.chunk_size)
  return total_b if h0 is None else jnp.where(cut, total_b, total_a * h0 + total_b)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _final(cfg: _Config, a: Decay, b, h0, reset):
  return _fold(cfg, a, b, h0, reset)


@functools.partial(_final.defjvp, symbolic_zeros=True)
def _final_jvp(cfg, primals, tangents):
  a, b, h0, reset = primals
  da, db, dh0, _ = nonzero_tangents(tangents)

  # Checkpointed: the gradient recomputes the states instead of keeping them.
  @jax.checkpoint
  def tangent(a, b, h0, reset, da, db, dh0):
    _, h = _forward(cfg, a, b, h0, reset)
    return _fold(cfg, a, _tangent_input(cfg, a, da, db, h, h0, reset), dh0, reset)

  return _final(cfg, a, b, h0, reset), tangent(a, b, h0, reset, da, db, dh0)


def _across_devices(cfg: _Config, a: Decay, b, h0, reset, axis_name: Hashable, states: bool):
  """The recurrence over every device's slice of time along the mesh axis `axis_name`.

  Each device reduces its slice to the affine map h -> A h + B it applies (A the product
  of its decays, B its final state from zero; the map is h -> B when a reset cuts the
  slice), the maps are combined across devices (`state_pass.across_devices`: all-gathered,
  or in log2(devices) rounds of `ppermute` on large meshes), and each device runs its slice
  once from the carry the maps before it produce. Reducing first and scanning once reads the
  slice twice and writes it once; scanning from zero and fixing up with the running product
  of `a` would write it twice and need that product too. `h0` enters on the device holding
  the first step (the last when reversed); the others' `h0` are ignored. Autodiff runs
  through the collectives, so the backward pass is sequence-parallel as well.

  Returns:
    `(h, h_final)` with `states`, else `h_final`; `h_final` is the state after the last
    step of the whole sequence, the same on every device.
  """
  length = b.shape[0]
  total_a = functools.reduce(
      operator.mul, [x[0] ** length if x.shape[0] == 1 else jnp.prod(x, axis=0) for x in a]
  )
  total_b = _final(cfg, a, b, None, reset)
  cut = None if reset is None else jnp.any(reset, axis=0)
  start = jnp.zeros_like(total_b) if h0 is None else h0
  carry, h_final = state_pass.across_devices(state_pass.Maps(total_a, total_b, cut), start,
                                             matrix=False, axis_name=axis_name, reverse=cfg.reverse)
  if not states:
    return h_final
  h, _ = _recurrence(cfg, a, b, carry, reset)
  return h, h_final


def accumulation_dtype(dtype) -> jnp.dtype:
  """float32 for 16-bit floats (complex64 stays), else the dtype itself."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return jnp.dtype(jnp.float32)
  return dtype


def output_and_state_dtypes(dtype, state) -> tuple[jnp.dtype, jnp.dtype]:
  """The outputs' and the state's dtypes of a scan over inputs of `dtype` from `state`.

  The state is kept and returned in the accumulation dtype, so that a sequence streamed in
  pieces (or one step at a time) rounds its state no more than one pass does. A `state` in
  that dtype, as a scan returns it, leaves the outputs' dtype alone (bfloat16 inputs give
  bfloat16 outputs from a float32 state); a wider one (float64, complex) promotes them.
  """
  acc = accumulation_dtype(dtype)
  if state is not None and jnp.result_type(acc, state) != acc:
    dtype = jnp.result_type(dtype, state)
    acc = accumulation_dtype(dtype)
  return jnp.dtype(dtype), acc


class _Prepared(NamedTuple):
  cfg: _Config
  a: Decay
  b: Array
  h0: Array | None
  reset: Array | None
  axis: int
  out_dtype: jnp.dtype


def _prepare(a, b, h0, reset, reverse, axis, mode, chunk_size, inner, axis_name,
             overwrite_b=False) -> _Prepared:
  """Checks the arguments, moves time to the front and casts to the accumulation dtype."""
  factors = tuple(a) if isinstance(a, (tuple, list)) else (a,)
  if not factors:
    raise ValueError("`a` must be an array or a non-empty tuple of factors, got ().")
  names = ["a"] if len(factors) == 1 else [f"a[{i}]" for i in range(len(factors))]
  factors = tuple(jnp.asarray(x) for x in factors)
  b = jnp.asarray(b)
  for x, name in zip(factors, names, strict=True):
    checks.check_inexact(x, name)
  checks.check_inexact(b, "b")
  mode = parse_mode(mode)
  checks.check_chunk_size(chunk_size)
  inner = parse_inner(inner, tuple(Inner), mode)
  if axis_name is not None:
    axis_position(axis_name)
  if b.ndim == 0:
    raise ValueError("`b` must have a time axis, got a scalar.")
  axis = checks.canonical_axis(axis, b.ndim)
  for x, name in zip(factors, names, strict=True):
    checks.check_broadcasts_to(x, b.shape, name, "b")
  state_shape = b.shape[:axis] + b.shape[axis + 1 :]
  if h0 is not None:
    h0 = jnp.asarray(h0)
    checks.check_inexact(h0, "h0")
    checks.check_shape(h0, state_shape, "h0", "`b` without its time axis")
  out_dtype, acc = output_and_state_dtypes(jnp.result_type(*factors, b), h0)
  if reset is not None:
    reset = jnp.asarray(reset)
    checks.check_bool(reset, "reset")
    reset = checks.align_leading(reset, b.shape, axis, "reset", "b")
    if inner is Inner.CUMSUM:
      raise ValueError("`inner='cumsum'` cannot segment a scan: pass `reset=None`.")
    reset = jnp.moveaxis(reset, axis, 0)
  a = tuple(
      jnp.moveaxis(x.reshape((1,) * (b.ndim - x.ndim) + x.shape), axis, 0).astype(
          acc if jnp.iscomplexobj(x) else jnp.finfo(acc).dtype
      )
      for x in factors
  )
  b_given = b
  b = jnp.moveaxis(b, axis, 0).astype(acc)
  h0 = None if h0 is None else h0.astype(acc)
  a, b, h0 = vary_alike((a, b, h0))
  # `b` is a buffer of its own once moved or cast, which the sequential loop may overwrite;
  # the caller's `b` may be an argument of the program, which XLA would copy first.
  own = b_given.dtype != acc or any(n > 1 for n in b_given.shape[:axis])
  cfg = _Config(bool(reverse), resolve_mode(mode), chunk_size, inner, bool(overwrite_b) or own)
  return _Prepared(cfg, a, b, h0, reset, axis, out_dtype)


def linear_recurrence(
    a: Array | tuple[Array, ...],
    b: Array,
    h0: Array | None = None,
    *,
    reset: Array | None = None,
    reverse: bool = False,
    axis: int = 0,
    mode: str | Mode = "auto",
    chunk_size: int | None = None,
    inner: str | Inner | None = None,
    return_final_state: bool = False,
    axis_name: Hashable | None = None,
    overwrite_b: bool = False,
) -> Array | tuple[Array, Array]:
  """Computes h_t = a_t * h_{t-1} + b_t along `axis`, starting from h_{-1} = h0.

  With `reverse=True` the recurrence runs from the end: h_t = a_t * h_{t+1} + b_t, h_T = h0
  (a discounted return is `linear_recurrence(discount, reward, reverse=True)`).
  `reset[t]` clears the state before step t (h_t = b_t), by selection, so a NaN or Inf
  before a reset never reaches the steps after it.

  Every JAX transform applies (`jit`, `vmap`, `grad`, `jvp`, `jacfwd`, `hessian`, ...).
  Derivatives come from a custom JVP whose tangent is itself a linear recurrence,
  dh_t = a_t dh_{t-1} + (da_t h_{t-1} + db_t), run in the same mode; reverse mode
  transposes it into one reverse recurrence lambda_t = g_t + a_{t+1} lambda_{t+1}, then
  da_t = lambda_t h_{t-1}, db_t = lambda_t, dh0 = a_0 lambda_0 (JAX's convention: no
  complex conjugation). The sequential mode's gradient keeps only `a`, `h` and `h0`, as
  `lax.scan` autodiff does. bfloat16/float16 inputs accumulate in float32.

  Args:
    a: decay, real or complex, broadcastable to `b` without changing `b`'s shape: per step
      and feature `(..., T, ...)`, per feature `(D,)`, time-invariant scalar `()`. Or a
      tuple of such factors whose product is the decay, e.g. `(discounts, lambda_)`: the
      sequential mode multiplies them step by step instead of storing the product.
    b: input `(..., T, ...)` with time on `axis`, real or complex.
    h0: initial state, `b`'s shape without the time axis; default zeros.
    reset: optional booleans lined up with the leading axes of `b`: shaped `b.shape[:k]`
      for some k > `axis` (time included), broadcast over the axes after them, e.g.
      `(T,)` or `(T, B)` for `b` of shape `(T, B, D)`, `(B, T)` for `(B, T, D)` with
      `axis=1`; axes of size 1 broadcast as well. True clears the state before that step.
    reverse: run from the last step to the first.
    axis: time axis of `b` (and of `a` once right-aligned with `b`, and of `reset`).
    mode: "auto", "sequential", "parallel" or "chunked" (see `ssmkit.scan.Mode`).
    chunk_size: chunk length for the chunked mode; default about sqrt(T).
    inner: in-chunk strategy of the chunked mode: "sequential", "parallel" or "cumsum".
      "cumsum" is the closed form h = P * cumsum(b / P) with P the running product of `a`
      inside the chunk. It is only safe while |P| stays far from underflow over a chunk:
      about chunk_size * max(-log|a_t|) < 20 in float32 (80 in float64); an `a_t` of 0, or
      decays that reach 1e-38 within a chunk, give Inf/NaN. It cannot take `reset`.
    return_final_state: also return the last state (h_{T-1}; h_0 when `reverse`), to
      continue the recurrence over the next piece of a long sequence.
    axis_name: sequence parallelism. Inside `jax.shard_map` with the time axis of `a`,
      `b` and `reset` split over the mesh axis of this name (consecutive slices of equal
      length in mesh order), return this device's slice of the recurrence over the whole
      sequence. Each device reduces its slice to the map h -> A h + B, the maps are
      all-gathered (P maps of a state or two each, for P devices), and each device runs
      its slice from the state the maps before it produce; gradients flow back through
      the same collectives. `h0` is read on the device holding the first step (the last
      when `reverse`), and the final state is the whole sequence's, the same on every
      device. Any `mode` runs the local slices.
    overwrite_b: a speed hint for the sequential mode, which never changes the result:
      write each state over `b` instead of into a new buffer. That saves a pass over
      memory when `b` is computed inside the same jitted program and read nowhere else
      (`b = x @ B` in a layer); when `b` is an argument of the program or still read
      later, XLA copies it first, which costs more than it saves. The states are written
      over a moved or cast copy of `b` anyway.

  Returns:
    `h` with `b`'s shape and the promoted dtype of `a` and `b` (and of `h0` where it is
    wider than float32); with `return_final_state`, the tuple `(h, h_final)`, `h_final`
    in the accumulation dtype (float32 for 16-bit inputs), ready to pass on as `h0`.

  Raises:
    TypeError: for an integer `a`, `b` or `h0`, or a non-boolean `reset`.
    ValueError: for shapes that do not fit `b`, an out-of-range `axis`, an unknown `mode`
      or `inner`, or an `axis_name` that is not a mesh axis of an enclosing `shard_map`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.scan import linear_recurrence
    >>> linear_recurrence(jnp.full(4, 0.5), jnp.ones(4))
    Array([1.   , 1.5  , 1.75 , 1.875], dtype=float32)
    >>> linear_recurrence(0.5, jnp.ones(4), reset=jnp.array([False, False, True, False]))
    Array([1. , 1.5, 1. , 1.5], dtype=float32)

  References:
    Martin & Cundy, "Parallelizing linear recurrent neural nets over sequence length",
    ICLR 2018; Blelloch, "Prefix sums and their applications", 1990.
  """
  p = _prepare(a, b, h0, reset, reverse, axis, mode, chunk_size, inner, axis_name, overwrite_b)
  if p.b.shape[0] == 0:
    h, h_last = p.b, _zeros_if_none(p.h0, jnp.zeros((1, *p.b.shape[1:]), p.b.dtype))
  elif axis_name is None:
    h, h_last = _recurrence(p.cfg, p.a, p.b, p.h0, p.reset)
  else:
    h, h_last = _across_devices(p.cfg, p.a, p.b, p.h0, p.reset, axis_name, states=True)
  h = jnp.moveaxis(h, 0, p.axis).astype(p.out_dtype)
  if return_final_state:
    return h, h_last
  return h


def linear_recurrence_final_state(
    a: Array | tuple[Array, ...],
    b: Array,
    h0: Array | None = None,
    *,
    reset: Array | None = None,
    reverse: bool = False,
    axis: int = 0,
    mode: str | Mode = "auto",
    chunk_size: int | None = None,
    axis_name: Hashable | None = None,
) -> Array:
  """The last state of `linear_recurrence`, without keeping the T intermediate states.

  Same arguments and semantics as `linear_recurrence`. The forward pass stores one state
  (one per chunk in the chunked and parallel modes); the gradient recomputes the states.
  With `axis_name`, the last state of the whole sequence split over that mesh axis, the
  same on every device; each device reduces its slice and one all-gather joins them.

  Returns:
    h_{T-1} (h_0 when `reverse`), shaped like `b` without its time axis, in the
    accumulation dtype (float32 for 16-bit inputs).

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.scan import linear_recurrence_final_state
    >>> linear_recurrence_final_state(jnp.full(4, 0.5), jnp.ones(4), h0=jnp.array(8.0))
    Array(2.375, dtype=float32)
  """
  p = _prepare(a, b, h0, reset, reverse, axis, mode, chunk_size, None, axis_name)
  if p.b.shape[0] == 0:
    return _zeros_if_none(p.h0, jnp.zeros((1, *p.b.shape[1:]), p.b.dtype))
  if axis_name is None:
    return _final(p.cfg, p.a, p.b, p.h0, p.reset)
  return _across_devices(p.cfg, p.a, p.b, p.h0, p.reset, axis_name, states=False)
