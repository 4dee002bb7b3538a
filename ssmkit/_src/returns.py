"""Return estimators for reinforcement learning, as reverse linear recurrences.

The semantics are rlax's `multistep` functions (Sutton & Barto's notation: `rewards[t]` and
`discounts[t]` follow the action at step t, and a discount of 0 ends an episode), extended
with batch axes, a time `axis`, scan modes, and truncation: an episode cut by a time limit
bootstraps from the value of its final observation instead of reaching into the next episode.
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ssmkit._src import checks
from ssmkit._src.engine import axis_position, with_next_slice
from ssmkit._src.linear_recurrence import linear_recurrence
from ssmkit._src.modes import Mode
from ssmkit._src.trajectory import (
    check_rewards,
    cut_at_truncation,
    finish,
    lambda_recurrence,
    last_step,
    trajectory,
)

Array = jax.Array
ArrayLike = jax.typing.ArrayLike


def discounted_returns(
    rewards: ArrayLike,
    discounts: ArrayLike,
    bootstrap_value: ArrayLike = 0.0,
    *,
    axis: int = 0,
    mode: str | Mode = "auto",
    truncated: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
    stop_target_gradients: bool = False,
    axis_name: Hashable | None = None,
) -> Array:
  """Discounted returns G_t = r_t + d_t G_{t+1}, bootstrapped from `bootstrap_value`.

  Matches `rlax.discounted_returns` on one trajectory, and takes any batch axes.

  Args:
    rewards: `(..., T, ...)` float rewards, time on `axis`.
    discounts: `rewards`' shape or a scalar; 0 where an episode terminated.
    bootstrap_value: value of the state after the last step: a scalar, the batch shape
      (`rewards` without its time axis), or `rewards`' shape (rlax's per-step `v_t`, of
      which only the last step is used).
    axis: time axis of every per-step argument.
    mode: scan mode, "auto", "sequential", "parallel" or "chunked" (same results).
    truncated: boolean flags, `rewards`' shape: True where an episode was cut by a time
      limit after that step (see `generalized_advantage_estimation`).
    final_values: `rewards`' shape: at truncated steps, the value of the final observation
      of the cut episode; ignored elsewhere.
    stop_target_gradients: stop gradients from flowing through the returns.
    axis_name: sequence parallelism: inside `jax.shard_map` with the time axis split over
      the mesh axis of this name (consecutive slices of equal length in mesh order),
      return this device's slice of the returns of the whole trajectory (see
      `ssmkit.scan.linear_recurrence`). `bootstrap_value` is read on the device holding
      the last steps (a per-step `bootstrap_value` is that device's slice).

  Returns:
    Returns with `rewards`' shape, in the promoted dtype of the inputs.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.rl import discounted_returns
    >>> discounted_returns(jnp.ones(4), jnp.array([0.5, 0.0, 0.5, 0.5]), 2.0)
    Array([1.5, 1. , 2. , 2. ], dtype=float32)
  """
  rewards, axis = check_rewards(rewards, axis)
  bootstrap = checks.real_floating(bootstrap_value, "bootstrap_value")
  batch_shape = rewards.shape[:axis] + rewards.shape[axis + 1 :]
  if bootstrap.shape == rewards.shape:
    last = last_step(bootstrap, axis)
    bootstrap = jnp.zeros(batch_shape, bootstrap.dtype) if last is None else last
  elif bootstrap.ndim and bootstrap.shape != batch_shape:
    raise ValueError(
        f"`bootstrap_value` must be a scalar, have the batch shape {batch_shape} (`rewards` "
        f"without axis {axis}) or the shape of `rewards` {rewards.shape}; got {bootstrap.shape}."
    )
  traj = trajectory(rewards, discounts, bootstrap, 1.0, truncated, final_values, axis)
  bootstrap = jnp.broadcast_to(traj.values, batch_shape)
  return lambda_recurrence(traj, None, bootstrap, mode, stop_target_gradients, axis_name)


def lambda_returns(
    rewards: ArrayLike,
    discounts: ArrayLike,
    values: ArrayLike,
    lambda_: ArrayLike = 1.0,
    *,
    axis: int = 0,
    mode: str | Mode = "auto",
    truncated: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
    stop_target_gradients: bool = False,
    axis_name: Hashable | None = None,
) -> Array:
  """Lambda-returns G_t = r_t + d_t [(1 - lambda_t) v_t + lambda_t G_{t+1}].

  Matches `rlax.lambda_returns`: `values[t]` is the value of the state reached after step t
  (rlax's `v_t`), and the last one also bootstraps the last return. With lambda_ = 1 this is
  the discounted return; with lambda_ = 0 the one-step TD target.

  Args:
    rewards: `(..., T, ...)` float rewards, time on `axis`.
    discounts: `rewards`' shape or a scalar; 0 where an episode terminated.
    values: `rewards`' shape: values of the states after each step.
    lambda_: scalar or `rewards`' shape, >= 0 (checked when known at trace time);
      values above 1 weigh each later step by more than 1, as rlax computes them.
    axis: time axis of every per-step argument.
    mode: scan mode, "auto", "sequential", "parallel" or "chunked" (same results).
    truncated: boolean flags, `rewards`' shape: True where an episode was cut by a time
      limit after that step (see `generalized_advantage_estimation`).
    final_values: `rewards`' shape: at truncated steps, the value of the final observation
      of the cut episode (in place of `values`, which holds the next episode's first
      state in an auto-resetting environment); ignored elsewhere.
    stop_target_gradients: stop gradients from flowing through the returns.
    axis_name: sequence parallelism: inside `jax.shard_map` with the time axis split over
      the mesh axis of this name (consecutive slices of equal length in mesh order),
      return this device's slice of the returns of the whole trajectory (see
      `ssmkit.scan.linear_recurrence`). Each device passes its slice of every
      per-step argument, `values` included; the last value of the whole trajectory
      bootstraps the last return.

  Returns:
    Returns with `rewards`' shape, in the promoted dtype of the inputs.
  """
  traj = trajectory(rewards, discounts, values, lambda_, truncated, final_values, axis)
  checks.check_shape(traj.values, traj.rewards.shape, "values", "the shape of `rewards`")
  bootstrap = last_step(traj.values, traj.axis)
  return lambda_recurrence(traj, traj.values, bootstrap, mode, stop_target_gradients, axis_name)


def generalized_advantage_estimation(
    rewards: ArrayLike,
    discounts: ArrayLike,
    values: ArrayLike,
    lambda_: ArrayLike,
    *,
    axis: int = 0,
    mode: str | Mode = "auto",
    truncated: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
    stop_target_gradients: bool = False,
    axis_name: Hashable | None = None,
) -> Array:
  """Generalized advantage estimates A_t = delta_t + d_t lambda_t A_{t+1}.

  delta_t = r_t + d_t v_{t+1} - v_t, as `rlax.truncated_generalized_advantage_estimation`
  (note the argument order: `values` before `lambda_`).

  Termination and truncation: a discount of 0 marks termination (the episode really ended,
  nothing follows). An episode cut by a time limit did not end: its last step must
  bootstrap from the value of its final observation. In an auto-resetting vectorised
  environment `values[t + 1]` is then the value of the next episode's first state, which
  rlax would wrongly use. Pass `truncated[t] = True` with `final_values[t]` = v(final
  observation), and keep the ordinary discount at that step; the advantage then uses
  delta_t = r_t + d_t final_values[t] - v_t and stops there (A_t = delta_t).

  Args:
    rewards: `(..., T, ...)` float rewards, time on `axis`.
    discounts: `rewards`' shape or a scalar; 0 where an episode terminated.
    values: `rewards`' shape with T + 1 entries on `axis`: v(s_0) ... v(s_T), the last
      being the bootstrap value after the rollout.
    lambda_: scalar or `rewards`' shape, >= 0 (checked when known at trace time);
      values above 1 weigh each later step by more than 1, as rlax computes them.
    axis: time axis of every per-step argument.
    mode: scan mode, "auto", "sequential", "parallel" or "chunked" (same results).
    truncated: boolean flags, `rewards`' shape: True where an episode was cut by a time
      limit after that step.
    final_values: `rewards`' shape: at truncated steps, the value of the final observation
      of the cut episode; ignored elsewhere.
    stop_target_gradients: stop gradients from flowing through the advantages.
    axis_name: sequence parallelism: inside `jax.shard_map` with the time axis split over
      the mesh axis of this name (consecutive slices of equal length in mesh order),
      return this device's slice of the advantages of the whole trajectory. Each device
      passes `values` with T_local + 1 entries: the values of its T_local states, then
      the bootstrap value v(s_T) of the whole rollout. The value after a slice is the
      next device's first value, which each device receives from its neighbour (one
      `lax.ppermute` of one step), so the extra entry is read only on the last device;
      a device may as well pass the next device's first value there.

  Returns:
    Advantages with `rewards`' shape, in the promoted dtype of the inputs.

  Examples:
    An episode that is cut by a time limit after step 1 bootstraps from its final
    observation's value (here 10) instead of the next episode's first value (0):

    >>> import jax.numpy as jnp
    >>> from ssmkit.rl import generalized_advantage_estimation as gae
    >>> rewards, discounts = jnp.ones(3), jnp.full(3, 0.5)
    >>> values = jnp.zeros(4)
    >>> gae(rewards, discounts, values, 1.0)
    Array([1.75, 1.5 , 1.  ], dtype=float32)
    >>> gae(rewards, discounts, values, 1.0, truncated=jnp.array([False, True, False]),
    ...     final_values=jnp.full(3, 10.0))
    Array([4., 6., 1.], dtype=float32)
  """
  traj = trajectory(rewards, discounts, values, lambda_, truncated, final_values, axis)
  shape, axis = traj.rewards.shape, traj.axis
  expected = (*shape[:axis], shape[axis] + 1, *shape[axis + 1 :])
  checks.check_shape(
      traj.values, expected, "values", f"T + 1 = {shape[axis] + 1} entries on axis {axis}"
  )
  length = shape[axis]
  v_tm1 = lax.slice_in_dim(traj.values, 0, length, axis=axis)
  v_t = lax.slice_in_dim(traj.values, 1, length + 1, axis=axis)
  if axis_name is not None and length > 0:
    v_t = with_next_slice(v_t, v_tm1, 1, axis, axis_name)
  v_t, lambda_ = cut_at_truncation(traj, v_t)
  deltas = traj.rewards + traj.discounts * v_t - v_tm1
  advantages = linear_recurrence(
      (traj.discounts, lambda_), deltas, reverse=True, reset=traj.truncated, axis=axis, mode=mode,
      axis_name=axis_name, overwrite_b=True,
  )
  return finish(advantages, traj, stop_target_gradients)


def n_step_returns(
    rewards: ArrayLike,
    discounts: ArrayLike,
    values: ArrayLike,
    n: int,
    lambda_: ArrayLike = 1.0,
    *,
    axis: int = 0,
    truncated: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
    stop_target_gradients: bool = False,
    axis_name: Hashable | None = None,
) -> Array:
  """n-step bootstrapped returns: the lambda-return recursion over at most n steps.

  Matches `rlax.n_step_bootstrapped_returns`: the return at t sums rewards t .. t+n-1 and
  bootstraps from `values[t + n - 1]` (the value after step t+n-1), or from the last value
  where the window passes the end of the trajectory. A truncated step ends every window
  that reaches it, bootstrapping from `final_values`.

  Args:
    rewards: `(..., T, ...)` float rewards, time on `axis`.
    discounts: `rewards`' shape or a scalar; 0 where an episode terminated.
    values: `rewards`' shape: values of the states after each step.
    n: the number of steps, a positive int.
    lambda_: scalar or `rewards`' shape, >= 0 (checked when known at trace time);
      values above 1 weigh each later step by more than 1, as rlax computes them.
    axis: time axis of every per-step argument.
    truncated: boolean flags, `rewards`' shape: True where an episode was cut by a time
      limit after that step (see `generalized_advantage_estimation`).
    final_values: `rewards`' shape: at truncated steps, the value of the final observation
      of the cut episode; ignored elsewhere.
    stop_target_gradients: stop gradients from flowing through the returns.
    axis_name: sequence parallelism: inside `jax.shard_map` with the time axis split over
      the mesh axis of this name (consecutive slices of equal length in mesh order),
      return this device's slice of the returns of the whole trajectory. Each device
      receives the first n - 1 steps of the next device's slice (one `lax.ppermute` per
      per-step argument), so `n` may be at most the local length + 1.

  Returns:
    Returns with `rewards`' shape, in the promoted dtype of the inputs.
  """
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
    raise ValueError(f"`n` must be a positive int, got {n!r}.")
  traj = trajectory(rewards, discounts, values, lambda_, truncated, final_values, axis)
  checks.check_shape(traj.values, traj.rewards.shape, "values", "the shape of `rewards`")
  length = traj.rewards.shape[traj.axis]
  slices = 1 if axis_name is None else axis_position(axis_name)[1]
  if length == 0:
    return finish(traj.rewards, traj, stop_target_gradients)
  # Windows longer than the trajectory add nothing: the padding below is the identity.
  n = min(int(n), length * slices)
  if n - 1 > length:
    raise ValueError(
        f"`n`={n} needs the next {n - 1} steps past each slice, more than one device's slice "
        f"of {length} steps along `axis_name`={axis_name!r}: use n <= {length + 1}."
    )
  values, lambda_ = cut_at_truncation(traj, traj.values)

  def padded(x: Array, fill: Array | float) -> Array:
    """Time first, then n - 1 steps past the end: the next slice's, or `fill` after the last."""
    x = jnp.moveaxis(jnp.broadcast_to(x, traj.rewards.shape), traj.axis, 0)
    out = jnp.concatenate([x, jnp.broadcast_to(fill, (n - 1, *x.shape[1:]))])
    if axis_name is None or n == 1:
      return out
    return with_next_slice(out, x, n - 1, 0, axis_name)

  # Past the end: reward 0, discount 1, lambda 1 and the last value carry the bootstrap.
  last = jnp.moveaxis(values, traj.axis, 0)[-1:]
  rewards, discounts = padded(traj.rewards, 0.0), padded(traj.discounts, 1.0)
  lambda_, values = padded(lambda_, 1.0), padded(values, last)

  def window(x: Array, start: Array | int) -> Array:
    return lax.dynamic_slice_in_dim(x, start, length)

  truncated = None if traj.truncated is None else padded(traj.truncated, False)

  def step(k, targets):
    i = n - 1 - k
    d = window(discounts, i)
    lam = window(lambda_, i)
    if truncated is not None:  # selected, so that a NaN of the next episode stays there
      targets = jnp.where(window(truncated, i), jnp.zeros_like(targets), targets)
    return window(rewards, i) + d * ((1 - lam) * window(values, i) + lam * targets)

  returns = lax.fori_loop(0, n, step, window(values, n - 1))
  return finish(jnp.moveaxis(returns, 0, traj.axis), traj, stop_target_gradients)
