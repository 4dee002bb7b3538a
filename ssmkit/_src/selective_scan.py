"""Mamba's selective scan (S6) with the output contraction fused into the recurrence.

h_t = exp(dt_t A) h_{t-1} + (dt_t u_t) B_t and y_t = h_t C_t, without the `(..., T, D, N)`
decays, inputs and states that running `linear_recurrence` and contracting afterwards stores.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src import checks, state_pass
from ssmkit._src.engine import axis_position, from_device, vary_alike
from ssmkit._src.linear_recurrence import linear_recurrence, nonzero_tangents, output_and_state_dtypes
from ssmkit._src.modes import Mode, default_chunk_size, parse_mode

Array = jax.Array
# Inside, time leads in chunks and batch axes are flattened: u, dt `(n, L, B, D)`, b, c
# `(n, L, B, N)`, reset `(n, L, B)` or None; states are `(B, N, D)` (D last: it vectorises
# better than N, and the contraction with C becomes a sum over a middle axis).
Chunks = tuple[Array, Array, Array, Array]


def _advance(a_t: Array, h: Array, u: Array, dt: Array, b: Array, reset: Array | None) -> Array:
  """The `(B, N, D)` state after one step from `h`.

  `a_t` is `(N, D)`, or `(B, N, D)` when broadcast over the batch.
  """
  if reset is not None:
    h = jnp.where(reset[:, None, None], jnp.zeros_like(h), h)
  decay = jnp.exp(dt[:, None, :] * a_t.reshape((1,) * (3 - a_t.ndim) + a_t.shape))
  return decay * h + b[:, :, None] * (dt * u)[:, None, :]


def _step(a_t: Array, h: Array, u: Array, dt: Array, b: Array, c: Array,
          reset: Array | None) -> tuple[Array, Array]:
  """One step from `(B, N, D)` state `h`: the next state and the `(B, D)` output."""
  h = _advance(a_t, h, u, dt, b, reset)
  return h, jnp.sum(h * c[..., None], axis=-2)


def _run(a_t: Array, h: Array, xs: tuple) -> tuple[Array, Array]:
  """(last state, y) of the steps in `xs`, time leading, from state `h`."""
  return lax.scan(lambda h, x_t: _step(a_t, h, *x_t), h, xs)


@jax.custom_jvp
def _fused(a_t: Array, h0: Array, xs: Chunks, reset: Array | None) -> tuple[Array, Array]:
  """(y `(n, L, B, D)`, last state) one step at a time.

  Without derivatives the steps run as one loop over time, which is faster than a loop
  over chunks of loops.
  """
  merge = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
  last, y = _run(a_t, h0, (*map(merge, xs), None if reset is None else merge(reset)))
  return y.reshape(xs[0].shape), last


@functools.partial(_fused.defjvp, symbolic_zeros=True)
def _fused_jvp(primals, tangents):
  """States and their tangents advance together, one chunk at a time.

  Each chunk is checkpointed: reverse mode (JAX transposing these tangents) keeps only the
  `(n, B, N, D)` state entering each chunk and replays one chunk's states at a time, so the
  `(..., T, D, N)` states are never all stored.
  """
  a_t, h0, xs, reset = primals
  da_t, dh0, dxs, _ = nonzero_tangents(tangents)
  dh0 = jnp.zeros_like(h0) if dh0 is None else dh0
  if da_t is not None:
    # Per batch element, so the gradient accumulates dA elementwise, step by step, and sums
    # over the batch once at the end.
    a_t, da_t = (jnp.broadcast_to(x, h0.shape) for x in (a_t, da_t))

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def step(carry, inputs):
    h, dh = carry
    x_t, dx_t, r_t = inputs
    args, targs = (a_t, h, *x_t), (da_t, dh, *dx_t)
    keep = [i for i, t in enumerate(targs) if t is not None]

    def moving(*values):
      full = list(args)
      for i, v in zip(keep, values, strict=True):
        full[i] = v
      return _step(*full, r_t)

    (h, y), (dh, dy) = jax.jvp(moving, [args[i] for i in keep], [targs[i] for i in keep])
    return (h, dh), (y, dy)

  @jax.checkpoint
  def chunk(carry, inputs):
    return lax.scan(step, carry, inputs)

  (last, dlast), (y, dy) = lax.scan(chunk, (h0, dh0), (xs, dxs, reset))
  return (y, last), (dy, dlast)


def _materialised(a_t: Array, h0: Array, xs: Chunks, reset: Array | None) -> tuple[Array, Array]:
  """Per chunk, the `(L, B, N, D)` decays and inputs through `linear_recurrence`'s parallel
  mode, then contracted; the gradient recomputes a chunk's states instead of storing them."""

  @jax.checkpoint
  def chunk(h, inputs):
    (u, dt, b, c), reset = inputs
    decay = jnp.exp(dt[:, :, None, :] * a_t[None, None])
    inputs = b[..., None] * (dt * u)[:, :, None, :]
    states, last = linear_recurrence(decay, inputs, h, reset=reset, mode="parallel",
                                     return_final_state=True)
    return last, jnp.sum(states * c[..., None], axis=-2)

  last, y = lax.scan(chunk, h0, (xs, reset))
  return y, last


def _last_state(a_t: Array, h0: Array, xs: Chunks, reset: Array | None) -> Array:
  """The state after the steps of `xs` from `h0`, without outputs; the gradient recomputes one
  chunk's states at a time."""

  @jax.checkpoint
  def chunk(h, inputs):
    (u, dt, b, _), reset = inputs
    return lax.scan(lambda h, x_t: (_advance(a_t, h, *x_t), None), h, (u, dt, b, reset))[0], None

  return lax.scan(chunk, h0, (xs, reset))[0]


def _across_devices(run, a_t: Array, h0: Array, xs: Chunks, reset: Array | None,
                    axis_name: Hashable) -> tuple[Array, Array]:
  """`run` over this device's slice of time along the mesh axis `axis_name`, from the state
  that the slices before it leave, and the state after the whole sequence.

  Each slice is summarised by the map h -> exp(a sum(dt)) h + h_slice it applies (h_slice:
  its last state from zero; h -> h_slice when a reset cuts it), the maps are combined
  across devices (`state_pass.across_devices`), and the slice runs once from its carry.
  """
  h0, xs, reset = vary_alike((h0, xs, reset))
  flags = None if reset is None else jnp.any(reset, axis=(0, 1))
  total = jnp.exp(jnp.sum(xs[1], axis=(0, 1))[:, None, :] * a_t[None])
  own = state_pass.Maps(total, _last_state(a_t, jnp.zeros_like(h0), xs, reset), flags)
  entering, last = state_pass.across_devices(own, h0, matrix=False, axis_name=axis_name)
  return run(a_t, entering, xs, reset)[0], last


def _resolve(mode: Mode, length: int) -> Mode:
  """`auto`: the fused loop on CPU (the fastest there) and for T <= 64, else chunked.

  Not the rule of `linear_recurrence`: the parallel mode holds the `(..., T, D, N)` states
  of the whole sequence at once, a chunk's worth of them is enough.
  """
  if mode is not Mode.AUTO:
    return mode
  return Mode.SEQUENTIAL if jax.default_backend() == "cpu" or length <= 64 else Mode.CHUNKED


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
    axis_name: Hashable | None = None,
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
    axis_name: sequence parallelism. Inside `jax.shard_map` with the time axis of `u`, `dt`,
      `b`, `c` and `reset` split over the mesh axis of this name (consecutive slices of equal
      length in mesh order), each device returns its slice of the outputs of the whole
      sequence, and the state after its last step, the same on every device. `h0` is read
      on the device holding the first slice. Each slice's state map crosses devices, one
      `(..., D, N)` state each; the slice is scanned twice (once for its map).

  Returns:
    `(y, last_state)`: `(..., T, D)` outputs and the `(..., D, N)` state after the last
    step (`h0` when T = 0). The outputs have the promoted dtype of the inputs (and of `h0`
    where it is wider than float32); the state has the accumulation dtype (float32 for
    16-bit inputs, in which they accumulate), ready to pass on as `h0`.

  Raises:
    TypeError: for inputs that are not real floating or a non-boolean `reset`.
    ValueError: for shapes that do not fit `u` and `a`, a non-positive `chunk_size` or an
      unknown `mode`.
  """
  u, dt, a, b, c = (checks.real_floating(x, name)
                    for x, name in ((u, "u"), (dt, "dt"), (a, "a"), (b, "b"), (c, "c")))
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
  if h0 is not None:
    h0 = checks.real_floating(h0, "h0")
    checks.check_shape(h0, (*batch, d, n), "h0", "`(..., D, N)`")
  if reset is not None:
    reset = jnp.asarray(reset)
    checks.check_bool(reset, "reset")
    checks.check_shape(reset, u.shape[:-1], "reset", "`u` without its feature axis")
  checks.check_chunk_size(chunk_size)
  if axis_name is not None:
    axis_position(axis_name)
  mode = _resolve(parse_mode(mode), length)
  dtype, acc = output_and_state_dtypes(jnp.result_type(u, dt, a, b, c), h0)
  h0 = jnp.zeros((*batch, d, n), acc) if h0 is None else h0.astype(acc)
  if length == 0:
    if axis_name is not None:
      h0 = from_device(h0, axis_position(axis_name)[0] == 0, axis_name)
    return jnp.zeros(u.shape, dtype), h0

  steps = length if mode is Mode.PARALLEL else min(chunk_size or default_chunk_size(length), length)
  chunks = -(-length // steps)
  steps = -(-length // chunks)
  flat = math.prod(batch)

  def split(x: Array) -> Array:
    """`(..., T, F)` -> `(chunks, steps, B, F)`, the tail padded with zeros (False)."""
    x = jnp.moveaxis(x.reshape(flat, length, x.shape[-1]), 1, 0)
    x = jnp.pad(x, ((0, chunks * steps - length), (0, 0), (0, 0)))
    return x.reshape(chunks, steps, flat, x.shape[-1])

  xs = tuple(split(x.astype(acc)) for x in (u, dt, b, c))
  flags = None if reset is None else split(reset[..., None])[..., 0]
  state = jnp.swapaxes(h0.reshape(flat, d, n), 1, 2)
  run = _fused if mode is Mode.SEQUENTIAL else _materialised
  a_t = jnp.transpose(a).astype(acc)
  if axis_name is None:
    y, last = run(a_t, state, xs, flags)
  else:
    y, last = _across_devices(run, a_t, state, xs, flags, axis_name)
  y = jnp.moveaxis(y.reshape(chunks * steps, flat, d)[:length], 0, 1).reshape(u.shape)
  return y.astype(dtype), jnp.swapaxes(last, 1, 2).reshape(h0.shape)
