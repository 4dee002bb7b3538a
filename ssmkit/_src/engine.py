"""The scan engine: one associative operator, run sequentially, in parallel, chunked, or over devices."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src import checks
from ssmkit._src.modes import (
    Inner,
    Mode,
    default_chunk_size,
    default_inner,
    parse_inner,
    parse_mode,
    resolve_mode,
)
from ssmkit._src.operators import identity_of

PyTree = Any
Fn = Callable[[PyTree, PyTree], PyTree]


def _take(tree: PyTree, index) -> PyTree:
  return jax.tree.map(lambda x: x[index], tree)


def _concat(trees: list[PyTree]) -> PyTree:
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *trees)


def vary_alike(tree: PyTree) -> PyTree:
  """Every leaf of `tree` cast to vary over each manual mesh axis that any leaf varies over.

  Inside `shard_map`, a `lax.scan` carry must vary like the elements combined into it (a
  constant identity, such as the unit matrix of `matrix_affine`, varies over no axis), and
  a custom VJP must return cotangents that vary like its inputs (a replicated decay used
  on sharded inputs gets a per-device cotangent, summed over devices by the cast's
  transpose). Outside `shard_map` nothing varies and `tree` is returned as it is.
  """
  leaves = jax.tree.leaves(tree)
  axes = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in leaves))

  def cast(x):
    missing = axes - jax.typeof(x).manual_axis_type.varying
    return lax.pcast(x, tuple(missing), to="varying") if missing else x

  return jax.tree.map(cast, tree)


def _identity_carry(fn: Fn, elems: PyTree) -> PyTree:
  """The identity of `fn` shaped like one element of `elems`, to start a scan carry."""
  first = _take(elems, 0)
  return vary_alike((identity_of(fn)(first), first))[0]


def _sequential(fn: Fn, elems: PyTree, reverse: bool) -> PyTree:
  """`lax.scan` over the leading axis; the carry is the prefix accumulated so far."""

  def body(carry, x):
    carry = fn(carry, x)
    return carry, carry

  if identity_of(fn) is not None:
    _, ys = lax.scan(body, _identity_carry(fn, elems), elems, reverse=reverse)
    return ys
  first = -1 if reverse else 0
  rest = slice(None, -1) if reverse else slice(1, None)
  head = _take(elems, first)
  _, ys = lax.scan(body, head, _take(elems, rest), reverse=reverse)
  head = jax.tree.map(lambda x: x[None], head)
  return _concat([ys, head] if reverse else [head, ys])


ChunkScanner = Callable[[PyTree, bool], PyTree]


def chunk_scanner(fn: Fn, inner: Inner) -> ChunkScanner:
  """Scans every chunk of a pytree with leaves `(n, C, ...)` along axis 1."""
  if inner is Inner.PARALLEL:
    return lambda chunks, reverse: lax.associative_scan(fn, chunks, reverse=reverse, axis=1)

  def scan(chunks, reverse):
    swapped = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), chunks)
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), _sequential(fn, swapped, reverse))

  return scan


def _apply_carry(fn: Fn, carry: PyTree, ys: PyTree) -> PyTree:
  """`fn(carry, y)` for every y along axis 1 of `ys`; `carry` has one entry per chunk."""
  carry = jax.tree.map(lambda c, y: jnp.broadcast_to(jnp.expand_dims(c, 1), y.shape), carry, ys)
  return fn(carry, ys)


def _chunked(
    fn: Fn, elems: PyTree, reverse: bool, chunk_size: int, scan_chunks: ChunkScanner
) -> PyTree:
  """Scan inside chunks, a sequential scan over chunk totals, one fix-up with the carries.

  Chunks are aligned to the start of the scan (the end when `reverse`); the remainder of
  a length that is not a multiple of `chunk_size` is scanned as one short chunk.
  """
  length = jax.tree.leaves(elems)[0].shape[0]
  size = min(chunk_size, length)
  n, r = divmod(length, size)
  main_part = slice(r, None) if reverse else slice(None, n * size)
  tail_part = slice(None, r) if reverse else slice(n * size, None)
  chunks = jax.tree.map(lambda x: x[main_part].reshape((n, size, *x.shape[1:])), elems)
  ys = scan_chunks(chunks, reverse)
  totals = _take(ys, (slice(None), 0 if reverse else -1))
  if n > 1:
    head, rest = (-1, slice(None, -1)) if reverse else (0, slice(1, None))
    # carries[k] is the prefix that ends just before chunk k+1 (k-1 when reversed).
    final, carries = lax.scan(
        lambda c, t: (fn(c, t), c), _take(totals, head), _take(totals, rest), reverse=reverse
    )
    fixed = _apply_carry(fn, carries, _take(ys, rest))
    edge = _take(ys, slice(-1, None) if reverse else slice(0, 1))
    ys = _concat([fixed, edge] if reverse else [edge, fixed])
  else:
    final = _take(totals, 0)
  ys = jax.tree.map(lambda y: y.reshape((n * size, *y.shape[2:])), ys)
  if r == 0:
    return ys
  tail = jax.tree.map(lambda x: x[tail_part][None], elems)
  tail = _take(_apply_carry(fn, _take(final, None), scan_chunks(tail, reverse)), 0)
  return _concat([tail, ys] if reverse else [ys, tail])


def scan_leading(
    fn: Fn,
    elems: PyTree,
    *,
    mode: Mode,
    reverse: bool = False,
    chunk_size: int | None = None,
    inner: Inner | None = None,
    scan_chunks: ChunkScanner | None = None,
) -> PyTree:
  """Inclusive scan of `fn` along the leading axis of every leaf; `mode` is not AUTO.

  `scan_chunks` replaces the in-chunk scan of the chunked mode (default: `inner`).
  """
  length = jax.tree.leaves(elems)[0].shape[0]
  if length <= 1:
    return elems
  match mode:
    case Mode.SEQUENTIAL:
      return _sequential(fn, elems, reverse)
    case Mode.PARALLEL:
      return lax.associative_scan(fn, elems, reverse=reverse, axis=0)
    case Mode.CHUNKED:
      scan_chunks = scan_chunks or chunk_scanner(fn, inner or default_inner())
      return _chunked(fn, elems, reverse, chunk_size or default_chunk_size(length), scan_chunks)
  raise ValueError(f"scan_leading needs a concrete mode, got {mode}.")


def reduce_leading(
    fn: Fn, elems: PyTree, *, mode: Mode, reverse: bool = False, chunk_size: int | None = None
) -> PyTree:
  """The whole-sequence total of `fn` along the leading axis, storing no prefixes.

  `fn` must have an identity (it starts the fold and pads the last chunk). The
  sequential mode folds step by step; the others fold every chunk at once (one carry per
  chunk), then fold the chunk totals.
  """
  identity_like = identity_of(fn)
  length = jax.tree.leaves(elems)[0].shape[0]

  def fold(items):
    total, _ = lax.scan(
        lambda c, x: (fn(c, x), None), _identity_carry(fn, items), items, reverse=reverse
    )
    return total

  if mode is Mode.SEQUENTIAL or length <= 1:
    return fold(elems)
  size = min(chunk_size or default_chunk_size(length), length)
  n = -(-length // size)
  pad = identity_like(jax.tree.map(lambda x: x[: n * size - length], elems))
  elems = _concat([elems, pad])
  chunks = jax.tree.map(lambda x: x.reshape((n, size, *x.shape[1:])).swapaxes(0, 1), elems)
  return fold(fold(chunks))


def axis_position(axis_name: Hashable) -> tuple[jax.Array, int]:
  """This device's index along the mesh axis `axis_name`, and the size of that axis.

  Raises:
    ValueError: when `axis_name` is not an axis of an enclosing `jax.shard_map`.
  """
  try:
    size = lax.axis_size(axis_name)
  except NameError:
    raise ValueError(
        f"`axis_name`={axis_name!r} is not a mesh axis of an enclosing `jax.shard_map`: "
        "call the scan inside `shard_map` with its time axis split over that mesh axis."
    ) from None
  return lax.axis_index(axis_name), size


class _Seam(NamedTuple):
  """How this device's slice joins the scan across the devices of a mesh axis.

  Attributes:
    carry: the total of every slice before this one (after it when reversed).
    entry: whether this device holds the slice the scan starts from (no carry).
  """

  carry: PyTree
  entry: jax.Array


def _join_slices(fn: Fn, ys: PyTree, reverse: bool, axis_name: Hashable) -> tuple[PyTree, _Seam]:
  """Turns the scan `ys` of this device's slice into its part of the scan of every slice.

  The slice totals (one element per device) are all-gathered, scanned over devices, and
  the total of the slices before this one is combined into every element of `ys` (one
  elementwise fix-up). Scanning first and fixing up afterwards needs no identity, so
  every operator can be used; `linear_recurrence` takes the cheaper route of reducing
  first and scanning once from the carry.
  """
  index, size = axis_position(axis_name)
  totals = lax.all_gather(_take(ys, 0 if reverse else -1), axis_name)
  prefixes = _sequential(fn, totals, reverse)
  carry = _take(prefixes, jnp.clip(index + (1 if reverse else -1), 0, size - 1))
  entry = index == (size - 1 if reverse else 0)
  fixed = fn(jax.tree.map(lambda c, y: jnp.broadcast_to(c[None], y.shape), carry, ys), ys)
  ys = jax.tree.map(lambda y, z: jnp.where(entry, y, z), ys, fixed)
  return ys, _Seam(carry, entry)


def associative_scan(
    fn: Fn,
    elems: PyTree,
    *,
    reverse: bool = False,
    axis: int = 0,
    mode: str | Mode = "auto",
    chunk_size: int | None = None,
    inner: str | Inner | None = None,
    exclusive: bool = False,
    axis_name: Hashable | None = None,
) -> PyTree:
  """Prefix scan of an associative operator; a drop-in for `jax.lax.associative_scan`.

  Given `elems = [x0, x1, x2, ...]` along `axis`, returns `[x0, fn(x0, x1),
  fn(fn(x0, x1), x2), ...]`; with `reverse=True`, `[..., fn(fn(z, y), x), fn(z, y), z]` for
  `elems = [..., x, y, z]` (the convention of `lax.associative_scan`: the accumulated later
  elements are the first operand). Every mode returns the same result up to the
  reassociation of floating-point operations.

  Args:
    fn: associative binary operator over pytrees shaped like `elems`, elementwise over the
      scan axis and broadcasting over leading axes (every `ssmkit.scan.operators` is).
    elems: pytree of arrays that share their length along `axis`; any length, 0 included.
    reverse: scan from the end of the sequence towards its start.
    axis: the scan axis of every leaf (negative values count from the first leaf's rank).
    mode: "sequential" (`lax.scan`), "parallel" (`lax.associative_scan`), "chunked"
      (scan inside chunks, a sequential pass over chunk totals, one fix-up) or "auto"
      (chosen from the backend and the length; see `ssmkit.scan.Mode`).
    chunk_size: chunk length of the chunked mode; default about sqrt(length).
    inner: in-chunk strategy of the chunked mode, "sequential" or "parallel"; default
      sequential on CPU, parallel on accelerators.
    exclusive: return `[e, x0, fn(x0, x1), ...]` (shifted by one, the operator's identity
      `e` first), which needs an operator with a known identity.
    axis_name: inside `jax.shard_map` with the scan axis split over the mesh axis of
      this name (the devices holding consecutive slices in mesh order), return this
      device's slice of the scan of the whole sequence. Each device scans its slice in
      `mode`, the slice totals are all-gathered (one element per device), and each device
      combines the totals before its slice into its result. Every device must hold a slice
      of the same length.

  Returns:
    A pytree with the structure, shapes and dtypes of `elems`.

  Raises:
    ValueError: for an out-of-range `axis`, leaves of different lengths, an unknown
      `mode`/`inner`, a non-positive `chunk_size`, or an `axis_name` that is not a mesh
      axis of an enclosing `shard_map`.
    TypeError: when `fn` is not callable or `exclusive` is asked of an operator without an
      identity.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.scan import associative_scan, operators
    >>> associative_scan(operators.add, jnp.arange(1.0, 6.0), mode="chunked", chunk_size=2)
    Array([ 1.,  3.,  6., 10., 15.], dtype=float32)
    >>> associative_scan(operators.maximum, jnp.array([1, 3, 2, 5, 4]), reverse=True)
    Array([5, 5, 5, 5, 4], dtype=int32)

  References:
    Blelloch, "Prefix sums and their applications", CMU-CS-90-190, 1990.
  """
  if not callable(fn):
    raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
  mode = parse_mode(mode)
  checks.check_chunk_size(chunk_size)
  inner = parse_inner(inner, (Inner.SEQUENTIAL, Inner.PARALLEL))
  if axis_name is not None:
    axis_position(axis_name)
  leaves, treedef = jax.tree.flatten(elems)
  if not leaves:
    raise ValueError("`elems` must contain at least one array.")
  leaves = [jnp.asarray(x) for x in leaves]
  axis = checks.canonical_axis(axis, leaves[0].ndim)
  length = leaves[0].shape[axis]
  for i, x in enumerate(leaves):
    if x.ndim <= axis or x.shape[axis] != length:
      raise ValueError(
          f"every leaf of `elems` needs length {length} along axis {axis}; leaf {i} has "
          f"shape {x.shape}."
      )
  identity_like = identity_of(fn)
  if exclusive and identity_like is None:
    raise TypeError(
        "`exclusive=True` needs an operator with a known identity (an "
        "`ssmkit.scan.operators` operator), got a plain function."
    )
  moved = treedef.unflatten([jnp.moveaxis(x, axis, 0) for x in leaves])
  mode = resolve_mode(mode, length)
  out = scan_leading(fn, moved, mode=mode, reverse=reverse, chunk_size=chunk_size, inner=inner)
  seam = None
  if axis_name is not None and length > 0:
    out, seam = _join_slices(fn, out, reverse, axis_name)
  if exclusive and length > 0:
    edge = identity_like(_take(moved, 0))
    if seam is not None:
      edge = jax.tree.map(lambda e, c: jnp.where(seam.entry, e, c), edge, seam.carry)
    edge = jax.tree.map(lambda x: x[None], edge)
    out = (
        _concat([_take(out, slice(1, None)), edge])
        if reverse
        else _concat([edge, _take(out, slice(None, -1))])
    )
  return jax.tree.map(lambda x: jnp.moveaxis(x, 0, axis), out)
