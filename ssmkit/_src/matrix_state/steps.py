"""Step-by-step evaluation of a matrix-state recurrence: the decoding path and the reference.

The steps run in one `lax.scan`. Where they will be differentiated, past `size` steps they
are grouped: an outer scan over groups keeps one state per group and the scan inside a
group is rematerialised in the backward pass, so gradients hold T / size states instead
of T. Where only the values are wanted, one plain scan is the fastest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
Step = Callable[[Array, Any], tuple[Array, Array]]


def decayed(s: Array, g_t: Array | None) -> Array:
  """The `(Z, H, K, V)` state `s` times exp(g_t): `(Z, H)` one decay per head, `(Z, H, K)` one
  per key row, None none."""
  if g_t is None:
    return s
  decay = jnp.exp(g_t)
  return s * (decay[..., None] if decay.ndim == 3 else decay[..., None, None])


def run(step: Step, xs: Any, state: Array, size: int | None) -> tuple[Array, Array]:
  """Scans `step(state, x_t) -> (state, o_t)` over time-major `xs`; returns `(o, final)`.

  Args:
    step: one step of the recurrence. A step whose inputs are all zero (and whose reset
      flag is False) must leave the state unchanged: the last group is padded with them.
    xs: pytree of time-major `(T, ...)` arrays.
    state: the state before the first step.
    size: steps per rematerialised group, or None for one scan (values only: its
      gradient would keep every state).
  """
  length = jax.tree.leaves(xs)[0].shape[0]
  if length == 1:  # a decoding step: no loop at all
    final, out = step(state, jax.tree.map(lambda x: x[0], xs))
    return out[None], final
  if size is None or length <= size:
    final, out = lax.scan(step, state, xs)
    return out, final
  count = -(-length // size)

  def group(x):
    x = jnp.pad(x, [(0, count * size - length)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((count, size, *x.shape[1:]))

  final, out = lax.scan(jax.checkpoint(lambda s, x: lax.scan(step, s, x)), state,
                        jax.tree.map(group, xs))
  return out.reshape((count * size, *out.shape[2:]))[:length], final
