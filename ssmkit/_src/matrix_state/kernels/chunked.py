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
from jax.experimental.pallas import triton as pl_triton

from ssmkit._src.matrix_state.inputs import Inputs
from ssmkit._src.matrix_state.kernels import routed

Array = jax.Array
F32 = jnp.float32

ChunkForward = Callable[[dict[str, Array], Array], tuple[Array, Array]]
ChunkBackward = Callable[[dict[str, Array], Array, Array, Array], tuple[dict[str, Array], Array]]

# The steps per chunk unless the caller asks for others.
DEFAULT_CHUNK = 64
# Triton's lowering (Pallas' default on NVIDIA GPUs is Mosaic GPU, which stages whole blocks in
# shared memory: a sequence of one head does not fit there).
_TRITON = pl_triton.CompilerParams(num_warps=4, num_stages=1)


# The inputs with one head per group of `groups` heads (of v, of the state and of the grid).
SHARED = ("q", "k")


def _spec(a: Array, groups: int = 1) -> pl.BlockSpec:
  """A whole sequence of one (batch row, head): `(Z, T, H, ...)` arrays (head h // `groups` of
  an array of H / groups heads), or `(Z, T)` ones shared by the heads."""
  if a.ndim == 2:
    return pl.BlockSpec((None, a.shape[1]), lambda z, h: (z, 0))
  rest = a.shape[3:]
  return pl.BlockSpec((None, a.shape[1], None, *rest),
                      lambda z, h: (z, 0, h // groups, *(0,) * len(rest)))


def _in_specs(names: tuple[str, ...], arrays: tuple[Array, ...], groups: int) -> list:
  return [_spec(a, groups if name in SHARED else 1) for name, a in zip(names, arrays, strict=True)]


def _state_spec(state: Array) -> pl.BlockSpec:
  return pl.BlockSpec((None, None, *state.shape[2:]), lambda z, h: (z, h, 0, 0))


def _load(refs: dict, start, size: int) -> dict[str, Array]:
  return {name: ref[pl.ds(start, size)].astype(F32) for name, ref in refs.items()}


def _forward_call(step: ChunkForward, names: tuple[str, ...], arrays: tuple[Array, ...],
                  state: Array, dim_v: int, size: int, groups: int,
                  interpret: bool) -> tuple[Array, Array]:
  z, length = arrays[0].shape[:2]
  heads = state.shape[1]

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
      kernel, grid=(z, heads), interpret=interpret, compiler_params=_TRITON,
      in_specs=[*_in_specs(names, arrays, groups), _state_spec(state)],
      out_specs=[out_spec, _state_spec(state)],
      out_shape=[jax.ShapeDtypeStruct((z, length, heads, dim_v), F32),
                 jax.ShapeDtypeStruct(state.shape, F32)],
  )(*arrays, state)


def _backward_call(step: ChunkForward, step_back: ChunkBackward, names: tuple[str, ...],
                   arrays: tuple[Array, ...], state: Array, d_out: Array, d_state: Array,
                   size: int, groups: int, interpret: bool) -> tuple[tuple[Array, ...], Array]:
  """The cotangents of the arrays, those of `SHARED` ones per head of the state (to be summed
  over each group), and of the state."""
  z, length = arrays[0].shape[:2]
  heads = state.shape[1]
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

  by_name = {name: jax.ShapeDtypeStruct((z, length, heads, *a.shape[3:]) if name in SHARED
                                         else a.shape, F32)
             for name, a in zip(names, arrays, strict=True)}
  kept = pl.BlockSpec((None, None, n, *state.shape[2:]), lambda z, h: (z, h, 0, 0, 0))
  *grads, d_state0, _ = pl.pallas_call(
      kernel, grid=(z, heads), interpret=interpret, compiler_params=_TRITON,
      in_specs=[*_in_specs(names, arrays, groups), _state_spec(state), _spec(d_out),
                _state_spec(state)],
      out_specs=[*(_spec(by_name[name]) for name in differentiated), _state_spec(state), kept],
      out_shape=[*(by_name[name] for name in differentiated),
                 jax.ShapeDtypeStruct(state.shape, F32),
                 jax.ShapeDtypeStruct((z, heads, n, *state.shape[2:]), F32)],
  )(*arrays, state, d_out, d_state)
  return tuple(grads), d_state0


def decays_and_resets(x: Inputs) -> tuple[Array, Array]:
  """`x`'s log-decays (zeros, one per head, where it has none) and its resets as float flags
  (zeros where it has none), as the kernels take them."""
  g = jnp.zeros(x.v.shape[:3], x.v.dtype) if x.log_decay is None else x.log_decay
  reset = jnp.zeros(x.q.shape[:2], x.q.dtype) if x.reset is None else x.reset.astype(x.q.dtype)
  return g, reset


def inputs(x: Inputs, reset: Array, **arrays: Array | None) -> Inputs:
  """`x` with the kernels' arrays back in its fields, the float flags `reset` as booleans (None
  where `x` had none): what the XLA form takes."""
  return x._replace(**arrays, reset=None if x.reset is None else reset > 0.5)


def interpreted() -> bool:
  """Whether the kernels run in Pallas' interpreter: on every backend but NVIDIA GPUs, whose
  Triton lowering compiles them."""
  return jax.default_backend() != "gpu"


def chunk_size(length: int, requested: int | None) -> int:
  """The kernels' chunk, a power of two from 16 (`_width`): the largest not above `requested`
  (default 64), or for a shorter sequence the smallest that holds it."""
  most = 1 << max((requested or DEFAULT_CHUNK).bit_length() - 1, 4)
  return min(most, max(16, 1 << max(length - 1, 0).bit_length()))


def run(step: ChunkForward, step_back: ChunkBackward, arrays: dict[str, Array], state: Array,
        size: int, fallback: Callable[..., tuple[Array, Array]]) -> tuple[Array, Array]:
  """Outputs `(Z, T, H, V)` and final state of a recurrence by the kernels, differentiable in
  reverse mode.

  Args:
    step, step_back: the recurrence's chunk functions (module docstring).
    arrays: its inputs by name, `(Z, T, H[, D])` float32, "reset" `(Z, T)` float32 and "v"
      among them, those of `SHARED` with H / G heads (value head h reads head h // G); padded
      here with zeros to whole chunks (zero steps must leave the state as it is) and channels
      to powers of two (`_width`).
    state: `(Z, H, K, V)` the state before the first step.
    size: steps per chunk.
    fallback: the XLA form, `fallback(*arrays.values(), state) -> (outputs, final state)`,
      for inputs or cotangents with a non-finite entry (`routed`).
  """
  names = tuple(arrays)
  length = arrays["v"].shape[1]
  groups = state.shape[1] // arrays["q"].shape[2]
  interpret = interpreted()
  extra = -length % size

  def pad(a: Array) -> Array:
    """Whole chunks, and channels (the last axis of `(Z, T, H, D)`) to a power of two."""
    widths = [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2)
    if a.ndim == 4:
      widths[3] = (0, _width(a.shape[3]) - a.shape[3])
    return jnp.pad(a, widths)

  def pad_state(s: Array) -> Array:
    return jnp.pad(s, [(0, 0), (0, 0), *((0, _width(d) - d) for d in s.shape[2:])])

  def cut(a: Array, like: Array) -> Array:
    return a[:, :length, ..., :like.shape[-1]] if like.ndim == 4 else a[:, :length]

  cut_state = lambda s: s[:, :, :state.shape[2], :state.shape[3]]

  def by_kernel(*values):
    *inputs, s0 = values
    out, last = _forward_call(step, names, tuple(map(pad, inputs)), pad_state(s0),
                              _width(arrays["v"].shape[3]), size, groups, interpret)
    return cut(out, arrays["v"]), cut_state(last)

  def by_kernel_backward(*values):
    *inputs, s0, d_out, d_state = values
    grads, d_s0 = _backward_call(step, step_back, names, tuple(map(pad, inputs)), pad_state(s0),
                                 pad(d_out), pad_state(d_state), size, groups, interpret)
    grads = iter(grads)

    def gradient(name: str, a: Array) -> Array:
      if name == "reset":
        return jnp.zeros_like(a)
      g = cut(next(grads), a)
      if name in SHARED:  # summed over the group of heads that read it
        g = g.reshape((*a.shape[:3], groups, a.shape[3])).sum(axis=3)
      return g

    return (*(gradient(name, a) for name, a in arrays.items()), cut_state(d_s0))

  return routed.routed(by_kernel, by_kernel_backward, fallback, *arrays.values(), state)


def _width(channels: int) -> int:
  """Channels padded to a power of two from 16: Triton's lowering takes no other shapes, and
  its matrix products no dimension below 16. Zero channels of keys, queries, values and
  per-key decays change nothing: their rows and columns of the state stay zero."""
  return max(16, 1 << (channels - 1).bit_length())
