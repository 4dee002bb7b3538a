"""Associative binary operators over pytrees, each with its identity element.

An operator `op` combines an earlier element `x` with a later element `y`: `op(x, y)`.
Scanning it gives prefix "sums": `[x0, op(x0, x1), op(op(x0, x1), x2), ...]`. Operators are
elementwise over every axis but the ones they own (the matrix axes of `matrix_affine`),
so they work on single steps, whole sequences and chunked layouts alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Operator:
  """An associative binary operator, optionally with a known identity element.

  Attributes:
    combine: `combine(x, y) -> z`, associative, earlier element first.
    identity_like: `identity_like(x) -> e` with `combine(e, x) == combine(x, e) == x`,
      shaped like the element `x`; None when the operator has no identity.
    name: a short name used in error messages and reprs.
  """

  combine: Callable[[PyTree, PyTree], PyTree]
  identity_like: Callable[[PyTree], PyTree] | None = None
  name: str = "operator"

  def __call__(self, x: PyTree, y: PyTree) -> PyTree:
    return self.combine(x, y)

  def __repr__(self) -> str:
    return f"ssmkit.scan.operators.{self.name}"


def identity_of(fn: Callable[..., Any]) -> Callable[[PyTree], PyTree] | None:
  """The identity function of `fn` if it is an `Operator` that has one, else None."""
  return fn.identity_like if isinstance(fn, Operator) else None


def _lowest(x: jnp.ndarray) -> jnp.ndarray:
  dtype = x.dtype
  if jnp.issubdtype(dtype, jnp.inexact):
    value = -jnp.inf
  elif dtype == jnp.bool_:
    value = False
  else:
    value = jnp.iinfo(dtype).min
  return jnp.full_like(x, value)


def _affine(x, y):
  """(a1, b1) then (a2, b2) = (a1 * a2, a2 * b1 + b2): h -> a * h + b composed."""
  a1, b1 = x
  a2, b2 = y
  return a1 * a2, a2 * b1 + b2


affine = Operator(
    _affine,
    lambda x: (jnp.ones_like(x[0]), jnp.zeros_like(x[1])),
    "affine",
)
add = Operator(
    lambda x, y: jax.tree.map(jnp.add, x, y),
    lambda x: jax.tree.map(jnp.zeros_like, x),
    "add",
)

maximum = Operator(
    lambda x, y: jax.tree.map(jnp.maximum, x, y),
    lambda x: jax.tree.map(_lowest, x),
    "maximum",
)

logaddexp = Operator(
    lambda x, y: jax.tree.map(jnp.logaddexp, x, y),
    lambda x: jax.tree.map(_lowest, x),
    "logaddexp",
)

forward_fill = Operator(
    lambda x, y: jax.tree.map(lambda u, v: jnp.where(v != 0, v, u), x, y),
    lambda x: jax.tree.map(jnp.zeros_like, x),
    "forward_fill",
)


def _matrix_affine(x, y):
  """(A1, b1) then (A2, b2) = (A2 @ A1, A2 @ b1 + b2): h -> A @ h + b composed."""
  a1, b1 = x
  a2, b2 = y
  hi = jax.lax.Precision.HIGHEST
  return (
      jnp.matmul(a2, a1, precision=hi),
      jnp.einsum("...ij,...j->...i", a2, b1, precision=hi) + b2,
  )


def _matrix_identity(x):
  a, b = x
  eye = jnp.eye(a.shape[-1], dtype=a.dtype)
  return jnp.broadcast_to(eye, a.shape), jnp.zeros_like(b)


matrix_affine = Operator(_matrix_affine, _matrix_identity, "matrix_affine")


def _align_flags(flags: jnp.ndarray, leaf: jnp.ndarray) -> jnp.ndarray:
  """Appends unit axes so `flags` lines up with the leading axes of `leaf`."""
  if flags.ndim > leaf.ndim:
    raise ValueError(
        f"reset flags of rank {flags.ndim} cannot be aligned with a value of rank {leaf.ndim}."
    )
  return flags.reshape(flags.shape + (1,) * (leaf.ndim - flags.ndim))


def _pair(element: PyTree) -> tuple[jnp.ndarray, PyTree]:
  """Checks that an element of a segmented scan is a `(reset, value)` pair of booleans and values."""
  sequence = isinstance(element, (tuple, list))
  if not (sequence and len(element) == 2):
    what = f"a {type(element).__name__} of {len(element)}" if sequence else type(element).__name__
    raise TypeError(
        "`with_resets(fn)` scans `(reset, value)` pairs: pass elems as `(flags, value)` with "
        f"boolean flags and `value` a pytree `fn` combines, got {what}."
    )
  flags, value = element
  if getattr(flags, "dtype", None) != jnp.bool_:
    raise TypeError(
        "`with_resets(fn)` scans `(reset, value)` pairs: the first entry must be boolean flags, "
        f"got {getattr(flags, 'dtype', type(flags).__name__)}."
    )
  return flags, value


def with_resets(fn: Callable[[PyTree, PyTree], PyTree]) -> Operator:
  """Segmented version of `fn`: elements become `(reset, value)`.

  `(r1, v1) . (r2, v2) = (r1 | r2, v2 if r2 else fn(v1, v2))`: a set flag starts a new
  segment at its element, so nothing before it reaches the prefix. The choice is a
  selection (`jnp.where`), not a multiplication by zero, so a NaN or Inf in an earlier
  segment never leaks into a later one. Flags line up with the leading axes of every value
  leaf (flags `(T, B)` segment values `(T, B, D)`).

  Args:
    fn: an associative operator over values (an `Operator` or a plain function).

  Returns:
    The segmented operator; it has an identity when `fn` has one.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from ssmkit.scan import associative_scan, operators
    >>> flags = jnp.array([False, False, True, False])
    >>> associative_scan(operators.with_resets(operators.add), (flags, jnp.arange(1.0, 5.0)))[1]
    Array([1., 3., 3., 7.], dtype=float32)
  """

  def combine(x, y):
    r1, v1 = _pair(x)
    r2, v2 = _pair(y)
    merged = fn(v1, v2)
    value = jax.tree.map(lambda new, keep: jnp.where(_align_flags(r2, keep), keep, new), merged, v2)
    return jnp.logical_or(r1, r2), value

  inner_identity = identity_of(fn)
  identity_like = None
  if inner_identity is not None:
    identity_like = lambda x: (jnp.zeros_like(x[0], dtype=jnp.bool_), inner_identity(x[1]))
  name = f"with_resets({getattr(fn, 'name', getattr(fn, '__name__', 'fn'))})"
  return Operator(combine, identity_like, name)
