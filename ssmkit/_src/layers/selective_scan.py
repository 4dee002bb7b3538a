"""Mamba's selective scan (S6) with the output contraction fused into the recurrence.

h_t = exp(dt_t A) h_{t-1} + (dt_t u_t) B_t and y_t = h_t C_t, without the `(..., T, D, N)`
decays, inputs and states that running `linear_recurrence` and contracting afterwards stores.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src import checks
from ssmkit._src.linear_recurrence import accumulation_dtype, linear_recurrence
from ssmkit._src.modes import Mode, default_chunk_size, parse_mode, resolve_mode

Array = jax.Array
# Inside, time leads in chunks and batch axes are flattened: u, dt `(n, L, B, D)`, b, c
# `(n, L, B, N)`, reset `(n, L, B)` or None; states are `(B, N, D)` (D last: it vectorises
# better than N, and the contraction with C becomes a sum over a middle axis).
Chunks = tuple[Array, Array, Array, Array, Array | None]


def _advance(a_t: Array, h: Array, step: tuple) -> tuple[Array, Array]:
  """One step from `(B, N, D)` state `h`: (h_{t-1} after the reset, h_t)."""
  u, dt, b, _, reset = step
  if reset is not None:
    h = jnp.where(reset[:, None, None], jnp.zeros_like(h), h)
  decay = jnp.exp(dt[:, None, :] * a_t[None])
  return h, decay * h + b[:, :, None] * (dt * u)[:, None, :]


def _contract(h: Array, c: Array) -> Array:
  """y = sum_n h[:, n, :] * c[:, n] for `(..., N, D)` states and `(..., N)` c."""
  return jnp.sum(h * c[..., None], axis=-2)


def _run(a_t: Array, h: Array, xs: tuple) -> tuple[Array, Array]:
  """(last state, y) of the steps in `xs`, time leading, from state `h`."""

  def step(h, x_t):
    h = _advance(a_t, h, x_t)[1]
    return h, _contract(h, x_t[3])

  return lax.scan(step, h, xs)


@jax.custom_vjp
def _fused(a_t: Array, h0: Array, xs: Chunks) -> tuple[Array, Array]:
  """(y `(n, L, B, D)`, last state) one step at a time; the gradient replays one chunk at a time.

  Without a gradient the steps run as one loop over time, which is faster than a loop over
  chunks of loops.
  """
  last, y = _run(a_t, h0, jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), xs))
  return y.reshape(xs[0].shape), last


def _fused_fwd(a_t, h0, xs):
  """Runs chunk by chunk and keeps the `(n, B, N, D)` state entering each chunk."""

  def chunk(h, xs_c):
    last, y = _run(a_t, h, xs_c)
    return last, (y, h)

  last, (y, starts) = lax.scan(chunk, h0, xs)
  return (y, last), (a_t, xs, starts)


def _fused_bwd(residuals, cotangents):
  """Per chunk, last first: replay its states from the stored start, then step back.

  With lam_t the cotangent of h_t (g_t C_t plus what flows back from h_{t+1}) and q_t =
  lam_t * exp(dt_t A) * h_{t-1}: dC_t = sum_d g_t h_t, dB_t = sum_d lam_t dt_t u_t,
  du_t = dt_t sum_n lam_t B_t, ddt_t = sum_n q_t A + u_t sum_n lam_t B_t, dA = sum q_t dt_t.
  dA is accumulated per batch element (an elementwise update) and summed at the end.
  """
  a_t, xs, starts = residuals
  g_y, g_last = cotangents

  def chunk(carry, inputs):
    start, xs_c, g_c = inputs

    def replay(h, inputs):
      x_t, g_t = inputs
      h_prev, h = _advance(a_t, h, x_t)
      return h, (h_prev, jnp.sum(h * g_t[:, None, :], axis=-1))

    _, (h_prev, dc) = lax.scan(replay, start, (xs_c, g_c))

    def back(carry, inputs):
      lam, da = carry
      (u, dt, b, c, reset), g_t, h_prev_t = inputs
      lam = lam + c[:, :, None] * g_t[:, None, :]
      dx = jnp.sum(lam * b[:, :, None], axis=1)
      db = jnp.sum(lam * (dt * u)[:, None, :], axis=2)
      lam_prev = jnp.exp(dt[:, None, :] * a_t[None]) * lam
      q = lam_prev * h_prev_t
      ddt = jnp.sum(q * a_t[None], axis=1) + dx * u
      da = da + q * dt[:, None, :]
      if reset is not None:
        lam_prev = jnp.where(reset[:, None, None], jnp.zeros_like(lam_prev), lam_prev)
      return (lam_prev, da), (dx * dt, ddt, db)

    carry, (du, ddt, db) = lax.scan(back, carry, (xs_c, g_c, h_prev), reverse=True)
    return carry, (du, ddt, db, dc)

  (dh0, da), (du, ddt, db, dc) = lax.scan(chunk, (g_last, jnp.zeros_like(g_last)),
                                          (starts, xs, g_y), reverse=True)
  return jnp.sum(da, axis=0), dh0, (du, ddt, db, dc, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _materialised(a_t: Array, h0: Array, xs: Chunks) -> tuple[Array, Array]:
  """Per chunk, the `(L, B, N, D)` decays and inputs through `linear_recurrence`'s parallel
  mode, then contracted; the gradient recomputes a chunk's states instead of storing them."""

  @jax.checkpoint
  def chunk(h, xs_c):
    u, dt, b, c, reset = xs_c
    decay = jnp.exp(dt[:, :, None, :] * a_t[None, None])
    inputs = b[..., None] * (dt * u)[:, :, None, :]
    flags = None if reset is None else reset[..., None, None]
    states, last = linear_recurrence(decay, inputs, h, reset=flags, mode="parallel",
                                     return_final_state=True)
    return last, _contract(states, c)

  last, y = lax.scan(chunk, h0, xs)
  return y, last


def _check_real(x: Array, name: str) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"`{name}` must have a real floating dtype, got {x.dtype}.")


def selective_scan(
    u: Array,
    dt: Array,
    a: Array,
    b: Array,
    c: Array,
    *,
    h0: Array | None = None,
    reset: Array | None = None,
    chunk_size: int | None = None,
    mode: str | Mode = "auto",
) -> tuple[Array, Array]:
  """Mamba's selective scan: y_t = sum_n h_t[:, n] c_t[n] with
  h_t = exp(dt_t[:, None] * a) * h_{t-1} + (dt_t * u_t)[:, None] * b_t[None, :].

  Time is split into chunks of at most `chunk_size` steps (as equal as possible; the tail
  is padded with steps that leave the state unchanged). Only the state entering each chunk
  is kept for the gradient, which recomputes one chunk's states at a time: memory grows
  with T / chunk_size + chunk_size states, not T.

  Args:
    u: `(..., T, D)` inputs.
    dt: `(..., T, D)` steps.
    a: `(D, N)` continuous-time state matrix (diagonal per channel, negative in Mamba).
    b: `(..., T, N)` input projections.
    c: `(..., T, N)` output projections.
    h0: optional `(..., D, N)` state before the first step; default zeros.
    reset: optional `(..., T)` booleans; True clears the state before that step (by
      selection, so a NaN or Inf state never reaches the steps after a reset).
    chunk_size: most steps per chunk; default about sqrt(T) (see `default_chunk_size`).
    mode: "sequential" runs one step at a time, contracting with `c` inside the step, with a
      hand-written gradient (fastest on CPU). "chunked" runs each chunk's `(L, ..., D, N)`
      recurrence through `lax.associative_scan` and carries the state from chunk to chunk;
      "parallel" does so over the whole sequence as one chunk (`chunk_size` unused, T
      states in memory). "auto" is "sequential" on CPU and for T <= 64, else "chunked".

  Returns:
    `(y, last_state)`: `(..., T, D)` outputs and the `(..., D, N)` state after the last
    step (`h0` when T = 0), in the promoted dtype of the inputs (16-bit floats accumulate
    in float32).

  Raises:
    TypeError: for inputs that are not real floating or a non-boolean `reset`.
    ValueError: for shapes that do not fit `u` and `a`, a non-positive `chunk_size` or an
      unknown `mode`.
  """
  u, dt, a, b, c = (jnp.asarray(x) for x in (u, dt, a, b, c))
  for x, name in ((u, "u"), (dt, "dt"), (a, "a"), (b, "b"), (c, "c")):
    _check_real(x, name)
  if u.ndim < 2:
    raise ValueError(f"`u` must be `(..., T, D)`, got shape {u.shape}.")
  if a.ndim != 2:
    raise ValueError(f"`a` must be `(D, N)`, got shape {a.shape}.")
  *batch, length, d = u.shape
  batch, n = tuple(batch), a.shape[1]
  checks.check_shape(dt, u.shape, "dt", "the shape of `u`")
  checks.check_shape(a, (d, n), "a", "`(D, N)`, D the last axis of `u`")
  checks.check_shape(b, (*batch, length, n), "b", "`(..., T, N)`")
  checks.check_shape(c, (*batch, length, n), "c", "`(..., T, N)`")
  dtype = jnp.result_type(u, dt, a, b, c)
  if h0 is not None:
    h0 = jnp.asarray(h0)
    _check_real(h0, "h0")
    checks.check_shape(h0, (*batch, d, n), "h0", "`(..., D, N)`")
    dtype = jnp.result_type(dtype, h0)
  if reset is not None:
    reset = jnp.asarray(reset)
    checks.check_bool(reset, "reset")
    checks.check_shape(reset, u.shape[:-1], "reset", "`u` without its feature axis")
  checks.check_chunk_size(chunk_size)
  mode = resolve_mode(parse_mode(mode), length)
  acc = accumulation_dtype(dtype)
  h0 = jnp.zeros((*batch, d, n), acc) if h0 is None else h0.astype(acc)
  if length == 0:
    return jnp.zeros(u.shape, dtype), h0.astype(dtype)

  steps = length if mode is Mode.PARALLEL else min(chunk_size or default_chunk_size(length), length)
  chunks = -(-length // steps)
  steps = -(-length // chunks)
  flat = math.prod(batch)

  def split(x: Array) -> Array:
    """`(..., T, F)` -> `(chunks, steps, B, F)`, the tail padded with zeros (False)."""
    x = jnp.moveaxis(x.reshape(flat, length, x.shape[-1]), 1, 0)
    x = jnp.pad(x, ((0, chunks * steps - length), (0, 0), (0, 0)))
    return x.reshape(chunks, steps, flat, x.shape[-1])

  xs = (*(split(x.astype(acc)) for x in (u, dt, b, c)),
        None if reset is None else split(reset[..., None])[..., 0])
  state = jnp.swapaxes(h0.reshape(flat, d, n), 1, 2)
  run = _fused if mode is Mode.SEQUENTIAL else _materialised
  y, last = run(jnp.transpose(a).astype(acc), state, xs)
  y = jnp.moveaxis(y.reshape(chunks * steps, flat, d)[:length], 0, 1).reshape(u.shape)
  return y.astype(dtype), jnp.swapaxes(last, 1, 2).reshape(h0.shape).astype(dtype)
