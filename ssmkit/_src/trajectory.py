"""The inputs every return estimator shares, checked and cast to one compute dtype (a
`Trajectory`), and the lambda-return recurrence over them that `returns` and `off_policy`
build on."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ssmkit._src import checks
from ssmkit._src.linear_recurrence import accumulation_dtype, linear_recurrence
from ssmkit._src.modes import Mode

Array = jax.Array
ArrayLike = jax.typing.ArrayLike


class Names(NamedTuple):
  """The names error messages give the shared arguments: ssmkit's, or rlax's `r_t`, ..."""

  rewards: str = "rewards"
  discounts: str = "discounts"
  values: str = "values"


SSMKIT_NAMES = Names()


class Trajectory(NamedTuple):
  """Checked inputs cast to the compute dtype; each estimator checks its own `values`."""

  rewards: Array
  discounts: Array
  lambda_: Array
  values: Array
  truncated: Array | None
  final_values: Array | None
  axis: int
  out_dtype: jnp.dtype


def check_rewards(rewards: ArrayLike, axis: int, name: str = "rewards") -> tuple[Array, int]:
  """`rewards` checked, and its time axis in [0, ndim)."""
  rewards = checks.real_floating(rewards, name)
  if rewards.ndim == 0:
    raise ValueError(f"`{name}` must have a time axis, got a scalar.")
  return rewards, checks.canonical_axis(axis, rewards.ndim)


def scalar_or_per_step(
    x: ArrayLike, shape: tuple[int, ...], name: str, like: str = "rewards"
) -> Array:
  x = checks.real_floating(x, name)
  if x.ndim and x.shape != shape:
    raise ValueError(
        f"`{name}` must be a scalar or have the shape of `{like}` {shape}, got {x.shape}."
    )
  return x


def check_lambda(lambda_: Array) -> None:
  """Checks lambda_ >= 0 where the value is known at trace time.

  As rlax, values above 1 are accepted, eagerly and under `jit` alike: the same formulas
  then weigh the bootstrapped tail more than the one-step target (rlax's own tests pass
  importance ratios up to 2 as `lambda_`).
  """
  if isinstance(lambda_, jax.core.Tracer):
    return
  value = np.asarray(lambda_)
  if not np.all(value >= 0):
    raise ValueError(f"`lambda_` must be >= 0, got values down to {value.min()}.")


def trajectory(
    rewards: ArrayLike,
    discounts: ArrayLike,
    values: ArrayLike,
    lambda_: ArrayLike,
    truncated: ArrayLike | None,
    final_values: ArrayLike | None,
    axis: int,
    names: Names = SSMKIT_NAMES,
    extra: tuple[Array, ...] = (),
) -> Trajectory:
  """Checks the arguments every estimator shares and casts them to one compute dtype.

  `extra` are the estimator's other float inputs: they take part in the dtype promotion,
  and the estimator casts them to the compute dtype, `rewards`' dtype in the result.
  """
  rewards, axis = check_rewards(rewards, axis, names.rewards)
  shape = rewards.shape
  discounts = scalar_or_per_step(discounts, shape, names.discounts, names.rewards)
  lambda_ = scalar_or_per_step(lambda_, shape, "lambda_", names.rewards)
  check_lambda(lambda_)
  values = checks.real_floating(values, names.values)
  if (truncated is None) != (final_values is None):
    raise ValueError(
        "`truncated` and `final_values` go together: pass both (the flags and the values of "
        "the final observations of truncated episodes) or neither."
    )
  parts = [rewards, discounts, lambda_, values]
  if truncated is not None:
    truncated = jnp.asarray(truncated)
    checks.check_bool(truncated, "truncated")
    checks.check_shape(truncated, shape, "truncated", f"the shape of `{names.rewards}`")
    final_values = checks.real_floating(final_values, "final_values")
    checks.check_shape(final_values, shape, "final_values", f"the shape of `{names.rewards}`")
    parts.append(final_values)
  out_dtype = jnp.result_type(*parts, *extra)
  dtype = accumulation_dtype(out_dtype)
  if final_values is not None:
    final_values = final_values.astype(dtype)
  return Trajectory(
      rewards.astype(dtype),
      discounts.astype(dtype),
      lambda_.astype(dtype),
      values.astype(dtype),
      truncated,
      final_values,
      axis,
      out_dtype,
  )


def cut_at_truncation(
    traj: Trajectory, next_values: Array | None
) -> tuple[Array | None, Array]:
  """Bootstrap values and lambdas with truncated steps ending their episode.

  At a truncated step the return stops there: it bootstraps from the final observation's
  value and takes nothing from the next step (lambda = 0), which belongs to a new episode.
  `next_values=None` stands for values that no step reads (lambda = 1 everywhere).
  """
  if traj.truncated is None:
    return next_values, traj.lambda_
  if next_values is None:
    next_values = jnp.zeros_like(traj.final_values)
  return (
      jnp.where(traj.truncated, traj.final_values, next_values),
      jnp.where(traj.truncated, jnp.zeros_like(traj.lambda_), traj.lambda_),
  )


def finish(x: Array, traj: Trajectory, stop_target_gradients: bool) -> Array:
  x = x.astype(traj.out_dtype)
  return lax.stop_gradient(x) if stop_target_gradients else x


def lambda_recurrence(
    traj: Trajectory,
    next_values: Array | None,
    bootstrap: Array | None,
    mode: str | Mode,
    stop_target_gradients: bool,
    axis_name: Hashable | None,
) -> Array:
  """G_t = r_t + d_t [(1 - lambda_t) v_t + lambda_t G_{t+1}] backwards from G_T = bootstrap.

  `next_values=None` (discounted returns) drops the value term: G_t = r_t + d_t G_{t+1}.
  With `axis_name`, `bootstrap` is read on the device holding the last steps.
  """
  next_values, lambda_ = cut_at_truncation(traj, next_values)
  if next_values is None:
    decay, inputs = traj.discounts, traj.rewards
  else:
    # Factors, not their product: the sequential scan multiplies them step by step.
    decay = (traj.discounts, lambda_)
    inputs = traj.rewards + traj.discounts * (1 - lambda_) * next_values
  # A truncated step cuts the return off from the next episode by `reset`, a selection, so
  # that a NaN there stays there (lambda = 0 alone would multiply it by zero).
  returns = linear_recurrence(
      decay, inputs, bootstrap, reverse=True, reset=traj.truncated, axis=traj.axis, mode=mode,
      axis_name=axis_name, overwrite_b=next_values is not None,  # computed here, unless rewards
  )
  return finish(returns, traj, stop_target_gradients)


def last_step(x: Array, axis: int) -> Array | None:
  """x at the last time step (the batch shape), or None for an empty trajectory."""
  return None if x.shape[axis] == 0 else lax.index_in_dim(x, -1, axis, keepdims=False)
