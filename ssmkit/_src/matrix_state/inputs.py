"""Argument checks and the internal layout shared by the matrix-state recurrences.

Public shapes put time on axis -3 behind any batch axes: `q, k` `(..., T, H, K)`, `v`
`(..., T, H, V)`, the state `(..., H, K, V)`. Internally the batch axes are flattened into
one leading axis Z and everything is cast to the accumulation dtype (float32 for 16-bit
inputs): the algorithms see `(Z, T, H, K)` and move time once, to where they need it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ssmkit._src import checks
from ssmkit._src.linear_recurrence import output_and_state_dtypes

Array = jax.Array


class Inputs(NamedTuple):
  """Checked arguments in the internal layout.

  Attributes:
    q, k: `(Z, T, H, K)` queries and keys.
    v: `(Z, T, H, V)` values.
    log_decay: None, `(Z, T, H)` (one decay per head) or `(Z, T, H, K)` (one per key).
    beta: None or `(Z, T, H)` write strengths.
    a, b: None, or `(Z, T, H, K)` the vectors that read and write the state
      (`generalized_delta_rule`).
    state: `(Z, H, K, V)` state before the first step.
    reset: None or `(Z, T)` booleans; True clears the state before that step.
    batch: the flattened batch shape.
    dtype: the dtype of the outputs (`output_and_state_dtypes`).
    groups: G, heads of v per head of q and k: q and k hold H / G heads, value head h
      reading query and key head h // G (`expanded` repeats them).
  """

  q: Array
  k: Array
  v: Array
  log_decay: Array | None
  beta: Array | None
  a: Array | None
  b: Array | None
  state: Array
  reset: Array | None
  batch: tuple[int, ...]
  dtype: jnp.dtype
  groups: int = 1


def expanded(x: Inputs) -> Inputs:
  """`x` with each head of q and k repeated for its group of value heads (`groups` 1)."""
  if x.groups == 1:
    return x
  repeat = lambda a: jnp.repeat(a, x.groups, axis=2)
  return x._replace(q=repeat(x.q), k=repeat(x.k), groups=1)


# The floating arrays of `Inputs`, every one the recurrence is differentiable in.
FLOATS = ("q", "k", "v", "log_decay", "beta", "a", "b", "state")


def prepare(
    q,
    k,
    v,
    *,
    log_decay,
    beta,
    initial_state,
    reset,
    check_log_decay: bool,
    a=None,
    b=None,
    grouped: bool = False,
) -> Inputs:
  """Checks shapes and dtypes, flattens the batch axes and casts to the accumulation dtype.

  Args:
    q, k, v, log_decay, beta, initial_state, reset, a, b: the public arguments (`a` and `b`
      None but for the generalized delta rule).
    check_log_decay: whether to refuse a positive or non-finite `log_decay` known at trace
      time.
    grouped: q and k may hold fewer heads than v, a divisor of its heads (`Inputs.groups`);
      the per-step arguments and the state then follow v's heads.

  Raises:
    TypeError: for integer or complex inputs, or non-boolean `reset`.
    ValueError: for shapes that do not fit `q`, or a decay known to be positive.
  """
  q, k, v = (checks.real_floating(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
  if q.ndim < 3:
    raise ValueError(f"`q` must be `(..., T, H, K)`, got shape {q.shape}.")
  if k.shape != q.shape:
    raise ValueError(f"`k` must have the shape of `q` {q.shape} (..., T, H, K), got {k.shape}.")
  if grouped and v.ndim == q.ndim and v.shape[:-2] == q.shape[:-2] and (
      v.shape[-2] % q.shape[-2] == 0):
    groups = v.shape[-2] // q.shape[-2]
  elif v.ndim != q.ndim or v.shape[:-1] != q.shape[:-1]:
    grouping = " (or a multiple of its heads)" if grouped else ""
    raise ValueError(
        f"`v` must be `(..., T, H, V)` with the leading shape {q.shape[:-1]} of `q`{grouping}, "
        f"got {v.shape}."
    )
  else:
    groups = 1
  *batch, length, _, dim_k = q.shape
  heads = v.shape[-2]
  batch = tuple(batch)
  step_shape = v.shape[:-1]
  key_shape = (*step_shape, dim_k)
  dtypes = [q.dtype, k.dtype, v.dtype]
  if log_decay is not None:
    log_decay = checks.real_floating(log_decay, "log_decay")
    if log_decay.shape not in (step_shape, key_shape):
      raise ValueError(f"`log_decay` must be (..., T, H) or (..., T, H, K): {step_shape} or "
                       f"{key_shape}, got {log_decay.shape}.")
    if check_log_decay:
      checks.check_log_decay(log_decay)
    dtypes.append(log_decay.dtype)
  if beta is not None:
    beta = checks.real_floating(beta, "beta")
    checks.check_shape(beta, step_shape, "beta", "(..., T, H)")
    dtypes.append(beta.dtype)
  rank_one = []
  for x, name in ((a, "a"), (b, "b")):
    if x is not None:
      x = checks.real_floating(x, name)
      checks.check_shape(x, q.shape, name, "(..., T, H, K): the shape of `q`")
      dtypes.append(x.dtype)
    rank_one.append(x)
  a, b = rank_one
  state_shape = (*batch, heads, dim_k, v.shape[-1])
  if initial_state is not None:
    initial_state = checks.real_floating(initial_state, "initial_state")
    checks.check_shape(initial_state, state_shape, "initial_state", "(..., H, K, V)")
  if reset is not None:
    reset = jnp.asarray(reset)
    checks.check_bool(reset, "reset")
    checks.check_shape(reset, q.shape[:-2], "reset", "(..., T): the leading shape of `q`")
  dtype, acc = output_and_state_dtypes(jnp.result_type(*dtypes), initial_state)
  z = math.prod(batch)

  def flat(x):
    return None if x is None else x.reshape((z, *x.shape[len(batch):])).astype(acc)

  state = jnp.zeros(state_shape, acc) if initial_state is None else initial_state.astype(acc)
  return Inputs(
      q=flat(q),
      k=flat(k),
      v=flat(v),
      log_decay=flat(log_decay),
      beta=flat(beta),
      a=flat(a),
      b=flat(b),
      state=state.reshape((z, *state_shape[-3:])),
      reset=None if reset is None else reset.reshape((z, length)),
      batch=batch,
      dtype=dtype,
      groups=groups,
  )


def finish(inputs: Inputs, out: Array, state: Array, return_final_state: bool):
  """`(Z, T, H, V)` outputs in the public layout and dtype, and the state in the accumulation
  dtype (`output_and_state_dtypes`)."""
  out = out.reshape(inputs.batch + out.shape[1:]).astype(inputs.dtype)
  if not return_final_state:
    return out
  return out, state.reshape(inputs.batch + state.shape[1:])
