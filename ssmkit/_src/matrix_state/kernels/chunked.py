"""The kernels' frame: one Pallas program per (batch row, head) walks the chunks of its sequence.

A recurrence gives two functions of one chunk (float32 values, C steps):

  forward(x, S) -> (outputs (C, V), S'),
  backward(x, S, d_outputs, dS') -> (cotangents of x's differentiable arrays, dS),

with `x` the chunk's arrays by name (`(C, ...)`; "reset" `(C,)`, 1.0 where the state is cleared).
The forward program carries S through the chunks in float32. The backward program walks them
forward once more to keep the state entering each chunk (in an output buffer, one state per
chunk, as flash-linear-attention keeps h), then back, carrying dS and recomputing each chunk's
intermediate values from its entering state: nothing but the inputs is kept from the forward
pass.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ssmkit._src.matrix_state.kernels import routed

Array = jax.Array
F32 = jnp.float32

ChunkForward = Callable[[dict[str, Array], Array], tuple[Array, Array]]
ChunkBackward = Callable[[dict[str, Array], Array, Array, Array], tuple[dict[str, Array], Array]]

# The steps per chunk unless the caller asks for others.
DEFAULT_CHUNK = 64


def _spec(a: Array) -> pl.BlockSpec:
  """A whole sequence of one (batch row, head): `(Z, T, H, ...)` arrays, or `(Z, T)` ones
  shared by the heads."""
  if a.ndim == 2:
    return pl.BlockSpec((None, a.shape[1]), lambda z, h: (z, 0))
  rest = a.shape[3:]
  return pl.BlockSpec((None, a.shape[1], None, *rest), lambda z, h: (z, 0, h, *(0,) * len(rest)))


def _state_spec(state: Array) -> pl.BlockSpec:
  return pl.BlockSpec((None, None, *state.shape[2:]), lambda z, h: (z, h, 0, 0))


def _load(refs: dict, start, size: int) -> dict[str, Array]:
  return {name: ref[pl.ds(start, size)].astype(F32) for name, ref in refs.items()}


def _forward_call(step: ChunkForward, names: tuple[str, ...], arrays: tuple[Array, ...],
                  state: Array, dim_v: int, size: int, interpret: bool) -> tuple[Array, Array]:
  z, length, heads = arrays[0].shape[:3]

  def kernel(*refs):
    inputs = dict(zip(names, refs[:len(names)], strict=True))
    s0_ref, o_ref, s_ref = refs[len(names):]

    def chunk(c, s):
      start = pl.multiple_of(c * size, size)
      out, s = step(_load(inputs, start, size), s)
      o_ref[pl.ds(start, size)] = out
      return s

    s_ref[...] = lax.fori_loop(0, length // size, chunk, s0_ref[...].astype(F32))

  out_spec = pl.BlockSpec((None, length, None, dim_v), lambda z, h: (z, 0, h, 0))
  return pl.pallas_call(
      kernel, grid=(z, heads), interpret=interpret,
      in_specs=[*map(_spec, arrays), _state_spec(state)], out_specs=[out_spec, _state_spec(state)],
      out_shape=[jax.ShapeDtypeStruct((z, length, heads, dim_v), F32),
                 jax.ShapeDtypeStruct(state.shape, F32)],
  )(*arrays, state)


def _backward_call(step: ChunkForward, step_back: ChunkBackward, names: tuple[str, ...],
                   arrays: tuple[Array, ...], state: Array, d_out: Array, d_state: Array,
                   size: int, interpret: bool) -> tuple[tuple[Array, ...], Array]:
  z, length, heads = arrays[0].shape[:3]
  n = length // size
  differentiated = tuple(name for name in names if name != "reset")

  def kernel(*refs):
    inputs = dict(zip(names, refs[:len(names)], strict=True))
    s0_ref, do_ref, dsn_ref = refs[len(names):len(names) + 3]
    outputs = refs[len(names) + 3:]
    grads = dict(zip(differentiated, outputs[:len(differentiated)], strict=True))
    ds0_ref, states_ref = outputs[len(differentiated):]

    def forward(c, s):
      states_ref[c] = s
      return step(_load(inputs, pl.multiple_of(c * size, size), size), s)[1]

    lax.fori_loop(0, n, forward, s0_ref[...].astype(F32))

    def backward(j, ds):
      c = n - 1 - j
      start = pl.multiple_of(c * size, size)
      chunk_grads, ds = step_back(_load(inputs, start, size), states_ref[c],
                                  do_ref[pl.ds(start, size)].astype(F32), ds)
      for name, ref in grads.items():
        ref[pl.ds(start, size)] = chunk_grads[name]
      return ds

    ds0_ref[...] = lax.fori_loop(0, n, backward, dsn_ref[...].astype(F32))

  by_name = dict(zip(names, arrays, strict=True))
  kept = pl.BlockSpec((None, None, n, *state.shape[2:]), lambda z, h: (z, h, 0, 0, 0))
  *grads, d_state0, _ = pl.pallas_call(
      kernel, grid=(z, heads), interpret=interpret,
      in_specs=[*map(_spec, arrays), _state_spec(state), _spec(d_out), _state_spec(state)],
      out_specs=[*(_spec(by_name[name]) for name in differentiated), _state_spec(state), kept],
      out_shape=[*(jax.ShapeDtypeStruct(by_name[name].shape, F32) for name in differentiated),
                 jax.ShapeDtypeStruct(state.shape, F32),
                 jax.ShapeDtypeStruct((z, heads, n, *state.shape[2:]), F32)],
  )(*arrays, state, d_out, d_state)
  return tuple(grads), d_state0


def chunk_size(length: int, requested: int | None) -> int:
  """The kernels' chunk: `requested` (default 64), or for a shorter sequence the power of two
  from 16 that holds it."""
  return min(requested or DEFAULT_CHUNK, max(16, 1 << max(length - 1, 0).bit_length()))


def run(step: ChunkForward, step_back: ChunkBackward, arrays: dict[str, Array], state: Array,
        size: int, fallback: Callable[..., tuple[Array, Array]]) -> tuple[Array, Array]:
  """Outputs `(Z, T, H, V)` and final state of a recurrence by the kernels, differentiable in
  reverse mode.

  Args:
    step, step_back: the recurrence's chunk functions (module docstring).
    arrays: its inputs by name, `(Z, T, H, ...)` float32, "reset" `(Z, T)` float32 and "v"
      among them; padded here to whole chunks (padding steps must leave the state as it is
      when zero).
    state: `(Z, H, K, V)` the state before the first step.
    size: steps per chunk.
    fallback: the XLA form, `fallback(*arrays.values(), state) -> (outputs, final state)`,
      for inputs or cotangents with a non-finite entry (`routed`).
  """
  names = tuple(arrays)
  length = arrays["v"].shape[1]
  dim_v = arrays["v"].shape[3]
  interpret = jax.default_backend() != "gpu"
  extra = -length % size
  pad = lambda a: jnp.pad(a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2))
  cut = lambda a: a[:, :length]

  def by_kernel(*values):
    *padded, s0 = values
    out, last = _forward_call(step, names, tuple(map(pad, padded)), s0, dim_v, size, interpret)
    return cut(out), last

  def by_kernel_backward(*values):
    *padded, s0, d_out, d_state = values
    grads, d_s0 = _backward_call(step, step_back, names, tuple(map(pad, padded)), s0, pad(d_out),
                                 d_state, size, interpret)
    grads = iter(map(cut, grads))
    return (*(jnp.zeros_like(a) if name == "reset" else next(grads)
              for name, a in arrays.items()), d_s0)

  return routed.routed(by_kernel, by_kernel_backward, fallback, *arrays.values(), state)

