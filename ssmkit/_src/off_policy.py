"""Off-policy corrections and TD(lambda) errors, as reverse linear recurrences.

rlax's `vtrace`, `retrace` and `value_learning` TD(lambda) functions, with their names and
positional arguments (`v_tm1`, `r_t`, ... for one trajectory), extended as the estimators of
`returns.py` are: any batch axes and a time `axis` (counted on the leading axes; action
values keep their actions on the last axis), scan modes, per-step `lambda_`, and
truncation: an episode cut by a time limit bootstraps from the value of its final
observation and its trace stops there.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ssmkit._src import checks
from ssmkit._src.linear_recurrence import linear_recurrence
from ssmkit._src.modes import Mode
from ssmkit._src.trajectory import (
    Names,
    Trajectory,
    check_lambda,
    cut_at_truncation,
    lambda_recurrence,
    last_step,
    scalar_or_per_step,
    trajectory,
)

Array = jax.Array
ArrayLike = jax.typing.ArrayLike


class VTraceOutput(NamedTuple):
  """What `vtrace_td_error_and_advantage` returns, as rlax's `VTraceOutput`.

  Attributes:
    errors: V-trace TD errors v_s - V(x_s), `r_t`'s shape.
    pg_advantage: policy-gradient advantages min(rho_bar, rho_s) (q_s - V(x_s)).
    q_estimate: q_s = r_s + d_s [lambda_s v_{s+1} + (1 - lambda_s) V(x_{s+1})].
  """

  errors: Array
  pg_advantage: Array
  q_estimate: Array


def _rlax_names(values: str) -> Names:
  return Names("r_t", "discount_t", values)


def _per_step(x: Array, traj: Trajectory, name: str) -> Array:
  """`x` checked to have `r_t`'s shape, in the compute dtype."""
  checks.check_shape(x, traj.rewards.shape, name, "the shape of `r_t`")
  return x.astype(traj.rewards.dtype)


def _action_values(x: Array, traj: Trajectory, name: str, num_actions: int | None = None) -> Array:
  """`x` checked to have `r_t`'s shape plus a last axis of actions, in the compute dtype."""
  shape = traj.rewards.shape
  if x.shape[:-1] != shape or x.ndim != len(shape) + 1 or x.shape[-1] == 0 or (
      num_actions is not None and x.shape[-1] != num_actions
  ):
    actions = "A" if num_actions is None else num_actions
    raise ValueError(
        f"`{name}` must have the shape of `r_t` {shape} followed by the actions axis "
        f"({actions}), got {x.shape}."
    )
  return x.astype(traj.rewards.dtype)


def _actions(a: ArrayLike, traj: Trajectory, name: str, num_actions: int) -> Array:
  """Integer action indices of `r_t`'s shape, checked in [0, num_actions) when known."""
  a = jnp.asarray(a)
  if not jnp.issubdtype(a.dtype, jnp.integer):
    raise TypeError(f"`{name}` must be integer action indices, got dtype {a.dtype}.")
  checks.check_shape(a, traj.rewards.shape, name, "the shape of `r_t`")
  if not isinstance(a, jax.core.Tracer) and a.size:
    value = np.asarray(a)
    if value.min() < 0 or value.max() >= num_actions:
      raise ValueError(
          f"`{name}` must index the {num_actions} actions, got values in "
          f"[{value.min()}, {value.max()}]."
      )
  return a


def _take(q: Array, a: Array) -> Array:
  """q[..., a]: the value of each step's action."""
  return jnp.take_along_axis(q, a[..., None], axis=-1)[..., 0]


def _next_step(x: Array, last: Array, axis: int) -> Array:
  """x_{t+1} at every step t, and the last step of `last` after the end."""
  length = x.shape[axis]
  return jnp.concatenate(
      [
          lax.slice_in_dim(x, min(1, length), length, axis=axis),
          lax.slice_in_dim(last, max(length - 1, 0), length, axis=axis),
      ],
      axis,
  )


def _compute_dtype(traj: Trajectory) -> Trajectory:
  """`traj` whose results stay in the compute dtype (cast once, after the TD error)."""
  return traj._replace(out_dtype=traj.rewards.dtype)


def _vtrace_errors(
    traj: Trajectory,
    v_tm1: Array,
    rho_tm1: Array,
    clip_rho_threshold: ArrayLike,
    sample_mask: Array | None,
    mode: str | Mode,
    stop_target_gradients: bool,
) -> Array:
  """e_t = min(rho_bar, rho_t) delta_t + d_t c_t e_{t+1}, c_t = lambda_t min(1, rho_t).

  delta_t = r_t + d_t v_t - v_tm1_t. A step that is not learnable passes on the next
  step's error unchanged (as rlax); a truncated step ends the trace whatever its mask.
  Returned in the compute dtype.
  """
  v_t, lambda_ = cut_at_truncation(traj, traj.values)
  deltas = jnp.minimum(clip_rho_threshold, rho_tm1) * (traj.rewards + traj.discounts * v_t - v_tm1)
  discounts, c = traj.discounts, jnp.minimum(1.0, rho_tm1) * lambda_
  if sample_mask is not None:
    deltas = jnp.where(sample_mask, deltas, 0)
    discounts = jnp.where(sample_mask, discounts, 1)
    c = jnp.where(sample_mask, c, 1)
  # A truncated step ends the trace by `reset`: a selection, so a NaN of the next episode
  # stays there.
  errors = linear_recurrence((discounts, c), deltas, reverse=True, reset=traj.truncated,
                             axis=traj.axis, mode=mode, overwrite_b=True)  # TD errors made here
  if stop_target_gradients:
    return lax.stop_gradient(errors + v_tm1) - v_tm1
  return errors


def _vtrace_inputs(v_tm1, v_t, r_t, discount_t, rho_tm1, lambda_, sample_mask, axis,
                   truncated, final_values) -> tuple[Trajectory, Array, Array, Array | None]:
  """The checked trajectory, `v_tm1` and `rho_tm1` in the compute dtype, and the mask."""
  v_tm1, rho_tm1 = checks.real_floating(v_tm1, "v_tm1"), checks.real_floating(rho_tm1, "rho_tm1")
  traj = trajectory(r_t, discount_t, v_t, lambda_, truncated, final_values, axis,
                     _rlax_names("v_t"), extra=(v_tm1, rho_tm1))
  _per_step(traj.values, traj, "v_t")
  v_tm1, rho_tm1 = _per_step(v_tm1, traj, "v_tm1"), _per_step(rho_tm1, traj, "rho_tm1")
  if sample_mask is not None:
    sample_mask = jnp.asarray(sample_mask)
    checks.check_bool(sample_mask, "sample_mask")
    checks.check_shape(sample_mask, traj.rewards.shape, "sample_mask", "the shape of `r_t`")
  return traj, v_tm1, rho_tm1, sample_mask


def vtrace(
    v_tm1: ArrayLike,
    v_t: ArrayLike,
    r_t: ArrayLike,
    discount_t: ArrayLike,
    rho_tm1: ArrayLike,
    lambda_: ArrayLike = 1.0,
    clip_rho_threshold: float = 1.0,
    stop_target_gradients: bool = True,
    sample_mask: ArrayLike | None = None,
    *,
    axis: int = 0,
    mode: str | Mode = "auto",
    truncated: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
) -> Array:
  """V-trace errors v_s - V(x_s) from clipped importance weights (IMPALA).

  e_t = min(rho_bar, rho_t) delta_t + d_t c_t e_{t+1}, with delta_t = r_t + d_t v_t - v_tm1_t
  and c_t = lambda_t min(1, rho_t), backwards from e_T = 0. Matches `rlax.vtrace` on one
  trajectory (same positional arguments), and takes any batch axes.

  Args:
    v_tm1: `(..., T, ...)` values V(x_t) of the states the steps start from, time on `axis`.
    v_t: `v_tm1`'s shape: values of the states after each step (`v_tm1` shifted by one,
      then the bootstrap value).
    r_t: `v_tm1`'s shape: rewards.
    discount_t: `r_t`'s shape or a scalar; 0 where an episode terminated.
    rho_tm1: `r_t`'s shape: importance ratios pi(a_t | x_t) / mu(a_t | x_t).
    lambda_: scalar or `r_t`'s shape, in [0, 1].
    clip_rho_threshold: rho_bar, the clip of the ratios weighting the TD errors.
    stop_target_gradients: the error is stop_gradient(v_s) - V(x_s), so gradients reach
      `v_tm1` alone, through its -V(x_s) term (as rlax).
    sample_mask: boolean, `r_t`'s shape: False at steps that are not learnable, which pass
      the next step's error on unchanged (as rlax).
    axis: time axis of every per-step argument.
    mode: scan mode, "auto", "sequential", "parallel" or "chunked" (same results).
    truncated: boolean, `r_t`'s shape: True where an episode was cut by a time limit after
      that step: the step bootstraps from `final_values` and the trace stops there.
    final_values: `r_t`'s shape: at truncated steps, V(final observation of the cut
      episode); ignored elsewhere.

  Returns:
    The errors, `r_t`'s shape, in the promoted dtype of the inputs.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.rl import vtrace
    >>> vtrace(jnp.zeros(3), jnp.zeros(3), jnp.ones(3), jnp.full(3, 0.5), jnp.ones(3))
    Array([1.75, 1.5 , 1.  ], dtype=float32)

  References:
    Espeholt et al., "IMPALA: Scalable Distributed Deep-RL with Importance Weighted
    Actor-Learner Architectures", ICML 2018.
  """
  traj, v_tm1, rho_tm1, sample_mask = _vtrace_inputs(
      v_tm1, v_t, r_t, discount_t, rho_tm1, lambda_, sample_mask, axis, truncated, final_values
  )
  errors = _vtrace_errors(
      traj, v_tm1, rho_tm1, clip_rho_threshold, sample_mask, mode, stop_target_gradients
  )
  return errors.astype(traj.out_dtype)


def vtrace_td_error_and_advantage(
    v_tm1: ArrayLike,
    v_t: ArrayLike,
    r_t: ArrayLike,
    discount_t: ArrayLike,
    rho_tm1: ArrayLike,
    lambda_: ArrayLike = 1.0,
    clip_rho_threshold: float = 1.0,
    clip_pg_rho_threshold: float = 1.0,
    stop_target_gradients: bool = True,
    sample_mask: ArrayLike | None = None,
    *,
    axis: int = 0,
    mode: str | Mode = "auto",
    truncated: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
) -> VTraceOutput:
  """V-trace errors, policy-gradient advantages and Q estimates, as IMPALA's learner.

  The errors are `vtrace`'s; with v_s = errors + V(x_s) the V-trace targets,
  q_s = r_s + d_s [lambda_s v_{s+1} + (1 - lambda_s) V(x_{s+1})] (q_{T-1} bootstraps from
  `v_t`'s last step, a truncated step from `final_values`) and the advantage is
  min(clip_pg_rho_threshold, rho_s) (q_s - V(x_s)). Matches
  `rlax.vtrace_td_error_and_advantage`, gradients included.

  Args:
    v_tm1, v_t, r_t, discount_t, rho_tm1, lambda_, clip_rho_threshold: as `vtrace`.
    clip_pg_rho_threshold: the clip of the ratios weighting the advantages.
    stop_target_gradients, sample_mask, axis, mode, truncated, final_values: as `vtrace`.

  Returns:
    `VTraceOutput(errors, pg_advantage, q_estimate)`, each `r_t`'s shape, in the promoted
    dtype of the inputs.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.rl import vtrace_td_error_and_advantage
    >>> out = vtrace_td_error_and_advantage(
    ...     jnp.zeros(3), jnp.zeros(3), jnp.ones(3), jnp.full(3, 0.5), jnp.ones(3))
    >>> out.pg_advantage
    Array([1.75, 1.5 , 1.  ], dtype=float32)
  """
  traj, v_tm1, rho_tm1, sample_mask = _vtrace_inputs(
      v_tm1, v_t, r_t, discount_t, rho_tm1, lambda_, sample_mask, axis, truncated, final_values
  )
  errors = _vtrace_errors(
      traj, v_tm1, rho_tm1, clip_rho_threshold, sample_mask, mode, stop_target_gradients
  )
  next_targets = _next_step(errors + v_tm1, traj.values, traj.axis)
  next_values, lambda_ = cut_at_truncation(traj, _next_step(v_tm1, traj.values, traj.axis))
  q_estimate = traj.rewards + traj.discounts * (
      lambda_ * next_targets + (1 - lambda_) * next_values
  )
  pg_advantage = jnp.minimum(clip_pg_rho_threshold, rho_tm1) * (q_estimate - v_tm1)
  return VTraceOutput(*(x.astype(traj.out_dtype) for x in (errors, pg_advantage, q_estimate)))


def _retrace_errors(
    traj: Trajectory,
    qa_tm1: Array,
    qa_t: Array,
    expected_q_t: Array,
    ratio_t: Array,
    mode: str | Mode,
    stop_target_gradients: bool,
) -> Array:
  """G_t - q(x_{t-1}, a_{t-1}), G_t = r_t + d_t [E_t - c_t q_t + c_t G_{t+1}].

  c_t = lambda_t min(1, ratio_t) weighs the next step's target; the last step, and a
  truncated one, bootstrap from E_t alone (c_t = 0; E_t is `final_values` when truncated).
  """
  expected_q_t, lambda_ = cut_at_truncation(traj, expected_q_t)
  c = jnp.minimum(1.0, ratio_t) * lambda_
  length = c.shape[traj.axis]
  c = jnp.where(lax.broadcasted_iota(jnp.int32, c.shape, traj.axis) == length - 1, 0, c)
  next_q = c * qa_t
  if traj.truncated is not None:  # selected: the next episode's q may be NaN
    next_q = jnp.where(traj.truncated, jnp.zeros_like(next_q), next_q)
  inputs = traj.rewards + traj.discounts * (expected_q_t - next_q)
  targets = linear_recurrence((traj.discounts, c), inputs, reverse=True, reset=traj.truncated,
                              axis=traj.axis, mode=mode, overwrite_b=True)  # inputs made here
  if stop_target_gradients:
    targets = lax.stop_gradient(targets)
  return (targets - qa_tm1).astype(traj.out_dtype)


def retrace(
    q_tm1: ArrayLike,
    q_t: ArrayLike,
    a_tm1: ArrayLike,
    a_t: ArrayLike,
    r_t: ArrayLike,
    discount_t: ArrayLike,
    pi_t: ArrayLike,
    mu_t: ArrayLike,
    lambda_: ArrayLike,
    eps: float = 1e-8,
    stop_target_gradients: bool = True,
    *,
    axis: int = 0,
    mode: str | Mode = "auto",
    truncated: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
) -> Array:
  """Retrace errors G_t - q(x_{t-1}, a_{t-1}) for discrete actions.

  G_t = r_t + d_t [E_pi q_t - c_t q_t(a_t) + c_t G_{t+1}] with
  c_t = lambda_t min(1, pi_t(a_t) / (mu_t + eps)); the last step bootstraps from
  E_pi q_t = sum_a pi_t(a) q_t(a) alone. Matches `rlax.retrace` on one trajectory.

  Args:
    q_tm1: `(..., T, ..., A)` action values of the states the steps start from, time on
      `axis`, actions last.
    q_t: `q_tm1`'s shape: action values of the states after each step (target network).
    a_tm1: `(..., T, ...)` integer actions taken at each step.
    a_t: `a_tm1`'s shape: actions taken from the states after each step (the next step's).
    r_t: `a_tm1`'s shape: rewards.
    discount_t: `r_t`'s shape or a scalar; 0 where an episode terminated.
    pi_t: `q_t`'s shape: target-policy probabilities of every action after each step.
    mu_t: `r_t`'s shape: behaviour-policy probability of `a_t`.
    lambda_: scalar or `r_t`'s shape, in [0, 1].
    eps: added to `mu_t` before dividing.
    stop_target_gradients: stop gradients from flowing through the targets G_t.
    axis: time axis of every per-step argument, counted on `r_t`'s axes.
    mode: scan mode, "auto", "sequential", "parallel" or "chunked" (same results).
    truncated: boolean, `r_t`'s shape: True where an episode was cut by a time limit after
      that step: G_t bootstraps from `final_values` and the trace stops there.
    final_values: `r_t`'s shape: at truncated steps, the target policy's value of the
      final observation of the cut episode, sum_a pi(a) q(a) there; ignored elsewhere.

  Returns:
    The errors, `r_t`'s shape, in the promoted dtype of the inputs.

  References:
    Munos et al., "Safe and Efficient Off-Policy Reinforcement Learning", NeurIPS 2016.
  """
  q_tm1, pi_t, mu_t = (checks.real_floating(x, n)
                       for x, n in ((q_tm1, "q_tm1"), (pi_t, "pi_t"), (mu_t, "mu_t")))
  traj = trajectory(r_t, discount_t, q_t, lambda_, truncated, final_values, axis,
                     _rlax_names("q_t"), extra=(q_tm1, pi_t, mu_t))
  q_t = _action_values(traj.values, traj, "q_t")
  num_actions = q_t.shape[-1]
  q_tm1 = _action_values(q_tm1, traj, "q_tm1", num_actions)
  pi_t = _action_values(pi_t, traj, "pi_t", num_actions)
  mu_t = _per_step(mu_t, traj, "mu_t")
  a_tm1 = _actions(a_tm1, traj, "a_tm1", num_actions)
  a_t = _actions(a_t, traj, "a_t", num_actions)
  ratio_t = _take(pi_t, a_t) / (mu_t + eps)
  return _retrace_errors(
      traj, _take(q_tm1, a_tm1), _take(q_t, a_t), jnp.sum(pi_t * q_t, axis=-1), ratio_t, mode,
      stop_target_gradients,
  )


def retrace_continuous(
    q_tm1: ArrayLike,
    q_t: ArrayLike,
    v_t: ArrayLike,
    r_t: ArrayLike,
    discount_t: ArrayLike,
    log_rhos: ArrayLike,
    lambda_: ArrayLike,
    stop_target_gradients: bool = True,
    *,
    axis: int = 0,
    mode: str | Mode = "auto",
    truncated: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
) -> Array:
  """Retrace errors G_t - q_tm1_t from log importance weights (continuous actions).

  G_t = r_t + d_t [v_t - c_{t+1} q_t + c_{t+1} G_{t+1}] with c = lambda_ min(1, exp(log_rhos)),
  where `q_t`, `log_rhos` and a per-step `lambda_` hold the T - 1 steps after the first
  (rlax's layout); G_{T-1} = r_{T-1} + d_{T-1} v_{T-1}. Matches `rlax.retrace_continuous`.

  Args:
    q_tm1: `(..., T, ...)` values q(x_t, a_t) of the actions taken, time on `axis`.
    q_t: `q_tm1`'s shape with T - 1 steps (none when T = 0): q(x_{t+1}, a_{t+1}), the next
      steps' actions under the target network.
    v_t: `q_tm1`'s shape: the target policy's values of the states after each step.
    r_t: `q_tm1`'s shape: rewards.
    discount_t: `r_t`'s shape or a scalar; 0 where an episode terminated.
    log_rhos: `q_t`'s shape: log pi(a_{t+1} | x_{t+1}) - log mu(a_{t+1} | x_{t+1}).
    lambda_: scalar or `log_rhos`' shape, in [0, 1].
    stop_target_gradients: stop gradients from flowing through the targets G_t.
    axis: time axis of every per-step argument.
    mode: scan mode, "auto", "sequential", "parallel" or "chunked" (same results).
    truncated: boolean, `r_t`'s shape: True where an episode was cut by a time limit after
      that step: G_t bootstraps from `final_values` and the trace stops there.
    final_values: `r_t`'s shape: at truncated steps, the target policy's value of the
      final observation of the cut episode (in place of `v_t`); ignored elsewhere.

  Returns:
    The errors, `r_t`'s shape, in the promoted dtype of the inputs.

  References:
    Munos et al., "Safe and Efficient Off-Policy Reinforcement Learning", NeurIPS 2016.
  """
  q_tm1, q_t, log_rhos = (
      checks.real_floating(x, n) for x, n in ((q_tm1, "q_tm1"), (q_t, "q_t"), (log_rhos, "log_rhos"))
  )
  shape = jnp.shape(r_t)
  axis = checks.canonical_axis(axis, max(len(shape), 1))
  if len(shape) and shape[axis]:
    after_first = (*shape[:axis], shape[axis] - 1, *shape[axis + 1 :])
    for x, name in ((q_t, "q_t"), (log_rhos, "log_rhos")):
      checks.check_shape(x, after_first, name, f"`r_t`'s with T - 1 steps on axis {axis}")
    lambda_ = scalar_or_per_step(lambda_, after_first, "lambda_", "log_rhos")
    check_lambda(lambda_)
    # One more step at the end, which the recursion never reads (c = 0 there).
    step = lambda x: jnp.zeros((*x.shape[:axis], 1, *x.shape[axis + 1 :]), x.dtype)
    pad = lambda x: jnp.concatenate([x, step(x)], axis)
    q_t, log_rhos = pad(q_t), pad(log_rhos)
    lambda_ = pad(lambda_) if lambda_.ndim else lambda_
  traj = trajectory(r_t, discount_t, v_t, lambda_, truncated, final_values, axis,
                     _rlax_names("v_t"), extra=(q_tm1, q_t, log_rhos))
  _per_step(traj.values, traj, "v_t")
  q_tm1, q_t, log_rhos = (_per_step(x, traj, n) for x, n in (
      (q_tm1, "q_tm1"), (q_t, "q_t"), (log_rhos, "log_rhos")))
  return _retrace_errors(
      traj, q_tm1, q_t, traj.values, jnp.exp(log_rhos), mode, stop_target_gradients
  )


def td_lambda(
    v_tm1: ArrayLike,
    r_t: ArrayLike,
    discount_t: ArrayLike,
    v_t: ArrayLike,
    lambda_: ArrayLike,
    stop_target_gradients: bool = True,
    *,
    axis: int = 0,
    mode: str | Mode = "auto",
    truncated: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
) -> Array:
  """TD(lambda) errors G_t - v_tm1_t, G the lambda-returns of `v_t` (`lambda_returns`).

  Matches `rlax.td_lambda` on one trajectory, and takes any batch axes.

  Args:
    v_tm1: `(..., T, ...)` values of the states the steps start from, time on `axis`.
    r_t: `v_tm1`'s shape: rewards.
    discount_t: `r_t`'s shape or a scalar; 0 where an episode terminated.
    v_t: `r_t`'s shape: values of the states after each step; the last bootstraps.
    lambda_: scalar or `r_t`'s shape, in [0, 1].
    stop_target_gradients: stop gradients from flowing through the targets G_t.
    axis: time axis of every per-step argument.
    mode: scan mode, "auto", "sequential", "parallel" or "chunked" (same results).
    truncated: boolean, `r_t`'s shape: True where an episode was cut by a time limit after
      that step: G_t bootstraps from `final_values` and the return stops there.
    final_values: `r_t`'s shape: at truncated steps, the value of the final observation of
      the cut episode; ignored elsewhere.

  Returns:
    The errors, `r_t`'s shape, in the promoted dtype of the inputs.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.rl import td_lambda
    >>> td_lambda(jnp.ones(3), jnp.ones(3), jnp.full(3, 0.5), jnp.zeros(3), 1.0)
    Array([0.75, 0.5 , 0.  ], dtype=float32)
  """
  v_tm1 = checks.real_floating(v_tm1, "v_tm1")
  traj = trajectory(r_t, discount_t, v_t, lambda_, truncated, final_values, axis,
                     _rlax_names("v_t"), extra=(v_tm1,))
  v_t = _per_step(traj.values, traj, "v_t")
  v_tm1 = _per_step(v_tm1, traj, "v_tm1")
  targets = lambda_recurrence(
      _compute_dtype(traj), v_t, last_step(v_t, traj.axis), mode, stop_target_gradients, None
  )
  return (targets - v_tm1).astype(traj.out_dtype)


def q_lambda(
    q_tm1: ArrayLike,
    a_tm1: ArrayLike,
    r_t: ArrayLike,
    discount_t: ArrayLike,
    q_t: ArrayLike,
    lambda_: ArrayLike,
    stop_target_gradients: bool = True,
    *,
    axis: int = 0,
    mode: str | Mode = "auto",
    truncated: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
) -> Array:
  """Peng's or Watkins' Q(lambda) errors G_t - q_tm1(a_tm1), bootstrapping from max_a q_t.

  G is the lambda-return of v_t = max_a q_t(a) (`lambda_returns`); a scalar `lambda_` gives
  Peng's Q(lambda), a per-step one that is 0 after exploratory actions Watkins'. Matches
  `rlax.q_lambda` on one trajectory.

  Args:
    q_tm1: `(..., T, ..., A)` action values of the states the steps start from, time on
      `axis`, actions last.
    a_tm1: `(..., T, ...)` integer actions taken at each step.
    r_t: `a_tm1`'s shape: rewards.
    discount_t: `r_t`'s shape or a scalar; 0 where an episode terminated.
    q_t: `q_tm1`'s shape: action values of the states after each step.
    lambda_: scalar or `r_t`'s shape, in [0, 1].
    stop_target_gradients: stop gradients from flowing through the targets G_t.
    axis: time axis of every per-step argument, counted on `r_t`'s axes.
    mode: scan mode, "auto", "sequential", "parallel" or "chunked" (same results).
    truncated: boolean, `r_t`'s shape: True where an episode was cut by a time limit after
      that step: G_t bootstraps from `final_values` and the return stops there.
    final_values: `r_t`'s shape: at truncated steps, max_a q(final observation, a) of the
      cut episode; ignored elsewhere.

  Returns:
    The errors, `r_t`'s shape, in the promoted dtype of the inputs.
  """
  q_tm1 = checks.real_floating(q_tm1, "q_tm1")
  traj = trajectory(r_t, discount_t, q_t, lambda_, truncated, final_values, axis,
                     _rlax_names("q_t"), extra=(q_tm1,))
  q_t = _action_values(traj.values, traj, "q_t")
  q_tm1 = _action_values(q_tm1, traj, "q_tm1", q_t.shape[-1])
  a_tm1 = _actions(a_tm1, traj, "a_tm1", q_t.shape[-1])
  v_t = jnp.max(q_t, axis=-1)
  targets = lambda_recurrence(
      _compute_dtype(traj), v_t, last_step(v_t, traj.axis), mode, stop_target_gradients, None
  )
  return (targets - _take(q_tm1, a_tm1)).astype(traj.out_dtype)
