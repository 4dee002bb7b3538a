"""Running a recurrence by its Pallas kernels, with the XLA form taking what they do not.

The kernels take finite inputs: their products mix every step of a chunk, so a NaN written
before a reset would reach the steps after it as 0 * NaN, which the XLA forms keep out by
cleaning their inputs and flagging steps (`common.sanitize`). Rather than pay for that on
every call, one reduction asks whether every input (and in the backward pass every cotangent)
is finite, and a `lax.cond` sends the rare call that is not to the XLA form, whose values and
gradients are exact for it. Under `vmap` the answer is one for the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src.matrix_state import chunks

Array = jax.Array


def all_finite(arrays: Sequence[Array]) -> Array:
  """Whether every entry of every array is finite: one `()` bool, also under `vmap`."""
  finite = [jnp.all(jnp.isfinite(a)).astype(jnp.float32) for a in arrays]
  return chunks.all_above(jnp.min(jnp.stack(finite)), 0.5)


def routed(forward: Callable[..., tuple[Array, Array]], backward: Callable[..., tuple],
           fallback: Callable[..., tuple[Array, Array]], *args: Array) -> tuple[Array, Array]:
  """`forward(*args)` -> `(outputs, final state)` by the kernels, differentiated in reverse mode
  by `backward(*args, d_outputs, d_state)` -> one cotangent per argument; `fallback` computes
  the same function by the XLA form, for inputs or cotangents with a non-finite entry.

  The residuals are the arguments alone: the kernels' backward recomputes what it needs.
  Forward-mode differentiation (`jvp`) is refused by JAX for such a function; the XLA form
  (`impl="xla"`) takes it.
  """

  @jax.custom_vjp
  def run(*args):
    return lax.cond(all_finite(args), forward, fallback, *args)

  def run_forward(*args):
    return run(*args), args

  def run_backward(args, cotangents):
    def by_fallback(*all_args):
      return jax.vjp(fallback, *all_args[:len(args)])[1](tuple(all_args[len(args):]))

    return lax.cond(all_finite((*args, *cotangents)), backward, by_fallback, *args, *cotangents)

  run.defvjp(run_forward, run_backward)
  return run(*args)
