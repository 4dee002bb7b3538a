"""The short causal convolution over time that Mamba, Mamba-2, Gated DeltaNet and Griffin put
before their recurrence, which does not reach across resets."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src.engine import axis_position, from_device
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


def _episodes(reset: Array | None, past: int) -> Array | None:
  """The episode number of every step of the window and the inputs, `(..., past + T)` int32;
  the window belongs to the episode before any reset."""
  if reset is None:
    return None
  return jnp.concatenate(
      [jnp.zeros((*reset.shape[:-1], past), jnp.int32), jnp.cumsum(reset, axis=-1, dtype=jnp.int32)],
      axis=-1,
  )


def _window_after(extended: Array, episode: Array | None, length: int) -> Array:
  """The window after the last of `length` inputs: the last steps of `extended` (window then
  inputs), zeroed where they belong to an episode before the last one."""
  window = extended[..., length:, :]
  if episode is not None:
    current = episode[..., length:] == episode[..., -1:]
    window = jnp.where(current[..., None], window, jnp.zeros_like(window))
  return window


def _entering_window(x: Array, window: Array, reset: Array | None, axis_name: Hashable) -> Array:
  """The window entering this device's slice of time along the mesh axis `axis_name`.

  Each device passes the window after its slice to the next by `ppermute`. A slice shorter
  than the window lets part of the window it received through, so the passes repeat until
  every window holds only inputs of earlier slices (or of `window` on the first device).
  The windows cross in the inputs' dtype, so that no device rounds what one device would not.
  """
  index, size = axis_position(axis_name)
  length, past = x.shape[-2], window.shape[-2]
  rounds = 0 if past == 0 else size - 1 if length == 0 else min(size - 1, math.ceil(past / length))
  episode = _episodes(reset, past)
  first = index == 0
  entering = jnp.where(first, window, jnp.zeros_like(window))
  for _ in range(rounds):
    leaving = _window_after(jnp.concatenate([entering.astype(x.dtype), x], axis=-2), episode, length)
    received = lax.ppermute(leaving, axis_name, [(j, j + 1) for j in range(size - 1)])
    entering = jnp.where(first, window, received)
  return entering


def causal_conv(x: Array, kernel: Array, bias: Array | None, window: Array,
                reset: Array | None, axis_name: Hashable | None = None) -> tuple[Array, Array]:
  """Depthwise causal convolution over time (axis -2), y_t = sum_l kernel[-1 - l] x_{t-l} + bias.

  The inputs before the first step come from `window`; a reset at step t hides every input
  before t from the steps from t on (the window included), as if the sequence started there.

  Args:
    x: `(..., T, C)` inputs.
    kernel: `(d_conv, C)` weights; the last row multiplies the current step.
    bias: optional `(C,)` bias.
    window: `(..., d_conv - 1, C)` inputs before the first step.
    reset: optional `(..., T)` booleans; True starts a new episode at that step.
    axis_name: inside `jax.shard_map` with the time axis split over the mesh axis of this
      name, the convolution of the whole sequence: each slice's first steps read the
      previous slices' last inputs (`window` enters on the device holding the first slice),
      and the returned window is the whole sequence's, the same on every device.

  Returns:
    The `(..., T, C)` convolution and the float32 window after the last step.
  """
  length, past = x.shape[-2], kernel.shape[0] - 1
  if axis_name is not None:
    window = _entering_window(x, window, reset, axis_name)
  extended = jnp.concatenate([window.astype(x.dtype), x], axis=-2)
  episode = _episodes(reset, past)
  out = jnp.zeros_like(x) if bias is None else common.leading_ones(bias, x.ndim)
  for lag in range(past + 1):
    earlier = extended[..., past - lag : past - lag + length, :]
    if episode is not None:
      same = episode[..., past - lag : past - lag + length] == episode[..., past:]
      earlier = jnp.where(same[..., None], earlier, jnp.zeros_like(earlier))
    out = out + earlier * common.leading_ones(kernel[past - lag], x.ndim)
  window = _window_after(extended, episode, length).astype(jnp.float32)
  if axis_name is not None:
    index, size = axis_position(axis_name)
    window = from_device(window, index == size - 1, axis_name)
  return out, window


def zero_window(batch: tuple[int, ...], d_conv: int, channels: int) -> Array:
  """The `(*batch, d_conv - 1, channels)` float32 window of a sequence that has not started."""
  return jnp.zeros((*batch, d_conv - 1, channels), jnp.float32)
