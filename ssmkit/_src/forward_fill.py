"""Forward fill ("right flood") and its use for expanding runs (inverse stream compaction)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ssmkit._src import checks
from ssmkit._src.engine import associative_scan
from ssmkit._src.modes import Mode
from ssmkit._src.operators import maximum

Array = jax.Array


def forward_fill(
    x: Array,
    mask: Array | None = None,
    *,
    reverse: bool = False,
    axis: int = 0,
    mode: str | Mode = "auto",
    fill_value: float = 0,
) -> Array:
  """Carries every source element forward until the next source ("right flood").

  `out[t] = x[s]` for the last source s <= t (the next source s >= t when `reverse`),
  where sources are the positions with `mask` True, by default the nonzero entries of
  `x`: `[1, 0, 0, 3, 0, 6, 0, 0] -> [1, 1, 1, 3, 3, 6, 6, 6]`. Positions with no source
  get `fill_value`. The source index is a max-scan (`ssmkit.scan.operators.maximum`) and
  the values are gathered with it, so gradients flow to the source element only: for the
  example above d sum(out) / dx = [3, 0, 0, 2, 0, 3, 0, 0]; NaNs in non-sources never
  spread.

  Args:
    x: values `(..., T, ...)` with time on `axis`; any dtype.
    mask: optional boolean sources, lined up with the leading axes of `x` (shaped
      `x.shape[:k]` for some k > `axis`, broadcast over the axes after them, as `reset` of
      `linear_recurrence`); default `x != 0`.
    reverse: fill backwards (from the next source).
    axis: the time axis.
    mode: scan mode of the index scan ("auto", "sequential", "parallel", "chunked").
    fill_value: value where no source has been seen.

  Returns:
    An array with `x`'s shape and dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.scan import forward_fill
    >>> forward_fill(jnp.array([1, 0, 0, 3, 0, 6, 0, 0]))
    Array([1, 1, 1, 3, 3, 6, 6, 6], dtype=int32)
  """
  x = jnp.asarray(x)
  if x.ndim == 0:
    raise ValueError("`x` must have a time axis, got a scalar.")
  axis = checks.canonical_axis(axis, x.ndim)
  if mask is None:
    mask = x != 0
  else:
    mask = jnp.asarray(mask)
    checks.check_bool(mask, "mask")
    mask = jnp.broadcast_to(checks.align_leading(mask, x.shape, axis, "mask", "x"), x.shape)
  length = x.shape[axis]
  steps = jnp.arange(length).reshape((length,) + (1,) * (x.ndim - axis - 1))
  # A reverse fill takes the smallest source index >= t: a max-scan of negated indices.
  marks = jnp.where(mask, -steps if reverse else steps, -length if reverse else -1)
  source = associative_scan(maximum, marks, reverse=reverse, axis=axis, mode=mode)
  if reverse:
    source = -source
  found = (source < length) if reverse else (source >= 0)
  values = jnp.take_along_axis(x, jnp.clip(source, 0, max(length - 1, 0)), axis=axis)
  return jnp.where(found, values, jnp.asarray(fill_value, x.dtype))


def expand_runs(
    values: Array,
    counts: Array,
    length: int,
    *,
    axis: int = 0,
    mode: str | Mode = "auto",
    fill_value: float = 0,
) -> Array:
  """Repeats `values[i]` `counts[i]` times along `axis`: the inverse of stream compaction.

  `values=[a, b, c], counts=[2, 0, 3]` gives `[a, a, c, c, c]`. The output has the static
  `length` (so it jit-compiles): positions past `sum(counts)` get `fill_value`, and runs
  past `length` are cut. Built on `forward_fill`: each run's index is written at its start
  and flooded to the right, then the values are gathered (gradients reach `values`).

  Args:
    values: `(..., N, ...)` run values with N on `axis`.
    counts: `(N,)` non-negative integer run lengths.
    length: output length along `axis` (a Python int).
    axis: the run axis of `values`.
    mode: scan mode of the flood ("auto", "sequential", "parallel", "chunked").
    fill_value: value of the positions past the last run.

  Returns:
    `values` with `axis` expanded to `length`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.scan import expand_runs
    >>> expand_runs(jnp.array([7.0, 8.0, 9.0]), jnp.array([2, 0, 3]), 6)
    Array([7., 7., 9., 9., 9., 0.], dtype=float32)
  """
  values = jnp.asarray(values)
  counts = jnp.asarray(counts)
  if values.ndim == 0:
    raise ValueError("`values` must have a run axis, got a scalar.")
  axis = checks.canonical_axis(axis, values.ndim)
  runs = values.shape[axis]
  if not jnp.issubdtype(counts.dtype, jnp.integer):
    raise TypeError(f"`counts` must be an integer array, got dtype {counts.dtype}.")
  checks.check_shape(counts, (runs,), "counts", "one count per run of `values`")
  if not isinstance(length, (int, np.integer)) or length < 0:
    raise ValueError(f"`length` must be a non-negative int, got {length!r}.")
  out_shape = (*values.shape[:axis], length, *values.shape[axis + 1:])
  if runs == 0:
    return jnp.full(out_shape, fill_value, values.dtype)
  ends = jnp.cumsum(counts)
  starts = ends - counts
  run_at_start = jnp.full((length,), -1, jnp.int32)
  run_at_start = run_at_start.at[starts].max(jnp.arange(runs, dtype=jnp.int32), mode="drop")
  run = forward_fill(run_at_start, run_at_start >= 0, mode=mode, fill_value=-1)
  inside = (jnp.arange(length) < ends[-1]) & (run >= 0)
  gathered = jnp.take(values, jnp.clip(run, 0, runs - 1), axis=axis)
  inside = inside.reshape((length,) + (1,) * (values.ndim - axis - 1))
  return jnp.where(inside, gathered, jnp.asarray(fill_value, values.dtype))
