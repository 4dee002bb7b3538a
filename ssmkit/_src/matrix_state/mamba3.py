"""Mamba-3's recurrence: an exponential-trapezoidal input, a rotary (complex-valued) state and
rank-R inputs and outputs, as linear attention over folded keys plus a per-token correction."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src import checks
from ssmkit._src.engine import axis_position, from_device, with_next_slice
from ssmkit._src.linear_recurrence import accumulation_dtype, linear_recurrence
from ssmkit._src.matrix_state import chunks
from ssmkit._src.matrix_state.delta_product import at_step, interleave
from ssmkit._src.matrix_state.linear_attention import linear_attention
from ssmkit._src.modes import Mode

Array = jax.Array
ROTARY_LAYOUTS = ("interleaved", "halves")


class Mamba3State(NamedTuple):
  """What Mamba-3's recurrence carries from one token to the next.

  Attributes:
    state: `(..., H, N, P)` the matrix state S (keys by values).
    angle: `(..., H, S)` the cumulative rotation angles theta.
    key: the last token's rotated keys, `(..., H, N)`, or `(..., R, H, N)` with R ranks.
    value: the last token's values, `(..., H, P)`, or `(..., R, H, P)`.
  """

  state: Array
  angle: Array
  key: Array
  value: Array


def _check(q, k, v, log_decay, step_size, trapezoid, angle_rate, rotary, reset):
  q, k, v, log_decay, step_size, trapezoid = (
      checks.real_floating(x, name) for x, name in (
          (q, "q"), (k, "k"), (v, "v"), (log_decay, "log_decay"), (step_size, "step_size"),
          (trapezoid, "trapezoid")))
  if log_decay.ndim < 2:
    raise ValueError(f"`log_decay` must be `(..., T, H)`, got shape {log_decay.shape}.")
  heads = log_decay.shape
  if q.ndim not in (log_decay.ndim + 1, log_decay.ndim + 2):
    raise ValueError(f"`q` must be `(..., T, H, N)` or `(..., T, R, H, N)` for `log_decay` "
                     f"{heads}, got shape {q.shape}.")
  mimo = q.ndim == log_decay.ndim + 2
  if q.shape[:-1] != (*heads[:-1], *q.shape[-3:-2][:mimo], heads[-1]):
    raise ValueError(f"`q` must be `(..., T, {'R, ' if mimo else ''}H, N)` with the leading "
                     f"shape {heads} of `log_decay`, got {q.shape}.")
  checks.check_shape(k, q.shape, "k", "the shape of `q`")
  if v.shape[:-1] != q.shape[:-1]:
    raise ValueError(f"`v` must be `{'(..., T, R, H, P)' if mimo else '(..., T, H, P)'}` with "
                     f"the leading shape {q.shape[:-1]} of `q`, got {v.shape}.")
  checks.check_shape(step_size, heads, "step_size", "(..., T, H): the shape of `log_decay`")
  checks.check_shape(trapezoid, heads, "trapezoid", "(..., T, H): the shape of `log_decay`")
  if angle_rate is not None:
    angle_rate = checks.real_floating(angle_rate, "angle_rate")
    if angle_rate.shape[:-1] != heads or 2 * angle_rate.shape[-1] > q.shape[-1]:
      raise ValueError(f"`angle_rate` must be `(..., T, H, S)` with the leading shape {heads} "
                       f"and 2 S <= N = {q.shape[-1]}, got {angle_rate.shape}.")
  if rotary not in ROTARY_LAYOUTS:
    raise ValueError(f"`rotary` must be one of {ROTARY_LAYOUTS}, got {rotary!r}.")
  if reset is not None:
    reset = jnp.asarray(reset)
    checks.check_bool(reset, "reset")
    checks.check_shape(reset, heads[:-1], "reset", "(..., T): the leading shape of `log_decay`")
  return q, k, v, log_decay, step_size, trapezoid, angle_rate, reset, mimo


def _check_state(state, q, v, log_decay, angle_rate, mimo) -> Mamba3State:
  """`state` as a `Mamba3State` of the shapes these inputs carry."""
  batch, heads = log_decay.shape[:-2], log_decay.shape[-1]
  ranks = q.shape[-3:-2] if mimo else ()
  angles = 0 if angle_rate is None else angle_rate.shape[-1]
  expected = Mamba3State((*batch, heads, q.shape[-1], v.shape[-1]), (*batch, heads, angles),
                         (*batch, *ranks, heads, q.shape[-1]), (*batch, *ranks, heads, v.shape[-1]))
  if not isinstance(state, tuple) or len(state) != 4:
    raise ValueError(f"`initial_state` must be a `Mamba3State` (state, angle, key, value), got "
                     f"{type(state).__name__}.")
  state = Mamba3State(*(checks.real_floating(s, f"initial_state.{name}")
                        for s, name in zip(state, Mamba3State._fields, strict=True)))
  if tuple(s.shape for s in state) != tuple(expected):
    raise ValueError(f"`initial_state` must have the shapes {expected} for these inputs, got "
                     f"{Mamba3State(*(s.shape for s in state))}.")
  return state


def rotate(x: Array, angle: Array, layout: str) -> Array:
  """`x` `(..., N)` with channel pairs turned by `angle` `(..., S)`, 2 S <= N: pairs
  (2i, 2i + 1) ("interleaved") or (i, i + N / 2) ("halves") for i < S; the other channels
  are left as they are."""
  return _turn(x, jnp.cos(angle), jnp.sin(angle), layout)


def _turn(x: Array, cos: Array, sin: Array, layout: str) -> Array:
  """`rotate` by the angles whose cosines and sines are given."""
  n, s = x.shape[-1], cos.shape[-1]
  if layout == "interleaved":
    first, second = x[..., 0:2 * s:2], x[..., 1:2 * s:2]
    turned = jnp.stack([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return jnp.concatenate([turned.reshape(*x.shape[:-1], 2 * s), x[..., 2 * s:]], axis=-1)
  half = n // 2
  first, second = x[..., :s], x[..., half:half + s]
  return jnp.concatenate([first * cos - second * sin, x[..., s:half],
                          first * sin + second * cos, x[..., half + s:]], axis=-1)


# Steps per block of the cumulative angles: their sums inside a block stay small.
_ANGLE_BLOCK = 64


def _cumulative_turns(rate: Array, start: Array, reset: Array | None, axis: int,
                      mode: str | Mode, axis_name: Hashable | None) -> tuple[Array, Array, Array]:
  """cos and sin of theta_t = theta_{t-1} + rate_t (from 0 after a reset), and the last
  theta in [0, 2 pi).

  A sum of the angles over the whole sequence would grow with t and lose their float32
  precision (at theta ~ 1e4 its spacing is 1e-3). So the sequence is cut into blocks of
  `_ANGLE_BLOCK` steps: inside a block the angles are summed from its start (or its last
  reset), and the blocks' turns exp(i theta) are carried from block to block as unit
  complex numbers by `linear_recurrence` (every mode and `axis_name` as there), whose angle
  in (-pi, pi] starts the next block. A recurrence over every step of unit complex numbers
  held five complex copies of the angles in the gradient and ran a step at a time.
  """
  length = rate.shape[axis]
  size = min(_ANGLE_BLOCK, length)
  blocks = -(-length // size)
  pad = lambda x: jnp.pad(x, [(0, 0)] * axis + [(0, blocks * size - length)]
                          + [(0, 0)] * (x.ndim - axis - 1))
  lead, tail = rate.shape[:axis], rate.shape[axis + 1:]
  # (P, C, Q): the blocks of C steps, in place (no transposes)
  x = pad(rate).reshape((math.prod(lead) * blocks, size, math.prod(tail)))
  carried = None  # (P, C, 1): no reset in the block up to the step
  cut = None  # (..., n): a reset in the block
  flags = None
  if reset is not None:
    flags = pad(reset).reshape(x.shape[:2])
    carried = (lax.cummax(flags.astype(jnp.int32), axis=1) == 0)[..., None]
    cut = jnp.any(flags, axis=1).reshape((*lead, blocks))
  # Summed from the block's start or its last reset, by selection: a NaN before a reset
  # meets no product (a sum by a triangle of ones would) on its way to the steps after it.
  local = linear_recurrence(jnp.ones_like(x), x, jnp.zeros_like(x[:, 0]), reset=flags,
                            axis=1, mode=mode)
  by_block = lambda a: a.reshape((*lead, blocks, *tail))  # (P, Q) -> (..., n, H, S)
  turn = jnp.exp(1j * by_block(local[:, -1]))  # each block's own turn
  entry = jnp.zeros_like(turn) if cut is None else jnp.where(cut[..., None, None], turn, 0)
  first = jnp.exp(1j * start)
  phase, final = linear_recurrence(turn, entry, first, reset=cut, axis=axis, mode=mode,
                                   return_final_state=True, axis_name=axis_name)
  entering = jnp.angle(_after_previous(phase, first, axis, axis_name)).reshape(x.shape[0], 1, -1)
  theta = local + (entering if carried is None else jnp.where(carried, entering, 0))
  # In a loop (of 8 rounds, however long the sequence): its outputs are computed once. As
  # plain elementwise operations XLA fuses the cosines and sines into every product that
  # reads them, once per channel (the gradient took 80 ms against 72 ms at B=2 T=4096 H=4
  # N=64, CPU).
  cos, sin = lax.map(lambda a: (jnp.cos(a), jnp.sin(a)), theta,
                     batch_size=-(-theta.shape[0] // 8))
  cos, sin = (lax.slice_in_dim(a.reshape((*lead, blocks * size, *tail)), 0, length, axis=axis)
              for a in (cos, sin))
  return cos, sin, jnp.mod(jnp.angle(final), 2 * jnp.pi)


def _next_step(x: Array, axis: int, axis_name: Hashable | None) -> Array:
  """x_{t+1} at t along `axis`: the next device's first step at the end of a slice, zero past
  the end of the sequence."""
  length = x.shape[axis]
  if length == 0:
    return x
  shifted = jnp.concatenate([lax.slice_in_dim(x, 1, length, axis=axis),
                             jnp.zeros_like(lax.slice_in_dim(x, 0, 1, axis=axis))], axis)
  if axis_name is None:
    return shifted
  return with_next_slice(shifted, x, 1, axis, axis_name)


def _after_previous(x: Array, first: Array, axis: int, axis_name: Hashable | None) -> Array:
  """x_{t-1} at t along `axis`: the previous device's last step at the start of a slice,
  `first` on the first slice."""
  last = lax.index_in_dim(x, x.shape[axis] - 1, axis, keepdims=False)
  if axis_name is not None:
    index, size = axis_position(axis_name)
    received = lax.ppermute(last, axis_name, [(j, (j + 1) % size) for j in range(size)])
    first = jnp.where(index == 0, first, received)
  return jnp.concatenate([jnp.expand_dims(first, axis),
                          lax.slice_in_dim(x, 0, x.shape[axis] - 1, axis=axis)], axis)


def _pairs(a: Array, b: Array, w: Array, mimo: bool, precision) -> Array:
  """The products of a token's rows of `a` and `b`, weighted per token by `w` `(..., T, H)`:
  `(..., T, H)`, or `(..., T, H, R, R)` with R ranks."""
  row, col = ("r", "s") if mimo else ("", "")
  return jnp.einsum(f"...{row}hn,...{col}hn->...h{row}{col}", a, b, precision=precision,
                    preferred_element_type=w.dtype) * w[(...,) + (None,) * (2 * mimo)]


def _mix(w: Array, x: Array, mimo: bool, precision) -> Array:
  """Each token's rows of `x` combined by `w` as `_pairs` makes it."""
  row, col = ("r", "s") if mimo else ("", "")
  return jnp.einsum(f"...h{row}{col},...{col}hp->...{row}hp", w, x.astype(w.dtype),
                    precision=precision)


def _mimo_reads(q: Array, k: Array, v: Array, log_decay: Array, share: Array, reset: Array | None,
                entry: Array, time: int, axis_name: Hashable | None, options: dict
                ) -> tuple[Array, Array | None]:
  """Each MIMO row's read of the state before its token's writes, exp(log_decay_t) q_{t,r}
  S_{t-1}, and the final state (None unless `options` asks for it); `share` `(..., T, H)`
  weighs each token's keys.

  A token's R rows are R interleaved steps of `linear_attention`, the decay at the first. Step
  (t, r) holds the next token's query of row r, so it reads the state after token t's rows
  up to r; the rows after r are added and the reads shifted back by one token. No row reads
  a write of its own token: nothing is added and taken back.
  """
  ranks, precision = q.shape[time + 1], options["precision"]
  reading = jnp.exp(log_decay.astype(share.dtype))[..., None, :, None] * q
  if reset is not None:  # nothing earlier to read (by selection, so that a NaN before the
    # reset meets no product on its way back)
    reading = chunks.masked(reading, ~reset)
  ahead = _next_step(reading, time, axis_name)
  steps = lambda x: interleave(x, ranks, time)
  out = linear_attention(
      steps(ahead), steps(share[..., None, :, None] * k), steps(v),
      at_step(log_decay, ranks, 0, time), initial_state=entry,
      reset=None if reset is None else at_step(reset, ranks, 0, time), **options)
  read, final = out if options["return_final_state"] else (out, None)
  read = read.reshape(v.shape)
  if ranks > 1:
    upper = jnp.triu(jnp.ones((ranks, ranks), bool), 1)
    read = read + _mix(jnp.where(upper, _pairs(ahead, k, share, True, precision), 0), v, True,
                       precision)
  if read.shape[time]:
    first = lax.index_in_dim(reading, 0, time, keepdims=False)
    before = jnp.einsum("...rhn,...hnp->...rhp", first, entry, precision=precision)
    read = _after_previous(read, before, time, axis_name)
    if reset is not None:
      read = chunks.masked(read, ~reset)
  return read, final


def mamba3(
    q,
    k,
    v,
    log_decay,
    step_size,
    trapezoid,
    angle_rate=None,
    *,
    rotary: str = "interleaved",
    initial_state: Mamba3State | None = None,
    reset=None,
    mode: str | Mode = "auto",
    chunk_size: int | None = None,
    return_final_state: bool = False,
    axis_name: Hashable | None = None,
    precision: lax.PrecisionLike = None,
    check_values: bool = True,
):
  """Mamba-3's recurrence: exponential-trapezoidal inputs, rotary state, SISO or MIMO.

  Per head, with a `(N, P)` state S, keys k_t (B), queries q_t (C) and values v_t (x),
  decay alpha_t = exp(log_decay_t) (A_t dt_t), step dt_t and trapezoid weight lambda_t:

    theta_t = theta_{t-1} + angle_rate_t,    k~_t = R(theta_t) k_t,    q~_t = R(theta_t) q_t,
    S_t = alpha_t (S_{t-1} + (1 - lambda_t) dt_t k~_{t-1}^T v_{t-1}) + lambda_t dt_t k~_t^T v_t,
    o_t = q~_t S_t.

  lambda = 1 is Mamba-2's (exponential-Euler) rule; the previous token's term enters with
  its own rotated key. R(theta) turns pairs of key channels by the angles theta (S of them
  for N channels, 2 S <= N): a complex-valued state written in real numbers. With R ranks
  (MIMO), each token writes sum_r k~_{t,r}^T v_{t,r} and reads o_{t,r} = q~_{t,r} S_t.
  `reset` starts a new sequence: S, theta and the previous token are dropped.

  This is `linear_attention` with each token's key scaled by lambda_t dt_t plus the next
  token's (1 - lambda_{t+1}) dt_{t+1} and each token reading the state before its own write
  (`exclusive`; with R ranks, each token's state read by the next token's query), so no token
  reads its own write, which would have to be taken back and cancel in float32; plus each
  token's own current share and, with R ranks, the rows' writes to each other. So every
  mode, streaming and `axis_name` work as there (the next token's share, with R ranks the
  next token's query and the previous token's read, and the last token's key and value cross
  devices by `ppermute` and `psum`). The D skip,
  gates and projections are the layer's (`ssmkit.layers.Mamba3`).

  Args:
    q: `(..., T, H, N)` queries (C), or `(..., T, R, H, N)` with R ranks (MIMO).
    k: keys (B), `q`'s shape.
    v: values (x), `(..., T, H, P)` or `(..., T, R, H, P)`.
    log_decay: `(..., T, H)` log of the decay, A_t dt_t <= 0.
    step_size: `(..., T, H)` dt_t.
    trapezoid: `(..., T, H)` lambda_t, the current token's share of the step (in [0, 1]).
    angle_rate: None (no rotation) or `(..., T, H, S)` the angle increments
      theta_t - theta_{t-1} (the layer's pi tanh(.) dt_t).
    rotary: which channels turn together: "interleaved" pairs (2i, 2i + 1) (the reference's
      SISO layer) or "halves" (i, i + N / 2) (its MIMO layer).
    initial_state: a `Mamba3State` before the first token; default zeros.
    reset: `(..., T)` booleans; True starts a new sequence at that token.
    mode: as in `linear_attention`.
    chunk_size: steps per chunk, R per token; default `linear_attention`'s.
    return_final_state: also return the `Mamba3State` after the last token.
    axis_name: sequence parallelism as in `linear_attention`, tokens split over the devices.
    precision: precision of the matrix products (`jax.lax.Precision`).
    check_values: whether to refuse a positive `log_decay`, a negative `step_size` or a
      `trapezoid` outside [0, 1] (or non-finite values of these) known at trace time, as
      `delta_rule`'s `check_log_decay` does; the layer, whose values are in range by
      construction, passes False.

  Returns:
    `o`, `v`'s shape, in the dtype of q, k and v (bfloat16 inputs accumulate in float32);
    with `return_final_state`, `(o, Mamba3State)`, the state in the accumulation dtype.

  Raises:
    TypeError: for integer or complex inputs, or a non-boolean `reset`.
    ValueError: for shapes that do not fit `log_decay` and each other, values out of range
      known at trace time (`check_values`), or an unknown `rotary`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.scan import mamba3
    >>> ones = jnp.ones((2, 1))  # T=2, one head
    >>> k = jnp.ones((2, 1, 1))  # N=1
    >>> v = jnp.array([[[2.0]], [[4.0]]])
    >>> # half of each token's write at it, half at the next: 0.5 * 2, then 2 + 0.5 * 4
    >>> mamba3(k, k, v, 0 * ones, ones, 0.5 * ones)[:, 0, 0]
    Array([1., 4.], dtype=float32)

  References:
    Lahoti et al., "Mamba-3: improved sequence modeling using state space principles",
    2026 (arXiv:2603.15569); state-spaces/mamba, `mamba3_siso_step_ref` and
    `mamba3_MIMO_step_ref` in `tests/ops/`.
  """
  q, k, v, log_decay, step_size, trapezoid, angle_rate, reset, mimo = _check(
      q, k, v, log_decay, step_size, trapezoid, angle_rate, rotary, reset)
  if check_values:
    checks.check_log_decay(log_decay)
    checks.check_known_values(step_size, "step_size", low=0.0, meaning=" (a step dt_t)")
    checks.check_known_values(trapezoid, "trapezoid", low=0.0, high=1.0,
                              meaning=" (lambda_t, the current token's share of the step)")
  time = log_decay.ndim - 2
  if initial_state is not None:
    initial_state = _check_state(initial_state, q, v, log_decay, angle_rate, mimo)
  # MIMO's ranks are an axis after time; one rank has none: a unit axis made XLA's CPU
  # reductions in the gradient (multiply and sum over N) 60 times slower.
  rank_axis = (time + 1,) if mimo else ()
  row = "r" if mimo else ""  # einsum letter of the rank axis
  length = q.shape[time]
  out_dtype = jnp.result_type(q, k, v)
  dtype = accumulation_dtype(jnp.result_type(q, k, v, log_decay, step_size, trapezoid))
  heads = log_decay.shape
  zeros = lambda *shape: jnp.zeros(shape, dtype)
  start = initial_state
  if start is None:
    s = 0 if angle_rate is None else angle_rate.shape[-1]
    start = Mamba3State(zeros(*heads[:-2], heads[-1], q.shape[-1], v.shape[-1]),
                        zeros(*heads[:-2], heads[-1], s), zeros(*q.shape[:time], *q.shape[time + 1:]),
                        zeros(*v.shape[:time], *v.shape[time + 1:]))

  now = (trapezoid * step_size).astype(dtype)
  # A token's own write, its current share, read with its rows unturned: one rotation turns
  # them all and (R q) . (R k) = q . k, so the turned rows are kept for nothing else.
  own = _mix(_pairs(q, k, now, mimo, precision), v, mimo, precision)
  angle = start.angle
  if angle_rate is not None and length:
    cos, sin, angle = _cumulative_turns(angle_rate.astype(dtype), start.angle, reset, time,
                                        mode, axis_name)
    cos, sin = (jnp.expand_dims(x, rank_axis) for x in (cos, sin))
    q, k = (_turn(x.astype(dtype), cos, sin, rotary) for x in (q, k))

  previous = ((1 - trapezoid) * step_size).astype(dtype)
  if reset is not None:  # no previous token to write after a reset
    previous = jnp.where(reset[..., None], jnp.zeros_like(previous), previous)
  later = _next_step(previous, time, axis_name)  # the share of each token the next one writes
  prior = jnp.einsum(f"...{row}hn,...{row}hp->...hnp", start.key, start.value)
  entry = start.state
  if length:
    first = lambda x: lax.index_in_dim(x, 0, time, keepdims=False)
    if reset is not None:
      prior, entry = (jnp.where(first(reset)[..., None, None, None], jnp.zeros_like(x), x)
                      for x in (prior, entry))
    entry = entry + first(previous)[..., None, None] * prior
  options = dict(mode=mode, chunk_size=chunk_size, return_final_state=return_final_state,
                 axis_name=axis_name, precision=precision, check_log_decay=False)
  if mimo:
    read, final = _mimo_reads(q, k, v, log_decay, now + later, reset, entry, time, axis_name,
                              options)
  else:
    # Token t reads the state before its own write, exp(log_decay_t) q_t S_{t-1}, so that no
    # token reads its own write and the next token's share of it (which would then have to
    # be taken back, cancelling in float32).
    out = linear_attention(q, k, v, log_decay, beta=now + later, initial_state=entry,
                           reset=reset, exclusive=True, **options)
    read, final = out if return_final_state else (out, None)
  o = (read + own).astype(out_dtype)
  if not return_final_state:
    return o
  key, value = start.key, start.value
  if length:
    key, value = (lax.index_in_dim(x, length - 1, time, keepdims=False).astype(dtype)
                  for x in (k, v))
    if axis_name is not None:  # the last slice's
      index, size = axis_position(axis_name)
      key, value = (from_device(x, index == size - 1, axis_name) for x in (key, value))
  return o, Mamba3State(final, angle, key, value)
