"""The scan engine: one associative operator, run sequentially, in parallel, chunked, or over devices."""

from __future__ import annotations

import functools
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
from ssmkit._src.operators import Operator, identity_of

PyTree = Any
Fn = Callable[[PyTree, PyTree], PyTree]


def _take(tree: PyTree, index) -> PyTree:
  return jax.tree.map(lambda x: x[index], tree)


def _concat(trees: list[PyTree], axis: int = 0) -> PyTree:
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=axis), *trees)


def _part(tree: PyTree, start: int | None, stop: int | None, axis: int) -> PyTree:
  """Every leaf sliced to [start, stop) along `axis`, the axis kept."""
  return jax.tree.map(lambda x: x[(slice(None),) * axis + (slice(start, stop),)], tree)


def _element(tree: PyTree, index: int, axis: int) -> PyTree:
  """The element at `index` (negative counts from the end) as a slice of length 1 along `axis`."""
  return _part(tree, index, None if index == -1 else index + 1, axis)


def vary_alike(tree: PyTree) -> PyTree:
  """Every leaf of `tree` cast to vary over each manual mesh axis that any leaf varies over.

  Inside `shard_map`, a `lax.scan` carry must vary like the elements combined into it (a
  constant identity, such as the unit matrix of `matrix_affine`, or a replicated h0 of a
  sharded recurrence, varies over no axis); the cast's transpose sums a replicated
  input's per-device cotangents over the devices. Outside `shard_map` nothing varies and
  `tree` is returned as it is.
  """
  leaves = jax.tree.leaves(tree)
  axes = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in leaves))

  def cast(x):
    missing = axes - jax.typeof(x).manual_axis_type.varying
    return lax.pcast(x, tuple(missing), to="varying") if missing else x

  return jax.tree.map(cast, tree)


def _identity_carry(fn: Fn, element: PyTree) -> PyTree:
  """The identity of `fn` shaped like `element`, to start a scan carry."""
  return vary_alike((identity_of(fn)(element), element))[0]


def _sequential(fn: Fn, elems: PyTree, reverse: bool, axis: int) -> PyTree:
  """`lax.scan` along `axis`; `fn` gets one element at a time as a slice of length 1.

  The carry is the prefix accumulated so far. Each step's slice keeps the scan axis in
  place, as `lax.associative_scan` passes `fn` its shortest pieces, so an `fn` written for
  lax (with `jax.vmap` over the scan axis, or indexing it) works unchanged.
  """
  length = jax.tree.leaves(elems)[0].shape[axis]
  # (..., T, ...) -> (T, ..., 1, ...): time leads for lax.scan, a unit axis stays in place.
  steps = jax.tree.map(lambda x: jnp.moveaxis(jnp.expand_dims(x, axis + 1), axis, 0), elems)

  def body(carry, x):
    carry = fn(carry, x)
    return carry, carry

  def unsteps(ys):
    return jax.tree.map(lambda y: jnp.squeeze(jnp.moveaxis(y, 0, axis), axis + 1), ys)

  if identity_of(fn) is not None:
    _, ys = lax.scan(body, _identity_carry(fn, _take(steps, 0)), steps, reverse=reverse)
    return unsteps(ys)
  head, rest = (-1, slice(None, -1)) if reverse else (0, slice(1, None))
  _, ys = lax.scan(body, _take(steps, head), _take(steps, rest), reverse=reverse)
  ys = unsteps(ys)
  first = _element(elems, head, axis)
  return _concat([ys, first] if reverse else [first, ys], axis) if length > 1 else first


ChunkScanner = Callable[[PyTree, bool], PyTree]


def chunk_scanner(fn: Fn, inner: Inner, axis: int) -> ChunkScanner:
  """Scans one chunk (leaves shaped like the input, shorter along `axis`) with `inner`."""
  if inner is Inner.PARALLEL:
    return lambda chunk, reverse: lax.associative_scan(fn, chunk, reverse=reverse, axis=axis)
  return lambda chunk, reverse: _sequential(fn, chunk, reverse, axis)


def _apply_carry(fn: Fn, carry: PyTree, ys: PyTree) -> PyTree:
  """`fn(carry, y)` for every y of `ys`; `carry` is one element (length 1 along the scan axis)."""
  return fn(jax.tree.map(lambda c, y: jnp.broadcast_to(c, y.shape), carry, ys), ys)


def _chunked(
    fn: Fn, elems: PyTree, reverse: bool, axis: int, chunk_size: int, scan_chunk: ChunkScanner
) -> PyTree:
  """Scan inside chunks, a sequential scan over chunk totals, one fix-up with the carries.

  Chunks are aligned to the start of the scan (the end when `reverse`); the remainder of
  a length that is not a multiple of `chunk_size` is scanned as one short chunk. The
  chunks are scanned and fixed up under `jax.vmap`, so `fn` sees each chunk as it would
  see a shorter input, the scan axis in place.
  """
  length = jax.tree.leaves(elems)[0].shape[axis]
  size = min(chunk_size, length)
  n, r = divmod(length, size)
  main = _part(elems, r, None, axis) if reverse else _part(elems, None, n * size, axis)
  # (..., n * size, ...) -> (n, ..., size, ...): one chunk per entry of a new leading axis.
  chunks = jax.tree.map(
      lambda x: jnp.moveaxis(x.reshape(*x.shape[:axis], n, size, *x.shape[axis + 1 :]), axis, 0),
      main,
  )
  ys = jax.vmap(lambda chunk: scan_chunk(chunk, reverse))(chunks)
  totals = _part(ys, 0, 1, axis + 1) if reverse else _part(ys, -1, None, axis + 1)
  if n > 1:
    head, rest = (-1, slice(None, -1)) if reverse else (0, slice(1, None))
    # carries[k] is the prefix that ends just before chunk k+1 (k-1 when reversed).
    final, carries = lax.scan(
        lambda c, t: (fn(c, t), c), _take(totals, head), _take(totals, rest), reverse=reverse
    )
    fixed = jax.vmap(functools.partial(_apply_carry, fn))(carries, _take(ys, rest))
    edge = _take(ys, slice(-1, None) if reverse else slice(0, 1))
    ys = _concat([fixed, edge] if reverse else [edge, fixed])
  else:
    final = _take(totals, 0)
  ys = jax.tree.map(
      lambda y: jnp.moveaxis(y, 0, axis).reshape(*y.shape[1 : axis + 1], n * size,
                                                 *y.shape[axis + 2 :]),
      ys,
  )
  if r == 0:
    return ys
  tail = _part(elems, None, r, axis) if reverse else _part(elems, n * size, None, axis)
  tail = _apply_carry(fn, final, scan_chunk(tail, reverse))
  return _concat([tail, ys] if reverse else [ys, tail], axis)


def scan_along(
    fn: Fn,
    elems: PyTree,
    *,
    axis: int,
    mode: Mode,
    reverse: bool = False,
    chunk_size: int | None = None,
    inner: Inner | None = None,
    scan_chunk: ChunkScanner | None = None,
) -> PyTree:
  """Inclusive scan of `fn` along `axis` of every leaf; `mode` is not AUTO.

  `fn` gets arrays that keep the scan axis in place, with some length >= 1, as from
  `lax.associative_scan`. `scan_chunk` replaces the in-chunk scan of the chunked mode
  (default: `inner`).
  """
  length = jax.tree.leaves(elems)[0].shape[axis]
  if length <= 1:
    return elems
  match mode:
    case Mode.SEQUENTIAL:
      return _sequential(fn, elems, reverse, axis)
    case Mode.PARALLEL:
      return lax.associative_scan(fn, elems, reverse=reverse, axis=axis)
    case Mode.CHUNKED:
      scan_chunk = scan_chunk or chunk_scanner(fn, inner or default_inner(), axis)
      return _chunked(fn, elems, reverse, axis, chunk_size or default_chunk_size(length),
                      scan_chunk)
  raise ValueError(f"scan_along needs a concrete mode, got {mode}.")


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
        lambda c, x: (fn(c, x), None), _identity_carry(fn, _take(items, 0)), items,
        reverse=reverse
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


def from_device(x: jax.Array, holder: jax.Array, axis_name: Hashable) -> jax.Array:
  """`x` as the device where `holder` is True has it, on every device of the mesh axis.

  A sum of that device's `x` alone: a value replicated over the axis (an `out_specs=P()`
  output) whose cotangent is counted once, also under `shard_map(check_vma=False)`.
  """
  return lax.psum(jnp.where(holder, x, jnp.zeros_like(x)), axis_name)


def with_next_slice(x: jax.Array, x_next: jax.Array, steps: int, axis: int, axis_name: Hashable
                    ) -> jax.Array:
  """`x` with its last `steps` steps replaced by the first `steps` of the next device's `x_next`.

  The device holding the last slice keeps its own steps: past the end of the whole
  sequence there is no next slice.
  """
  index, size = axis_position(axis_name)
  length = x.shape[axis]
  head = lax.slice_in_dim(x_next, 0, steps, axis=axis)
  received = lax.ppermute(head, axis_name, [(j, (j - 1) % size) for j in range(size)])
  own = lax.slice_in_dim(x, length - steps, length, axis=axis)
  tail = jnp.where(index == size - 1, own, received)
  return jnp.concatenate([lax.slice_in_dim(x, 0, length - steps, axis=axis), tail], axis)


class _Seam(NamedTuple):
  """How this device's slice joins the scan across the devices of a mesh axis.

  Attributes:
    carry: the total of every slice before this one (after it when reversed).
    entry: whether this device holds the slice the scan starts from (no carry).
  """

  carry: PyTree
  entry: jax.Array


def _join_slices(
    fn: Fn, ys: PyTree, reverse: bool, axis: int, axis_name: Hashable
) -> tuple[PyTree, _Seam]:
  """Turns the scan `ys` of this device's slice into its part of the scan of every slice.

  The slice totals (one element per device) are all-gathered, scanned over devices, and
  the total of the slices before this one is combined into every element of `ys` (one
  elementwise fix-up). Scanning first and fixing up afterwards needs no identity, so
  every operator can be used; `linear_recurrence` takes the cheaper route of reducing
  first and scanning once from the carry.
  """
  index, size = axis_position(axis_name)
  total = _element(ys, 0 if reverse else -1, axis)
  totals = jax.tree.map(lambda x: lax.all_gather(x, axis_name, axis=axis, tiled=True), total)
  prefixes = _sequential(fn, totals, reverse, axis)
  before = jnp.clip(index + (1 if reverse else -1), 0, size - 1)
  carry = jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, before, 1, axis), prefixes)
  entry = index == (size - 1 if reverse else 0)
  fixed = _apply_carry(fn, carry, ys)
  ys = jax.tree.map(lambda y, z: jnp.where(entry, y, z), ys, fixed)
  return ys, _Seam(carry, entry)


def _checked(fn: Fn) -> Operator:
  """`fn` with a check of every result: the structure, shapes and dtypes of its operands.

  `lax.associative_scan` needs the same of `fn` and fails deep inside when it does not
  hold; this names `fn` and says what it returned. The identity of an `Operator` is kept.
  """

  def combine(x, y):
    out = fn(x, y)
    want = jax.tree.map(lambda v: (v.shape, jnp.dtype(v.dtype)), x)
    try:
      got = jax.tree.map(lambda v: (jnp.shape(v), jnp.result_type(v)), out)
    except TypeError:
      got = out
    if jax.tree.structure(out) != jax.tree.structure(x) or got != want:
      raise ValueError(
          "`fn` must return an element like its operands (an elementwise operator along the "
          f"scan axis, as lax.associative_scan needs): given {want}, it returned {got}."
      )
    return out

  name = getattr(fn, "name", getattr(fn, "__name__", "fn"))
  return Operator(combine, identity_of(fn), name)


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
  inner = parse_inner(inner, (Inner.SEQUENTIAL, Inner.PARALLEL), mode)
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
  elems = treedef.unflatten(leaves)
  fn = _checked(fn)
  mode = resolve_mode(mode)
  out = scan_along(fn, elems, axis=axis, mode=mode, reverse=reverse, chunk_size=chunk_size,
                   inner=inner)
  seam = None
  if axis_name is not None and length > 0:
    out, seam = _join_slices(fn, out, reverse, axis, axis_name)
  if exclusive and length > 0:
    edge = identity_like(_element(elems, 0, axis))
    if seam is not None:
      edge = jax.tree.map(lambda e, c: jnp.where(seam.entry, e, c), edge, seam.carry)
    out = (
        _concat([_part(out, 1, None, axis), edge], axis)
        if reverse
        else _concat([edge, _part(out, None, -1, axis)], axis)
    )
  return out
