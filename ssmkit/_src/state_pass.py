"""The maps that carry a recurrence's state across chunks or devices, and how they combine.

A chunk (or a device's slice of time) is summarised by the affine map it applies to the
state entering it, S -> A S + U, where a reset inside it cuts S off (S -> U). A is a decay
that scales the state elementwise (a diagonal recurrence's `(..., D)`; the rows of a
`(K, V)` matrix state, `(..., 1, 1)` one per head, `(..., K, 1)` one per key: linear
attention) or a `(K, K)` matrix (the delta rule). Maps compose associatively, so they can
be run one after another, as a tree (`lax.associative_scan`), or across the devices of a
mesh axis.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src.engine import axis_position, from_device

Array = jax.Array


class Maps(NamedTuple):
  """Maps S -> A S + U, one per batch row and head, and per chunk or device.

  One map per row and head is `(Z, H, ...)`; one per chunk keeps the chunk axis third,
  `(Z, H, n, ...)`; the maps of all devices, gathered, lead with the device axis.

  Attributes:
    a: `(Z, H, [n,] K, 1)`/`(Z, H, [n,] 1, 1)` row decays, or `(Z, H, [n,] K, K)` matrices.
    u: `(Z, H, [n,] K, V)` the state the map gives for a zero entering state.
    cut: `(Z, 1[, n])` True where the map ignores the entering state, or None.
  """

  a: Array
  u: Array
  cut: Array | None


def _times(a: Array, s: Array, matrix: bool, precision) -> Array:
  if matrix:
    return jnp.einsum("...ij,...jv->...iv", a, s, precision=precision)
  return a * s


def _flags(cut: Array, like: Array) -> Array:
  return cut.reshape(cut.shape + (1,) * (like.ndim - cut.ndim))


def cut_off(cut: Array | None, s: Array) -> Array:
  """`s` zeroed where `cut`: selected before a product with A, so that neither the product nor
  A's gradient (the zero cotangent of a cut map times `s`) sees a NaN in `s`."""
  return s if cut is None else jnp.where(_flags(cut, s), jnp.zeros_like(s), s)


def apply(m: Maps, s: Array, *, matrix: bool, precision=None) -> Array:
  """A S + U, or U where cut: a selection, so a NaN in `s` stays out of a cut map."""
  new = _times(m.a, cut_off(m.cut, s), matrix, precision) + m.u
  return new if m.cut is None else jnp.where(_flags(m.cut, new), m.u, new)


def compose(first: Maps, second: Maps, *, matrix: bool, precision=None) -> Maps:
  """The map of `first` then `second`."""
  a = _times(second.a, cut_off(second.cut, first.a), matrix, precision)
  u = _times(second.a, cut_off(second.cut, first.u), matrix, precision) + second.u
  if second.cut is None:
    return Maps(a, u, None)
  return Maps(
      jnp.where(_flags(second.cut, a), second.a, a),
      jnp.where(_flags(second.cut, u), second.u, u),
      first.cut | second.cut,
  )


def chunk(maps: Maps, i: int) -> Maps:
  """The map of chunk `i` of `(Z, H, n, ...)` maps."""
  return Maps(*(None if x is None else x[:, :, i] for x in maps))


def _prefixes(maps: Maps, matrix: bool, precision) -> Maps:
  """Every prefix composition of `(Z, H, n, ...)` maps, as a tree of depth log n."""
  combine = lambda x, y: tuple(compose(Maps(*x), Maps(*y), matrix=matrix, precision=precision))
  return Maps(*lax.associative_scan(combine, tuple(maps), axis=2))


def run(maps: Maps, state: Array, *, matrix: bool, precision=None) -> tuple[Array, Array]:
  """The states entering each of n chunks and the state after the last, as a tree.

  Args:
    maps: the chunks' maps, `(Z, H, n, ...)`.
    state: `(Z, H, K, V)` state entering the first chunk.
    matrix: whether `maps.a` are `(K, K)` matrices (else row decays).
    precision: matmul precision of the matrix maps.

  Returns:
    `(entering, final)`: `(Z, H, n, K, V)` states entering each chunk, and `(Z, H, K, V)`.
  """
  state = state[:, :, None]
  leaving = apply(_prefixes(maps, matrix, precision), state, matrix=matrix,
                  precision=precision)
  return jnp.concatenate([state, leaving[:, :, :-1]], axis=2), leaving[:, :, -1]


def fold(maps: Maps, *, matrix: bool, precision=None) -> Maps:
  """The map of all the `(Z, H, n, ...)` maps one after another."""
  return chunk(_prefixes(maps, matrix, precision), -1)


# Up to this many devices along the mesh axis, `across_devices` all-gathers the maps (one
# collective); past it, it combines them in log2(devices) rounds of `ppermute`, holding one map
# instead of one per device. On 8 host devices both took the same time at 2, 4 and 8 devices
# (`ssmkit bench sequence-parallel`, docs/sequence_parallel.md).
GATHER_MAX_DEVICES = 8


def _shifted(x, axis_name: Hashable, size: int, shift: int, reverse: bool):
  """`x` of the device `shift` places before this one in scan order (zeros where none is)."""
  pairs = [(j, j - shift) for j in range(shift, size)] if reverse else [
      (j, j + shift) for j in range(size - shift)]
  return jax.tree.map(lambda a: lax.ppermute(a, axis_name, pairs), x)


def _gathered_states(device: Maps, index: Array, *, matrix: bool, axis_name: Hashable,
                     reverse: bool, precision) -> tuple[Array, Array]:
  """`(entering, final)` from all-gathered maps, composed in scan order on every device."""

  def body(s, m):
    return apply(m, s, matrix=matrix, precision=precision), s

  gathered = lax.all_gather(device, axis_name)
  final, incoming = lax.scan(body, jnp.zeros_like(gathered.u[0]), gathered, reverse=reverse)
  return incoming[index], final


def _log_depth_states(device: Maps, index: Array, size: int, *, matrix: bool,
                      axis_name: Hashable, reverse: bool, precision) -> tuple[Array, Array]:
  """`(entering, final)` by a Hillis-Steele scan over the devices: in round r each device
  composes the map it holds after the map of the device 2^r places before it, so after
  log2(size) rounds it holds the map of every slice up to its own, and one map in memory."""
  position = size - 1 - index if reverse else index
  prefix = device
  shift = 1
  while shift < size:
    earlier = _shifted(prefix, axis_name, size, shift, reverse)
    joined = compose(earlier, prefix, matrix=matrix, precision=precision)
    take = position >= shift
    prefix = Maps(jnp.where(take, joined.a, prefix.a), jnp.where(take, joined.u, prefix.u),
                  None if prefix.cut is None else jnp.where(take, joined.cut, prefix.cut))
    shift *= 2
  # The first device's map carries the initial state, so each prefix gives the state after
  # its slice from a zero state: its `u`.
  entering = _shifted(prefix.u, axis_name, size, 1, reverse)
  final = from_device(prefix.u, position == size - 1, axis_name)
  return entering, final


def across_devices(
    device: Maps, state: Array, *, matrix: bool, axis_name: Hashable, precision=None,
    reverse: bool = False, combine: str | None = None,
) -> tuple[Array, Array]:
  """The state entering this device's slice, and the state after the whole sequence.

  `device` is the map of this device's slice of time along the mesh axis `axis_name`.
  The device holding the first slice (the last when `reverse`) applies it to `state` (so the
  initial state enters once), then the maps are composed in scan order: all-gathered (a
  map per device in memory, one product per device to apply them) up to
  `GATHER_MAX_DEVICES` devices, past that in log2(devices) rounds of `ppermute` (one map in
  memory, two products per round). `combine` ("gather" or "ppermute") overrides the choice.
  Autodiff runs through the collectives.

  Returns:
    `(entering, final)`, each shaped like `state`; `final` is the same on every device.
  """
  index, size = axis_position(axis_name)
  entry = index == (size - 1 if reverse else 0)
  # The state is zeroed off the entry device before the product, for the same reason as in
  # `cut_off`: a NaN initial state must not reach the other devices' gradients.
  own = apply(device, jnp.where(entry, state, jnp.zeros_like(state)), matrix=matrix,
              precision=precision)
  device = device._replace(u=jnp.where(entry, own, device.u))
  if combine is None:
    combine = "gather" if size <= GATHER_MAX_DEVICES else "ppermute"
  if combine not in ("gather", "ppermute"):
    raise ValueError(f"`combine` must be 'gather' or 'ppermute', got {combine!r}.")
  run = _gathered_states if combine == "gather" else functools.partial(_log_depth_states, size=size)
  entering, final = run(device, index, matrix=matrix, axis_name=axis_name, reverse=reverse,
                        precision=precision)
  if combine == "gather":
    # Every device composed the same final state: the entry device's is the one to return.
    final = from_device(final, entry, axis_name)
  return jnp.where(entry, state, entering), final
