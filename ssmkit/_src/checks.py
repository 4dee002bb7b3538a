"""Argument checks shared by the public functions; every failure names the argument."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def canonical_axis(axis: int, ndim: int, name: str = "axis") -> int:
  """Returns `axis` in [0, ndim), or raises a ValueError naming `name`."""
  if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
    raise TypeError(f"`{name}` must be an int, got {axis!r}.")
  if not -ndim <= axis < ndim:
    raise ValueError(f"`{name}`={axis} is out of range for an input of rank {ndim}.")
  return int(axis) % ndim


def check_chunk_size(chunk_size: int | None) -> None:
  if chunk_size is None:
    return
  if not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool):
    raise TypeError(f"`chunk_size` must be a positive int or None, got {chunk_size!r}.")
  if chunk_size <= 0:
    raise ValueError(f"`chunk_size` must be positive, got {chunk_size}.")


def check_inexact(x: jnp.ndarray, name: str) -> None:
  """Raises a TypeError unless `x` has a floating or complex dtype."""
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    raise TypeError(f"`{name}` must have a floating or complex dtype, got {x.dtype}.")


def real_floating(x, name: str) -> jnp.ndarray:
  """`x` as an array; raises a TypeError naming `name` unless its dtype is real floating."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"`{name}` must have a real floating dtype, got {x.dtype}.")
  return x


def check_broadcasts_to(x: jnp.ndarray, shape: Sequence[int], name: str, target: str) -> None:
  """Raises unless `x` broadcasts to `shape` without changing `shape`."""
  try:
    out = np.broadcast_shapes(x.shape, tuple(shape))
  except ValueError:
    out = None
  if out != tuple(shape):
    raise ValueError(
        f"`{name}` with shape {x.shape} does not broadcast to the shape of `{target}` "
        f"{tuple(shape)}."
    )


def align_leading(
    flags: jnp.ndarray, shape: Sequence[int], axis: int, name: str, target: str
) -> jnp.ndarray:
  """`flags` lined up with the leading axes of `shape` (time on `axis`), at rank len(shape).

  Flags, resets and masks follow the leading (batch and time) axes of the array they mark,
  never NumPy's right-aligned broadcasting: their shape is `shape[:k]` for some k > `axis`,
  and they broadcast over the trailing axes they leave out. An axis of size 1 other than
  `axis` broadcasts too. `(T, B)` flags of a `(T, B, D)` array then mark steps and batch
  elements even when T == B == D.

  Returns:
    `flags` with unit axes appended up to rank len(shape), ready for `jnp.where`.

  Raises:
    ValueError: naming `name` when `flags` does not line up so.
  """
  shape = tuple(shape)
  k = flags.ndim
  fits = axis < k <= len(shape) and flags.shape[axis] == shape[axis] and all(
      n in (1, m) for n, m in zip(flags.shape, shape[:k], strict=True)
  )
  if not fits:
    raise ValueError(
        f"`{name}` with shape {flags.shape} does not line up with the leading axes of `{target}` "
        f"{shape}: it needs the shape {target}.shape[:k] for some k > {axis} (the time axis "
        f"{axis} included, e.g. {shape[: axis + 1]}), broadcast over the axes after it; other "
        "axes of size 1 broadcast too."
    )
  return flags.reshape(flags.shape + (1,) * (len(shape) - k))


def check_shape(x: jnp.ndarray, shape: Sequence[int], name: str, what: str) -> None:
  if x.shape != tuple(shape):
    raise ValueError(f"`{name}` must have shape {tuple(shape)} ({what}), got {x.shape}.")


def check_bool(x: jnp.ndarray, name: str) -> None:
  if x.dtype != jnp.bool_:
    raise TypeError(f"`{name}` must be a boolean array, got dtype {x.dtype}.")


def check_known_values(x, name: str, low: float = -np.inf, high: float = np.inf,
                       meaning: str = "") -> None:
  """Refuses non-finite values of `x`, or values outside [`low`, `high`], where they are known at
  trace time (`x` not traced), naming `name`, the range and the values found. Traced values are
  the caller's to document.

  Args:
    x: an array, or a tracer (then nothing is checked).
    name: the argument's name.
    low, high: the closed range the values must lie in.
    meaning: what the range means, said after it (", a decay exp(g) in (0, 1]").
  """
  if isinstance(x, jax.core.Tracer):
    return
  value = np.asarray(x)
  finite = np.isfinite(value)
  if not value.size or (np.all(finite) and low <= value.min() and value.max() <= high):
    return
  count = value.size - np.count_nonzero(finite)
  got = [f"{count} non-finite values"] if count else []
  if np.any(finite):
    got.append(f"{'the finite ones' if count else 'values'} in "
               f"[{value[finite].min()}, {value[finite].max()}]")
  bounds = " and ".join(part for part, bound in ((f">= {low:g}", low), (f"<= {high:g}", high))
                        if np.isfinite(bound))
  raise ValueError(f"`{name}` must be finite{' and ' + bounds if bounds else ''}{meaning}, got "
                   f"{', '.join(got)}.")


def check_log_decay(log_decay, name: str = "log_decay") -> None:
  """Refuses positive or non-finite log-decays known at trace time (`check_known_values`)."""
  check_known_values(log_decay, name, high=0.0,
                     meaning=" (a decay exp(g) in (0, 1]; use `reset` to clear the state)")
