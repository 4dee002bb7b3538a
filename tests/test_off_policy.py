"""V-trace, Retrace, TD(lambda) and Q(lambda) of `ssmkit.rl`: rlax's vectors, rlax, float64 loops."""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax

import references
from ssmkit import rl

MODES = ["sequential", "parallel", "chunked", "auto"]
ACTIONS = 3
# rlax's vectors are batch-major: every mode on them as given, and "auto" time-major.
LAYOUTS = [*((mode, False) for mode in MODES), ("auto", True)]
LAYOUT_IDS = [*MODES, "auto-time_major"]


def _assert_close(actual, expected, dtype=np.float64):
  """Elementwise, relative to the largest magnitude (rounding in long sums scales with it)."""
  tol = 1e-10 if np.dtype(dtype) == np.float64 else 2e-5
  expected = np.asarray(expected, np.float64)
  scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol * scale)


def _outputs(x):
  """The arrays an estimator returns: one, or the fields of a `VTraceOutput`."""
  return list(x) if isinstance(x, tuple) else [x]


def _assert_outputs_close(actual, expected, dtype=np.float64):
  for a, b in zip(_outputs(actual), _outputs(expected), strict=True):
    _assert_close(a, b, dtype)


def _softmax_of_action(logits, actions):
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  return np.take_along_axis(probs / probs.sum(-1, keepdims=True), actions[..., None], -1)[..., 0]


# rlax's published test vectors (rlax/_src/vtrace_test.py and value_learning_test.py), two
# trajectories each, batch-major. V-trace's ratios pi(a) / mu(a) come from policy logits.
VT_ACTIONS = np.array([[0, 1, 0, 0], [1, 0, 0, 1]])
VT_RHO = (_softmax_of_action(np.array([[[0.4, 0.5], [9.2, 8.8], [0.7, 4.4], [7.9, 1.4]],
                                       [[1.0, 0.9], [1.0, -1.0], [-4.3, 8.7], [0.8, 0.3]]]),
                             VT_ACTIONS)
          / _softmax_of_action(np.array([[[8.9, 0.7], [5.0, 1.0], [0.6, 0.1], [-0.9, -0.1]],
                                         [[0.3, -5.0], [1.0, -8.0], [0.3, 1.7], [4.7, 3.3]]]),
                               VT_ACTIONS)).astype(np.float32)
VT_R_T = np.array([[-1.3, -1.3, 2.3, 42.0], [1.3, 5.3, -3.3, -5.0]], np.float32)
VT_DISCOUNT_T = np.array([[0.0, 0.89, 0.85, 0.99], [0.88, 1.0, 0.83, 0.95]], np.float32)
VT_V_TM1 = np.array([[2.1, 1.1, -3.1, 0.0], [3.1, 0.1, -1.1, 7.4]], np.float32)
VT_V_T = np.concatenate([VT_V_TM1[:, 1:], np.array([[8.4], [-1.2]], np.float32)], axis=1)

TD_V_TM1 = np.array([[1.1, -1.1, 3.1], [2.1, -1.1, -2.1]], np.float32)
TD_DISCOUNT_T = np.array([[0.0, 0.89, 0.85], [0.88, 1.0, 0.83]], np.float32)
TD_R_T = np.array([[-1.3, -1.3, 2.3], [1.3, 5.3, -3.3]], np.float32)
TD_V_T = np.concatenate([TD_V_TM1[:, 1:], np.array([[2.2], [-1.2]], np.float32)], axis=1)
QL_Q_TM1 = np.array([[[1.1, 2.1], [-1.1, 1.1], [3.1, -3.1]],
                     [[2.1, 3.1], [-1.1, 0.1], [-2.1, -1.1]]], np.float32)
QL_A_TM1 = np.array([[0, 1, 0], [1, 0, 0]], np.int32)
QL_Q_T = np.array([[[1.2, 2.2], [-1.2, 0.2], [2.2, -1.2]],
                   [[4.2, 2.2], [1.2, 1.2], [-1.2, -2.2]]], np.float32)

RT_QS = np.array([[[1.1, 2.1], [-1.1, 1.1], [3.1, -3.1], [-1.2, 0.0]],
                  [[2.1, 3.1], [9.5, 0.1], [-2.1, -1.1], [0.1, 7.4]]], np.float32)
RT_TARGNET_QS = np.array([[[1.2, 2.2], [-1.2, 0.2], [2.2, -1.2], [-2.25, -6.0]],
                          [[4.2, 2.2], [1.2, 1.2], [-1.2, -2.2], [1.5, 1.0]]], np.float32)
RT_ACTIONS = np.array([[0, 1, 0, 0], [1, 0, 0, 1]], np.int32)
RT_PI = np.array([[[0.5, 0.5], [0.2, 0.8], [0.6, 0.4], [0.9, 0.1]],
                  [[0.1, 0.9], [1.0, 0.0], [0.3, 0.7], [0.7, 0.3]]], np.float32)
RT_MU = np.array([[0.5, 0.1, 0.9, 0.3], [0.4, 0.6, 1.0, 0.9]], np.float32)
RC_QS = np.array([[1.1, 1.1, 3.1, -1.2], [3.1, 9.5, -2.1, 7.4]], np.float32)
RC_TARGNET_QS = np.array([[1.2, 0.2, 2.2, -2.25], [2.2, 1.2, -1.2, 1.0]], np.float32)
RC_EXP_Q_T = np.array([[-0.08, 0.84000003, -2.625], [1.2, -1.9, 1.3499999]], np.float32)
RC_LOG_RHOS = np.array([[2.0794415, -0.4054651, 1.0986122],
                        [0.51082563, -1.2039728, -1.0986123]], np.float32)


def _layout(time_major, *arrays):
  """The batch-major vectors as given, or time-major (batch and time swapped), and the axis."""
  if not time_major:
    return 1, arrays
  return 0, tuple(np.swapaxes(x, 0, 1) if np.ndim(x) >= 2 else x for x in arrays)


def _batch_major(time_major, x):
  return np.swapaxes(np.asarray(x), 0, 1) if time_major else np.asarray(x)


@pytest.mark.parametrize("mode, time_major", LAYOUTS, ids=LAYOUT_IDS)
def test_rlax_vectors_vtrace(mode, time_major):
  axis, args = _layout(time_major, VT_V_TM1, VT_V_T, VT_R_T, VT_DISCOUNT_T, VT_RHO)
  out = rl.vtrace_td_error_and_advantage(*args, axis=axis, mode=mode)
  expected_td = [[-1.6155143, -3.4973226, 1.8670533, 5.0316002e1],
                 [1.4662437, 3.6116405, -8.3327293e-5, -1.3540000e1]]
  expected_pg = [[-1.6155143, -3.4973226, 1.8670534, 5.0316002e1],
                 [1.4662433, 3.6116405, -8.3369283e-05, -1.3540000e1]]
  np.testing.assert_allclose(_batch_major(time_major, out.errors), expected_td, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_batch_major(time_major, out.pg_advantage), expected_pg, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(rl.vtrace(*args, axis=axis, mode=mode), out.errors)
  # rlax's q-estimate property: the V-trace target is V + clipped rho (q - V), lambda = 0.8.
  out = rl.vtrace_td_error_and_advantage(*args, 0.8, axis=axis, mode=mode)
  clipped_rho = np.minimum(1.0, args[4])
  np.testing.assert_allclose(out.errors + args[0], args[0] + clipped_rho * (out.q_estimate - args[0]),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode, discount_t, lambda_", [
    ("parallel", [0, 1, 1, 0, 0, 1, 1, 1], 1.0),
    ("chunked", [0, 1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]),
    ("sequential", [0, 1, 1, 1, 0, 1, 1, 1], [1, 1, 1, 0, 1, 1, 1, 1]),
], ids=["scalar_lambda", "vector_lambda", "vector_lambda_truncation"])
def test_rlax_vectors_vtrace_episodes_are_independent(mode, discount_t, lambda_):
  """rlax's test: a discount of 0 (or a lambda of 0) after step 3 splits the trace in two."""
  r_t, rho_tm1, v_tm1 = np.random.default_rng(0).random((3, 8)).astype(np.float32)
  v_t = np.append(v_tm1[1:], np.float32(10.0))
  discount_t, lambda_ = np.float32(discount_t), np.float32(lambda_)
  fn = functools.partial(rl.vtrace, mode=mode)
  whole = fn(v_tm1, v_t, r_t, discount_t, rho_tm1, lambda_)
  part = lambda s: fn(v_tm1[s], v_t[s], r_t[s], discount_t[s], rho_tm1[s],
                      lambda_[s] if lambda_.ndim else lambda_)
  np.testing.assert_allclose(whole[:4], part(slice(0, 4)), rtol=1e-6)
  np.testing.assert_allclose(whole[4:], part(slice(4, 8)), rtol=1e-6)


@pytest.mark.parametrize("mode, time_major", LAYOUTS, ids=LAYOUT_IDS)
def test_rlax_vectors_td_lambda_and_q_lambda(mode, time_major):
  axis, args = _layout(time_major, TD_V_TM1, TD_R_T, TD_DISCOUNT_T, TD_V_T)
  np.testing.assert_allclose(
      _batch_major(time_major, rl.td_lambda(*args, 0.75, axis=axis, mode=mode)),
      [[-2.4, 3.2732253, 1.0700002], [-0.01701999, 2.6529999, -2.196]], rtol=1e-5,
  )
  axis, args = _layout(time_major, QL_Q_TM1, QL_A_TM1, TD_R_T, TD_DISCOUNT_T, QL_Q_T)
  np.testing.assert_allclose(
      _batch_major(time_major, rl.q_lambda(*args, 0.75, axis=axis, mode=mode)),
      [[-2.4, 0.427975, 1.07], [0.69348, 3.478, -2.196]], rtol=1e-5,
  )


@pytest.mark.parametrize("mode, time_major", LAYOUTS, ids=LAYOUT_IDS)
def test_rlax_vectors_retrace(mode, time_major):
  axis, args = _layout(
      time_major, RT_QS[:, :-1], RT_TARGNET_QS[:, 1:], RT_ACTIONS[:, :-1], RT_ACTIONS[:, 1:],
      VT_R_T[:, :-1], VT_DISCOUNT_T[:, :-1], RT_PI[:, 1:], RT_MU[:, 1:],
  )
  loss = 0.5 * np.square(_batch_major(time_major, rl.retrace(*args, 0.9, axis=axis, mode=mode)))
  np.testing.assert_allclose(
      loss, [[2.8800001, 3.8934109, 4.5942383], [3.1121615e-1, 2.0253206e1, 3.1601219e-3]], rtol=1e-5
  )


@pytest.mark.parametrize("mode, time_major", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("terminal, expected", [
    (False, [[2.880000e00, 5.643226e00, 4.594238e00], [4.236919e-02, 2.044066e01, 3.160141e-03]]),
    (True, [[2.880000e00, 1.365213e00, 4.594238e00], [2.448239e-02, 1.860500e01, 3.160141e-03]]),
])
def test_rlax_vectors_retrace_continuous(mode, time_major, terminal, expected):
  # rlax's terminal case: lambda 0 at the second of the two steps after the first.
  lambda_ = np.float32([[0.9, 0.0 if terminal else 0.9]] * 2)
  axis, args = _layout(
      time_major, RC_QS[:, :-1], RC_TARGNET_QS[:, 1:-1], RC_EXP_Q_T, VT_R_T[:, :-1],
      VT_DISCOUNT_T[:, :-1], RC_LOG_RHOS[:, 1:], lambda_,
  )
  loss = 0.5 * np.square(_batch_major(time_major, rl.retrace_continuous(*args, axis=axis, mode=mode)))
  np.testing.assert_allclose(loss, expected, rtol=1e-5)


class Spec(NamedTuple):
  """An estimator, its rlax counterpart, and how to call both on the same arrays.

  `arrays(rng, length, batch, lam)` gives the array arguments of a time-major `(T, B)`
  rollout in positional order (actions last on action values); `call(fn, arrays, stop)`
  calls either function with them and the non-array arguments.
  """

  ours: Callable
  theirs: Callable
  arrays: Callable
  call: Callable


def _rollout(rng, shape):
  rewards = rng.normal(size=shape)
  discounts = rng.uniform(0.8, 1.0, shape) * (rng.uniform(size=shape) > 0.1)
  return rewards, discounts


def _vtrace_arrays(rng, length, batch, lam):
  shape = (length, batch)
  r, d = _rollout(rng, shape)
  rho = np.exp(rng.normal(scale=0.7, size=shape))  # both sides of the clips at 1
  mask = rng.uniform(size=shape) > 0.2
  return [rng.normal(size=shape), rng.normal(size=shape), r, d, rho, lam, mask]


def _probs(rng, shape):
  logits = rng.normal(size=(*shape, ACTIONS))
  return np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)


def _retrace_arrays(rng, length, batch, lam):
  shape = (length, batch)
  r, d = _rollout(rng, shape)
  q_tm1, q_t = rng.normal(size=(2, *shape, ACTIONS))
  a_tm1, a_t = rng.integers(0, ACTIONS, (2, *shape))
  return [q_tm1, q_t, a_tm1, a_t, r, d, _probs(rng, shape), rng.uniform(0.1, 1.0, shape), lam]


def _retrace_continuous_arrays(rng, length, batch, lam):
  shape, after_first = (length, batch), (length - 1, batch)
  r, d = _rollout(rng, shape)
  if np.ndim(lam):
    lam = lam[1:]
  return [rng.normal(size=shape), rng.normal(size=after_first), rng.normal(size=shape), r, d,
          rng.normal(size=after_first), lam]


def _td_lambda_arrays(rng, length, batch, lam):
  shape = (length, batch)
  r, d = _rollout(rng, shape)
  return [rng.normal(size=shape), r, d, rng.normal(size=shape), lam]


def _q_lambda_arrays(rng, length, batch, lam):
  shape = (length, batch)
  r, d = _rollout(rng, shape)
  q_tm1, q_t = rng.normal(size=(2, *shape, ACTIONS))
  return [q_tm1, rng.integers(0, ACTIONS, shape), r, d, q_t, lam]


SPECS = {
    "vtrace": Spec(rl.vtrace, rlax.vtrace, _vtrace_arrays,
                   lambda f, a, stop, **kw: f(*a[:6], 1.2, stop, a[6], **kw)),
    "vtrace_td_error_and_advantage": Spec(
        rl.vtrace_td_error_and_advantage, rlax.vtrace_td_error_and_advantage, _vtrace_arrays,
        lambda f, a, stop, **kw: f(*a[:6], 1.2, 0.8, stop, a[6], **kw)),
    "retrace": Spec(rl.retrace, rlax.retrace, _retrace_arrays,
                    lambda f, a, stop, **kw: f(*a, 1e-8, stop, **kw)),
    "retrace_continuous": Spec(rl.retrace_continuous, rlax.retrace_continuous,
                               _retrace_continuous_arrays, lambda f, a, stop, **kw: f(*a, stop, **kw)),
    "td_lambda": Spec(rl.td_lambda, rlax.td_lambda, _td_lambda_arrays,
                      lambda f, a, stop, **kw: f(*a, stop, **kw)),
    "q_lambda": Spec(rl.q_lambda, rlax.q_lambda, _q_lambda_arrays,
                     lambda f, a, stop, **kw: f(*a, stop, **kw)),
}


def _arrays(spec, rng, length, batch=3, dtype=np.float64, per_step_lambda=True, time_major=True):
  lam = rng.uniform(0.0, 1.0, (length, batch)) if per_step_lambda else np.float64(0.9)
  arrays = [
      x.astype(dtype) if np.issubdtype(np.asarray(x).dtype, np.floating) else x
      for x in spec.arrays(rng, length, batch, lam)
  ]
  return arrays if time_major else [np.swapaxes(x, 0, 1) if np.ndim(x) >= 2 else x for x in arrays]


def _rlax_batched(spec, arrays, stop, batch_axis):
  """rlax on one trajectory, vmapped over the batch axis of every array argument."""
  in_axes = tuple(None if np.ndim(x) == 0 else batch_axis for x in arrays)
  single = lambda *a: spec.call(spec.theirs, a, stop)
  return jax.vmap(single, in_axes=in_axes, out_axes=batch_axis)(*arrays)


@functools.cache
def _ours_jitted(name, stop, axis=0, mode="auto"):
  spec = SPECS[name]
  return jax.jit(lambda *a: spec.call(spec.ours, a, stop, axis=axis, mode=mode))


@functools.cache
def _rlax_jitted(name, stop, batch_axis):
  return jax.jit(lambda *arrays: _rlax_batched(SPECS[name], arrays, stop, batch_axis))


# Every mode meets both layouts and both dtypes (not every combination: the mode only
# changes how the recurrence runs, which tests/test_linear_recurrence.py covers fully).
CASES = [
    ("sequential", True, np.float32, 64), ("sequential", False, np.float64, 1),
    ("parallel", True, np.float64, 13), ("parallel", False, np.float32, 64),
    ("chunked", True, np.float32, 97), ("chunked", False, np.float64, 2),
    ("auto", True, np.float64, 37), ("auto", False, np.float32, 13),
]
CASE_IDS = [f"{m}-{'TB' if t else 'BT'}-{np.dtype(d).name}-T{n}" for m, t, d, n in CASES]


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("mode, time_major, dtype, length", CASES, ids=CASE_IDS)
def test_matches_vmapped_rlax(name, mode, time_major, dtype, length):
  spec = SPECS[name]
  axis = 0 if time_major else 1
  rng = np.random.default_rng(length)
  arrays = _arrays(spec, rng, length, dtype=dtype, per_step_lambda=length % 2 == 1,
                   time_major=time_major)
  actual = _ours_jitted(name, True, axis, mode)(*arrays)
  for x in _outputs(actual):
    assert x.dtype == dtype
  _assert_outputs_close(actual, _rlax_jitted(name, True, 1 - axis)(*arrays), dtype)


@pytest.mark.parametrize("name", SPECS)
def test_any_batch_axes_and_time_axis(name):
  """Time on the middle axis of `(2, T, 3)`, and a single trajectory `(T,)`."""
  spec = SPECS[name]
  rng = np.random.default_rng(11)
  arrays = _arrays(spec, rng, 13, batch=6)  # (T, 6, ...)
  expected = _rlax_jitted(name, True, 1)(*arrays)
  to_middle = lambda x: np.moveaxis(x.reshape(x.shape[0], 2, 3, *x.shape[2:]), 0, 1) if np.ndim(
      x) >= 2 else x
  actual = _ours_jitted(name, True, 1)(*(to_middle(x) for x in arrays))
  from_middle = lambda x: np.moveaxis(np.asarray(x), 1, 0).reshape(x.shape[1], 6)
  _assert_outputs_close(tuple(from_middle(x) for x in _outputs(actual)), expected)
  single = [x[:, 0] if np.ndim(x) >= 2 else x for x in arrays]
  _assert_outputs_close(_ours_jitted(name, True, -1)(*single), spec.call(spec.theirs, single, True))


def _float_argnums(arrays):
  return tuple(i for i, x in enumerate(arrays)
               if np.ndim(x) and np.issubdtype(np.asarray(x).dtype, np.floating))


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("stop", [True, False], ids=["stop_target_gradients", "full_gradients"])
def test_gradients_match_rlax(name, stop):
  """Gradients of a weighted sum of the outputs with respect to every float input."""
  spec = SPECS[name]
  rng = np.random.default_rng(2)
  arrays = _arrays(spec, rng, 9, batch=2)
  weights = rng.normal(size=(3, 9, 2))
  argnums = _float_argnums(arrays)
  mode = MODES[(list(SPECS).index(name) * 2 + stop) % len(MODES)]  # each mode in turn

  def gradients(fn):
    def loss(*floats):
      args = list(arrays)
      for i, x in zip(argnums, floats, strict=True):
        args[i] = x
      return sum(jnp.sum(w * out) for w, out in zip(weights, _outputs(fn(args)), strict=False))
    return jax.jit(jax.grad(loss, argnums=tuple(range(len(argnums)))))(*(arrays[i] for i in argnums))

  theirs = gradients(lambda args: _rlax_batched(spec, args, stop, 1))
  _assert_outputs_close(gradients(lambda args: spec.call(spec.ours, args, stop, mode=mode)), theirs)
  # The flag matters for these inputs, so a function that ignored it would fail above.
  other = gradients(lambda args: _rlax_batched(spec, args, not stop, 1))
  assert any(not np.allclose(a, b) for a, b in zip(other, theirs, strict=True))


def _with_truncations(rng, spec, length, batch=3):
  arrays = _arrays(spec, rng, length, batch)
  truncated = rng.uniform(size=(length, batch)) < 0.15
  final_values = rng.normal(size=(length, batch)) * 5
  return arrays, truncated, final_values


def _columns(fn, batch, *arrays):
  """fn on each column j of the `(T, B, ...)` arrays, stacked on axis 1."""
  pick = lambda x, j: x[:, j] if np.ndim(x) >= 2 else x
  return np.stack([np.asarray(fn(*(pick(x, j) for x in arrays))) for j in range(batch)], axis=1)


@pytest.mark.parametrize("mode, length", [("sequential", 37), ("parallel", 64), ("chunked", 64),
                                          ("auto", 1)])
def test_truncation_matches_episode_by_episode_reference(mode, length):
  rng = np.random.default_rng(length + 500)
  batch = 3
  run = lambda fn, *args, **kwargs: jax.jit(functools.partial(fn, mode=mode))(*args, **kwargs)
  take = lambda q, a: np.take_along_axis(q, a[..., None], -1)[..., 0]

  arrays, truncated, final = _with_truncations(rng, SPECS["vtrace"], length)
  v_tm1, v_t, r, d, rho, lam, mask = arrays
  for sample_mask in (None, mask):
    cut = dict(sample_mask=sample_mask, truncated=truncated, final_values=final)
    out = run(rl.vtrace_td_error_and_advantage, v_tm1, v_t, r, d, rho, lam, 1.2, 0.8, **cut)
    expected = [references.vtrace(*(x if x is None or np.ndim(x) < 2 else x[:, j] for x in (
        v_tm1, v_t, r, d, rho, lam)), 1.2, 0.8, *(x if x is None else x[:, j] for x in (
            sample_mask, truncated, final))) for j in range(batch)]
    for i, field in enumerate(out):
      _assert_close(field, np.stack([e[i] for e in expected], axis=1))
    _assert_close(run(rl.vtrace, v_tm1, v_t, r, d, rho, lam, 1.2, **cut), out.errors)

  cut = lambda truncated, final: dict(truncated=truncated, final_values=final)
  arrays, truncated, final = _with_truncations(rng, SPECS["retrace"], length)
  q_tm1, q_t, a_tm1, a_t, r, d, pi, mu, lam = arrays
  c = lam * np.minimum(1.0, take(pi, a_t) / (mu + 1e-8))
  _assert_close(
      run(rl.retrace, *arrays, **cut(truncated, final)),
      _columns(references.retrace, batch, take(q_tm1, a_tm1), take(q_t, a_t), (pi * q_t).sum(-1),
               c, r, d, truncated, final),
  )

  arrays, truncated, final = _with_truncations(rng, SPECS["retrace_continuous"], length)
  q_tm1, q_t, v_t, r, d, log_rhos, lam = arrays
  pad = lambda x: np.concatenate([x, np.zeros((1, batch))])
  c = pad(lam * np.minimum(1.0, np.exp(log_rhos)))
  _assert_close(
      run(rl.retrace_continuous, *arrays, **cut(truncated, final)),
      _columns(references.retrace, batch, q_tm1, pad(q_t), v_t, c, r, d, truncated, final),
  )

  lambda_returns = lambda *x: references.lambda_returns(x[0], x[1], x[2], x[3], x[2][-1], *x[4:])
  arrays, truncated, final = _with_truncations(rng, SPECS["td_lambda"], length)
  v_tm1, r, d, v_t, lam = arrays
  _assert_close(
      run(rl.td_lambda, *arrays, **cut(truncated, final)),
      _columns(lambda_returns, batch, r, d, v_t, lam, truncated, final) - v_tm1,
  )

  arrays, truncated, final = _with_truncations(rng, SPECS["q_lambda"], length)
  q_tm1, a_tm1, r, d, q_t, lam = arrays
  _assert_close(
      run(rl.q_lambda, *arrays, **cut(truncated, final)),
      _columns(lambda_returns, batch, r, d, q_t.max(-1), lam, truncated, final) - take(q_tm1, a_tm1),
  )


def test_references_agree_with_rlax_without_truncation():
  rng = np.random.default_rng(4)
  v_tm1, v_t, r, d, rho, lam, mask = _vtrace_arrays(rng, 23, 1, rng.uniform(size=(23, 1)))
  v_tm1, v_t, r, d, rho, lam, mask = (x[:, 0] for x in (v_tm1, v_t, r, d, rho, lam, mask))
  expected = rlax.vtrace_td_error_and_advantage(v_tm1, v_t, r, d, rho, lam, 1.2, 0.8,
                                                sample_mask=mask)
  for ours, theirs in zip(references.vtrace(v_tm1, v_t, r, d, rho, lam, 1.2, 0.8, mask), expected,
                          strict=True):
    np.testing.assert_allclose(ours, theirs, rtol=1e-10)
  q_tm1, q_t, a_tm1, a_t, r, d, pi, mu = (x[:, 0] for x in _retrace_arrays(rng, 23, 1, 0.0)[:8])
  take = lambda q, a: np.take_along_axis(q, a[..., None], -1)[..., 0]
  c = 0.7 * np.minimum(1.0, take(pi, a_t) / (mu + 1e-8))
  np.testing.assert_allclose(
      references.retrace(take(q_tm1, a_tm1), take(q_t, a_t), (pi * q_t).sum(-1), c, r, d),
      rlax.retrace(q_tm1, q_t, a_tm1, a_t, r, d, pi, mu, 0.7),
      rtol=1e-10,
  )


def test_truncation_worked_example():
  """The off-policy worked example of docs/rl.md: V-trace with an episode cut after step 0."""
  terminated = jnp.array([False, False, False])
  truncated = jnp.array([True, False, False])
  ends = rl.from_gymnasium(terminated, truncated, 0.9)
  v_tm1, v_t, r_t = jnp.zeros(3), jnp.zeros(3), jnp.ones(3)
  rho_tm1 = jnp.array([2.0, 0.5, 1.0])
  final_values = jnp.array([10.0, 0.0, 0.0])
  errors = rl.vtrace(v_tm1, v_t, r_t, ends.discounts, rho_tm1,
                     truncated=ends.truncated, final_values=final_values)
  np.testing.assert_allclose(errors, [1 + 0.9 * 10, 0.5 * 1 + 0.9 * 0.5 * 1, 1.0], rtol=1e-6)
  ignored = rl.vtrace(v_tm1, v_t, r_t, ends.discounts, rho_tm1)
  np.testing.assert_allclose(ignored, [1 + 0.9 * 0.95, 0.95, 1.0], rtol=1e-6)


def test_from_gymnasium():
  terminated = np.array([[False, True], [False, True], [True, False]])
  truncated = np.array([[False, False], [True, True], [True, False]])
  ends = rl.from_gymnasium(terminated, truncated, np.float32(0.99))
  assert ends.discounts.dtype == np.float32
  np.testing.assert_array_equal(ends.discounts, np.where(terminated, 0.0, np.float32(0.99)))
  np.testing.assert_array_equal(ends.truncated, [[False, False], [True, False], [False, False]])
  per_step = np.full(terminated.shape, 0.9)
  np.testing.assert_array_equal(rl.from_gymnasium(terminated, truncated, per_step).discounts,
                                np.where(terminated, 0.0, 0.9))
  with pytest.raises(TypeError, match="`terminated` must be a boolean array"):
    rl.from_gymnasium(terminated.astype(np.float32), truncated, 0.9)
  with pytest.raises(ValueError, match="`truncated` must have shape"):
    rl.from_gymnasium(terminated, truncated[:1], 0.9)
  with pytest.raises(ValueError, match=r"`gamma` must lie in \[0, 1\]"):
    rl.from_gymnasium(terminated, truncated, 1.5)
  with pytest.raises(ValueError, match="`gamma` must have shape"):
    rl.from_gymnasium(terminated, truncated, np.full(2, 0.9))


def test_empty_trajectories():
  for name, spec in SPECS.items():
    arrays = _arrays(spec, np.random.default_rng(0), 1, batch=2)
    empty = [x[:0] if np.ndim(x) >= 2 else x for x in arrays]
    for leaf in _outputs(spec.call(spec.ours, empty, True)):
      assert leaf.shape == (0, 2), name


def test_jit_with_traced_lambda_and_actions():
  spec = SPECS["retrace"]
  arrays = _arrays(spec, np.random.default_rng(1), 13, dtype=np.float32)
  fn = jax.jit(lambda *a: spec.call(spec.ours, a, True))
  _assert_outputs_close(fn(*arrays), spec.call(spec.ours, arrays, True), np.float32)


def test_bfloat16_inputs_accumulate_in_float32():
  arrays = _arrays(SPECS["vtrace"], np.random.default_rng(7), 512, batch=2, dtype=np.float32)
  v_tm1, v_t, r, d, rho, lam, _ = arrays
  low = rl.vtrace(*(x.astype(jnp.bfloat16) for x in (v_tm1, v_t, r, d, rho, lam)))
  assert low.dtype == jnp.bfloat16
  as_rounded = lambda x: np.asarray(x.astype(jnp.bfloat16), np.float32)
  expected = rl.vtrace(*(as_rounded(x) for x in (v_tm1, v_t, r, d, rho, lam)))
  # One rounding of the output, none along the 512 steps.
  np.testing.assert_allclose(np.asarray(low, np.float32), expected, rtol=2**-8, atol=1e-2)


def test_errors_name_the_argument():
  v, r, d, rho = np.zeros((5, 2)), np.ones((5, 2)), np.full((5, 2), 0.9), np.ones((5, 2))
  q, a, pi = np.zeros((5, 2, 3)), np.zeros((5, 2), np.int32), np.full((5, 2, 3), 1 / 3)
  with pytest.raises(ValueError, match=r"`v_t` must have shape \(5, 2\) \(the shape of `r_t`\)"):
    rl.vtrace(v, v[:4], r, d, rho)
  with pytest.raises(TypeError, match="`rho_tm1` must have a real floating dtype"):
    rl.vtrace(v, v, r, d, rho.astype(int))
  with pytest.raises(TypeError, match="`sample_mask` must be a boolean array"):
    rl.vtrace(v, v, r, d, rho, sample_mask=np.ones((5, 2)))
  with pytest.raises(ValueError, match="`lambda_` must be >= 0"):
    rl.vtrace_td_error_and_advantage(v, v, r, d, rho, -0.5)
  with pytest.raises(ValueError, match="`discount_t` must be a scalar or have the shape of `r_t`"):
    rl.td_lambda(v, r, d[:, :1], v, 0.9)
  with pytest.raises(TypeError, match="`r_t` must have a real floating dtype"):
    rl.td_lambda(v, r.astype(int), d, v, 0.9)
  with pytest.raises(ValueError, match="`r_t` must have a time axis"):
    rl.td_lambda(0.0, 1.0, 0.9, 0.0, 0.9)
  with pytest.raises(ValueError, match="`axis`=2 is out of range"):
    rl.td_lambda(v, r, d, v, 0.9, axis=2)
  with pytest.raises(ValueError, match="`mode` must be one of"):
    rl.td_lambda(v, r, d, v, 0.9, mode="fast")
  with pytest.raises(ValueError, match="`truncated` and `final_values` go together"):
    rl.q_lambda(q, a, r, d, q, 0.9, truncated=np.zeros((5, 2), bool))
  with pytest.raises(ValueError, match=r"`q_t` must have the shape of `r_t` \(5, 2\) followed by"):
    rl.q_lambda(q, a, r, d, v, 0.9)
  with pytest.raises(ValueError, match=r"`q_tm1` must have the shape of `r_t` .* \(3\)"):
    rl.retrace(q[..., :2], q, a, a, r, d, pi, v, 0.9)
  with pytest.raises(ValueError, match="`pi_t` must have the shape of `r_t`"):
    rl.retrace(q, q, a, a, r, d, pi[:, :1], v, 0.9)
  with pytest.raises(TypeError, match="`a_t` must be integer action indices"):
    rl.retrace(q, q, a, a.astype(np.float32), r, d, pi, v, 0.9)
  with pytest.raises(ValueError, match=r"`a_tm1` must index the 3 actions, got values in \[0, 3\]"):
    rl.retrace(q, q, np.where(np.eye(5, 2, dtype=bool), 3, a), a, r, d, pi, v, 0.9)
  with pytest.raises(ValueError, match=r"`q_t` must have shape \(4, 2\) \(`r_t`'s with T - 1 steps"):
    rl.retrace_continuous(v, v, v, r, d, v[:4], 0.9)
  with pytest.raises(ValueError, match="`lambda_` must be a scalar or have the shape of `log_rhos`"):
    rl.retrace_continuous(v, v[:4], v, r, d, v[:4], np.full((5, 2), 0.9))


@pytest.mark.parametrize("mode", MODES)
def test_nan_in_the_next_episode_stays_out_of_a_truncated_one(mode):
  """Steps 0 and 1 end in a truncation; the next episode's reward and values are NaN. The cut
  episode's errors, and their gradients, are those of the same rollout without the NaNs."""
  r = np.array([1.0, 2.0, np.nan, 1.0])
  d = np.full(4, 0.9)
  v_tm1 = np.array([0.5, 0.25, np.nan, 0.0])
  v_t = np.array([0.25, np.nan, 0.0, 0.0])
  q_t = np.stack([v_t, v_t + 1.0], axis=-1)
  q_tm1 = np.stack([v_tm1, v_tm1 - 1.0], axis=-1)
  actions = np.array([0, 1, 0, 1])
  pi = np.full((4, 2), 0.5)
  rho = np.array([0.5, 2.0, 1.0, 1.0])
  cut = dict(truncated=np.array([False, True, False, False]), final_values=np.full(4, 10.0))
  estimators = [
      lambda r, v_t, q_t: rl.vtrace(v_tm1, v_t, r, d, rho, 0.8, mode=mode, **cut),
      lambda r, v_t, q_t: rl.td_lambda(v_tm1, r, d, v_t, 0.8, mode=mode, **cut),
      lambda r, v_t, q_t: rl.retrace(q_tm1, q_t, actions, actions, r, d, pi, pi[:, 0], 0.8, mode=mode,
                                     **cut),
      lambda r, v_t, q_t: rl.q_lambda(q_tm1, actions, r, d, q_t, 0.8, mode=mode, **cut),
  ]
  clean = np.nan_to_num(r), np.nan_to_num(v_t), np.nan_to_num(q_t)
  for estimator in estimators:
    f = jax.jit(lambda *x, f=estimator: f(*x)[:2])
    _assert_close(f(r, v_t, q_t), f(*clean))
    grads = jax.jit(jax.grad(lambda *x, f=f: jnp.sum(f(*x)), argnums=(0, 1, 2)))
    for got, want in zip(grads(r, v_t, q_t), grads(*clean), strict=True):
      _assert_close(got[:2], want[:2])
