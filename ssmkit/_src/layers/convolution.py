"""The short causal convolution over time that Mamba, Mamba-2, Gated DeltaNet and Griffin put
before their recurrence, which does not reach across resets."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ssmkit._src.layers import common

Array = jax.Array


class ConvRecurrentState(NamedTuple):
  """The state of a layer with a short convolution in front of its recurrence.

  Attributes:
    conv: `(*batch, d_conv - 1, C)` float32, the convolution's last inputs, oldest first.
    recurrent: the recurrence's state (its shape depends on the layer), float32.
  """

  conv: Array
  recurrent: Array


def causal_conv(x: Array, kernel: Array, bias: Array | None, window: Array,
                reset: Array | None) -> tuple[Array, Array]:
  """Depthwise causal convolution over time (axis -2), y_t = sum_l kernel[-1 - l] x_{t-l} + bias.

  The inputs before the first step come from `window`; a reset at step t hides every input
  before t from the steps from t on (the window included), as if the sequence started there.

  Args:
    x: `(..., T, C)` inputs.
    kernel: `(d_conv, C)` weights; the last row multiplies the current step.
    bias: optional `(C,)` bias.
    window: `(..., d_conv - 1, C)` inputs before the first step.
    reset: optional `(..., T)` booleans; True starts a new episode at that step.

  Returns:
    The `(..., T, C)` convolution and the float32 window after the last step.
  """
  length, past = x.shape[-2], kernel.shape[0] - 1
  extended = jnp.concatenate([window.astype(x.dtype), x], axis=-2)
  # Episode number of every extended step; the window belongs to the episode before any reset.
  episode = None
  if reset is not None:
    episode = jnp.concatenate(
        [jnp.zeros((*reset.shape[:-1], past), jnp.int32), jnp.cumsum(reset, axis=-1, dtype=jnp.int32)],
        axis=-1,
    )
  out = jnp.zeros_like(x) if bias is None else common.leading_ones(bias, x.ndim)
  for lag in range(past + 1):
    earlier = extended[..., past - lag : past - lag + length, :]
    if episode is not None:
      same = episode[..., past - lag : past - lag + length] == episode[..., past:]
      earlier = jnp.where(same[..., None], earlier, jnp.zeros_like(earlier))
    out = out + earlier * common.leading_ones(kernel[past - lag], x.ndim)
  window = extended[..., length:, :]
  if episode is not None:
    current = episode[..., length:] == episode[..., -1:]
    window = jnp.where(current[..., None], window, jnp.zeros_like(window))
  return out, window.astype(jnp.float32)


def zero_window(batch: tuple[int, ...], d_conv: int, channels: int) -> Array:
  """The `(*batch, d_conv - 1, channels)` float32 window of a sequence that has not started."""
  return jnp.zeros((*batch, d_conv - 1, channels), jnp.float32)
