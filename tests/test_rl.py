"""`ssmkit.rl`: rlax's test vectors, rlax itself, float64 references, truncation, errors."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import references
from ssmkit import rl

MODES = ["sequential", "parallel", "chunked", "auto"]
LENGTHS = [1, 2, 7, 13, 64, 97]

# rlax's published test vectors (rlax/_src/multistep_test.py): two trajectories of 5 steps.
R_T = np.array([[1.0, 0.0, -1.0, 0.0, 1.0], [0.5, 0.8, -0.7, 0.0, 2.1]], np.float32)
DISCOUNT_T = np.array([[0.5, 0.9, 1.0, 0.5, 0.8], [0.9, 0.5, 0.3, 0.8, 0.7]], np.float32)
V_T = np.array([[3.0, 1.0, 5.0, -5.0, 3.0], [-1.7, 1.2, 2.3, 2.2, 2.7]], np.float32)
GAE_R_T = np.array([[0.0, 0.0, 1.0, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0, 1.0]], np.float32)
GAE_VALUES = np.array([[1.0, 4.0, -3.0, -2.0, -1.0, -1.0], [-3.0, -2.0, -1.0, 0.0, 5.0, -1.0]],
                      np.float32)
GAE_DISCOUNT_T = np.array([[0.99] * 5, [0.9, 0.9, 0.9, 0.0, 0.9]], np.float32)


@pytest.mark.parametrize("mode", MODES)
def test_rlax_vectors_lambda_returns(mode):
  expected = [[1.6460547, 0.72281253, 0.7375001, 0.6500001, 3.4],
              [0.7866317, 0.9913063, 0.1101501, 2.834, 3.99]]
  actual = rl.lambda_returns(R_T, DISCOUNT_T, V_T, 0.75, axis=1, mode=mode)
  np.testing.assert_allclose(actual, expected, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_rlax_vectors_discounted_returns(mode):
  expected = [[1.315, 0.63000005, 0.70000005, 1.7, 3.4],
              [1.33592, 0.9288, 0.2576, 3.192, 3.9899998]]
  for bootstrap in (V_T[:, -1], V_T):  # rlax accepts the last value or every value
    actual = rl.discounted_returns(R_T, DISCOUNT_T, bootstrap, axis=1, mode=mode)
    np.testing.assert_allclose(actual, expected, rtol=1e-5)


@pytest.mark.parametrize("n, expected", [
    (3, [[2.8, -3.15, 0.7, 1.7, 3.4], [1.2155, 0.714, 0.2576, 3.192, 3.99]]),
    (5, [[1.315, 0.63, 0.7, 1.7, 3.4], [1.33592, 0.9288, 0.2576, 3.192, 3.99]]),
    (7, [[1.315, 0.63, 0.7, 1.7, 3.4], [1.33592, 0.9288, 0.2576, 3.192, 3.99]]),
])
def test_rlax_vectors_n_step_returns(n, expected):
  np.testing.assert_allclose(rl.n_step_returns(R_T, DISCOUNT_T, V_T, n, axis=1), expected, rtol=1e-5)


def test_n_step_over_whole_trajectory_is_the_lambda_return():
  np.testing.assert_allclose(
      rl.n_step_returns(R_T, DISCOUNT_T, V_T, 5, 0.75, axis=1),
      rl.lambda_returns(R_T, DISCOUNT_T, V_T, 0.75, axis=1),
      rtol=1e-6,
  )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lambda_, expected", [
    (1.0, [[-1.45118, -4.4557, 2.5396, 0.5249, -0.49], [3.0, 2.0, 1.0, 0.0, -4.9]]),
    (0.7, [[-0.676979, -5.248167, 2.4846, 0.6704, -0.49], [2.2899, 1.73, 1.0, 0.0, -4.9]]),
    (0.4, [[0.56731, -6.042, 2.3431, 0.815, -0.49], [1.725, 1.46, 1.0, 0.0, -4.9]]),
])
def test_rlax_vectors_gae(mode, lambda_, expected):
  actual = rl.generalized_advantage_estimation(
      GAE_R_T, GAE_DISCOUNT_T, GAE_VALUES, lambda_, axis=1, mode=mode
  )
  np.testing.assert_allclose(actual, expected, atol=1e-3)
  per_step = np.full(GAE_R_T.shape, lambda_, np.float32)
  np.testing.assert_allclose(
      rl.generalized_advantage_estimation(GAE_R_T, GAE_DISCOUNT_T, GAE_VALUES, per_step, axis=1),
      actual,
      rtol=1e-6,
  )


# The estimators compiled once per shape and options, shared by the comparisons below: called
# eagerly, every primitive inside them would compile a program of its own for each shape.
_OPTIONS = ("axis", "mode", "stop_target_gradients")
JIT = types.SimpleNamespace(
    discounted_returns=jax.jit(rl.discounted_returns, static_argnames=_OPTIONS),
    lambda_returns=jax.jit(rl.lambda_returns, static_argnames=_OPTIONS),
    generalized_advantage_estimation=jax.jit(rl.generalized_advantage_estimation,
                                             static_argnames=_OPTIONS),
    n_step_returns=jax.jit(rl.n_step_returns, static_argnames=("n", "axis", "stop_target_gradients")),
)


def _trajectories(rng, shape, dtype=np.float64, zero_fraction=0.1):
  """Rewards, discounts with episode ends (0) and values of the same shape."""
  rewards = rng.normal(size=shape)
  discounts = rng.uniform(0.8, 1.0, shape) * (rng.uniform(size=shape) > zero_fraction)
  values = rng.normal(size=shape)
  return rewards.astype(dtype), discounts.astype(dtype), values.astype(dtype)


def _vmapped(fn, axis):
  """`fn` of one trajectory, mapped over the batch axis of `(T, B)` (axis 0) or `(B, T)`."""
  return jax.vmap(fn, in_axes=-1 if axis == 0 else 0, out_axes=-1 if axis == 0 else 0)


def _assert_close(actual, expected, dtype=np.float64):
  tol = 1e-10 if np.dtype(dtype) == np.float64 else 2e-5
  scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=tol, atol=tol * scale)


@functools.cache
def _rlax_cases(length, axis):
  """Trajectories of a `(T, 3)` (axis 0) or `(3, T)` layout and rlax's results on them: one
  computation for every mode of `test_matches_vmapped_rlax`."""
  rng = np.random.default_rng(length)
  shape = (length, 3) if axis == 0 else (3, length)
  r, d, v = _trajectories(rng, shape)
  lam = rng.uniform(0, 1, shape)
  values = np.concatenate([v, rng.normal(size=(1, 3) if axis == 0 else (3, 1))], axis=axis)
  bootstrap = rng.normal(size=3)
  single = lambda fn: jax.jit(_vmapped(fn, axis))
  expected = {"returns": single(rlax.discounted_returns)(r, d, bootstrap)}
  for i, lam_arg in enumerate((0.9, lam)):
    per_step = np.broadcast_to(lam_arg, shape)
    expected["lambda", i] = single(rlax.lambda_returns)(r, d, v, per_step)
    expected["gae", i] = single(rlax.truncated_generalized_advantage_estimation)(r, d, per_step, values)
  return (r, d, v, lam, values, bootstrap), expected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", LENGTHS)
def test_matches_vmapped_rlax(mode, length):
  # Time leads for every other length, and is axis 1 for the rest.
  axis = LENGTHS.index(length) % 2
  (r, d, v, lam, values, bootstrap), expected = _rlax_cases(length, axis)
  _assert_close(JIT.discounted_returns(r, d, bootstrap, axis=axis, mode=mode), expected["returns"])
  for i, lam_arg in enumerate((0.9, lam)):
    _assert_close(JIT.lambda_returns(r, d, v, lam_arg, axis=axis, mode=mode), expected["lambda", i])
    _assert_close(JIT.generalized_advantage_estimation(r, d, values, lam_arg, axis=axis, mode=mode),
                  expected["gae", i])


@pytest.mark.parametrize("n", [1, 2, 3, 8, 200])
@pytest.mark.parametrize("length", LENGTHS)
def test_n_step_matches_vmapped_rlax(n, length):
  rng = np.random.default_rng(n * 100 + length)
  r, d, v = _trajectories(rng, (4, length))
  lam = rng.uniform(0, 1, (4, length))
  expected = jax.jit(jax.vmap(lambda *x: rlax.n_step_bootstrapped_returns(*x[:3], n, x[3])))(
      r, d, v, lam)
  _assert_close(JIT.n_step_returns(r, d, v, n, lam, axis=1), expected)


@settings(max_examples=12, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    length=st.sampled_from([1, 2, 5, 11, 32]),
    data=st.data(),
)
def test_any_time_axis_and_batch_axes(batch, length, data):
  axis = data.draw(st.integers(0, len(batch)))
  shape = (*batch[:axis], length, *batch[axis:])
  rng = np.random.default_rng(length + 7 * len(batch))
  r, d, v = _trajectories(rng, shape)
  lam = rng.uniform(0, 1, shape)
  move = lambda x: np.moveaxis(x, axis, -1).reshape(-1, length)
  expected = jax.jit(jax.vmap(rlax.lambda_returns))(move(r), move(d), move(v), move(lam))
  actual = JIT.lambda_returns(r, d, v, lam, axis=axis)
  _assert_close(move(np.asarray(actual)), expected)
  actual = JIT.n_step_returns(r, d, v, 3, lam, axis=axis)
  expected = jax.jit(jax.vmap(lambda *x: rlax.n_step_bootstrapped_returns(*x[:3], 3, x[3])))(
      move(r), move(d), move(v), move(lam))
  _assert_close(move(np.asarray(actual)), expected)


def _with_truncations(rng, length, batch=3):
  """Time-major rollouts with terminations, truncations, and both at once."""
  r, d, v = _trajectories(rng, (length, batch), zero_fraction=0.15)
  truncated = rng.uniform(size=(length, batch)) < 0.15
  final_values = rng.normal(size=(length, batch)) * 5
  return r, d, v, truncated, final_values


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", [1, 7, 13, 97])
def test_truncation_matches_episode_by_episode_reference(mode, length):
  rng = np.random.default_rng(length + 1000)
  r, d, v, truncated, final = _with_truncations(rng, length)
  lam = rng.uniform(0, 1, r.shape)
  values = np.concatenate([v, rng.normal(size=(1, 3))])
  bootstrap = rng.normal(size=3)
  cut = dict(truncated=truncated, final_values=final)
  columns = range(r.shape[1])

  def expect(fn, *args):
    return np.stack([fn(*(x[:, j] if np.ndim(x) == 2 else x[j] for x in args)) for j in columns], 1)

  zeros = np.zeros_like(r)
  _assert_close(
      JIT.discounted_returns(r, d, bootstrap, mode=mode, **cut),
      expect(lambda *x: references.lambda_returns(x[0], x[1], x[2], 1.0, x[3], x[4], x[5]),
             r, d, zeros, bootstrap, truncated, final),
  )
  _assert_close(
      JIT.lambda_returns(r, d, v, lam, mode=mode, **cut),
      expect(lambda *x: references.lambda_returns(x[0], x[1], x[2], x[3], x[2][-1], x[4], x[5]),
             r, d, v, lam, truncated, final),
  )
  _assert_close(
      JIT.generalized_advantage_estimation(r, d, values, lam, mode=mode, **cut),
      expect(references.generalized_advantage_estimation, r, d, values, lam, truncated, final),
  )
  for n in (1, 3, 10):
    _assert_close(
        JIT.n_step_returns(r, d, v, n, lam, **cut),
        expect(lambda *x, n=n: references.n_step_returns(x[0], x[1], x[2], n, *x[3:]),
               r, d, v, lam, truncated, final),
    )


def test_references_agree_with_rlax_without_truncation():
  rng = np.random.default_rng(3)
  r, d, v = _trajectories(rng, (23,))
  values = np.append(v, 0.7)
  np.testing.assert_allclose(
      references.generalized_advantage_estimation(r, d, values, 0.8),
      rlax.truncated_generalized_advantage_estimation(r, d, 0.8, values),
      rtol=1e-10,
  )
  np.testing.assert_allclose(
      references.lambda_returns(r, d, v, 0.8, v[-1]), rlax.lambda_returns(r, d, v, 0.8), rtol=1e-10
  )
  np.testing.assert_allclose(
      references.n_step_returns(r, d, v, 4, 0.8),
      rlax.n_step_bootstrapped_returns(r, d, v, 4, 0.8),
      rtol=1e-10,
  )


def test_truncation_worked_example():
  """The worked example of docs/rl.md: an episode cut after step 1, final value 10."""
  rewards, discounts, values = jnp.ones(4), jnp.full(4, 0.9), jnp.zeros(5)
  truncated = jnp.array([False, True, False, False])
  final_values = jnp.where(truncated, 10.0, 0.0)
  advantages = rl.generalized_advantage_estimation(
      rewards, discounts, values, 1.0, truncated=truncated, final_values=final_values
  )
  np.testing.assert_allclose(advantages, [1 + 0.9 * 10, 1 + 0.9 * 10, 1.9, 1.0], rtol=1e-6)
  as_termination = rl.generalized_advantage_estimation(
      rewards, discounts.at[1].set(0.0), values, 1.0
  )
  np.testing.assert_allclose(as_termination, [1.9, 1.0, 1.9, 1.0], rtol=1e-6)
  ignored = rl.generalized_advantage_estimation(rewards, discounts, values, 1.0)
  np.testing.assert_allclose(ignored, [3.439, 2.71, 1.9, 1.0], rtol=1e-6)


def test_termination_and_truncation_at_the_same_step_terminate():
  r, d, v = jnp.ones(3), jnp.array([0.9, 0.0, 0.9]), jnp.zeros(4)
  both = rl.generalized_advantage_estimation(
      r, d, v, 0.5, truncated=jnp.array([False, True, False]), final_values=jnp.full(3, 10.0)
  )
  np.testing.assert_allclose(both, rl.generalized_advantage_estimation(r, d, v, 0.5), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_match_finite_differences(mode):
  rng = np.random.default_rng(0)
  r, d, v = _trajectories(rng, (9, 2))
  values = np.concatenate([v, rng.normal(size=(1, 2))])
  # Jitted, so the many evaluations at perturbed inputs reuse one compilation.
  check_grads(
      jax.jit(lambda r, d, x: rl.generalized_advantage_estimation(r, d, x, 0.8, mode=mode)),
      (r, d, values), order=2, modes=["rev"],
  )
  check_grads(
      jax.jit(lambda r, x, lam: rl.lambda_returns(r, d, x, lam, mode=mode)),
      (r, v, rng.uniform(0.2, 0.8, r.shape)), order=1, modes=["rev"],
  )
  check_grads(jax.jit(lambda r, x: rl.n_step_returns(r, d, x, 3, 0.7)), (r, v), order=1, modes=["rev"])


def test_gradients_match_rlax():
  rng = np.random.default_rng(1)
  r, d, v = _trajectories(rng, (3, 17))
  values = np.concatenate([v, rng.normal(size=(3, 1))], axis=1)
  weights = rng.normal(size=r.shape)

  def loss(fn):
    return lambda *args: jnp.sum(fn(*args) * weights)

  ours = jax.grad(loss(lambda r, x: rl.generalized_advantage_estimation(r, d, x, 0.9, axis=1)),
                  argnums=(0, 1))(r, values)
  theirs = jax.grad(loss(lambda r, x: jax.vmap(
      rlax.truncated_generalized_advantage_estimation, in_axes=(0, 0, None, 0))(r, d, 0.9, x)),
      argnums=(0, 1))(r, values)
  for a, b in zip(ours, theirs, strict=True):
    _assert_close(a, np.asarray(b))


def test_stop_target_gradients():
  r, d, v = jnp.ones(5), jnp.full(5, 0.9), jnp.arange(6.0)
  for fn in (
      lambda x: rl.generalized_advantage_estimation(r, d, x, 0.9, stop_target_gradients=True),
      lambda x: rl.lambda_returns(r, d, x[1:], 0.9, stop_target_gradients=True),
      lambda x: rl.discounted_returns(r, d, x[-1], stop_target_gradients=True),
      lambda x: rl.n_step_returns(r, d, x[1:], 2, stop_target_gradients=True),
  ):
    grad = jax.grad(lambda x, fn=fn: jnp.sum(fn(x)))(v)
    np.testing.assert_array_equal(grad, np.zeros(6))
    assert float(jnp.sum(fn(v))) != 0.0


def test_scalar_discounts_and_lambda_equal_arrays():
  rng = np.random.default_rng(5)
  r, _, v = _trajectories(rng, (20, 4))
  values = np.concatenate([v, v[:1]])
  full = lambda x: np.full(r.shape, x)
  for fn, args in (
      (rl.generalized_advantage_estimation, (values, 0.7)),
      (rl.lambda_returns, (v, 0.7)),
  ):
    _assert_close(fn(r, 0.95, *args), np.asarray(fn(r, full(0.95), args[0], full(0.7))))
  _assert_close(rl.discounted_returns(r, 0.95), np.asarray(rl.discounted_returns(r, full(0.95))))


def test_empty_and_single_step():
  empty = np.zeros((0, 2))
  assert rl.discounted_returns(empty, empty).shape == (0, 2)
  assert rl.lambda_returns(empty, empty, empty).shape == (0, 2)
  assert rl.generalized_advantage_estimation(empty, empty, np.ones((1, 2)), 0.9).shape == (0, 2)
  assert rl.n_step_returns(empty, empty, empty, 3).shape == (0, 2)
  np.testing.assert_allclose(
      rl.generalized_advantage_estimation(np.array([1.0]), np.array([0.5]), np.array([2.0, 4.0]), 0.9),
      [1.0 + 0.5 * 4.0 - 2.0],
  )


def test_jit_and_traced_lambda():
  rng = np.random.default_rng(6)
  r, d, v = _trajectories(rng, (4, 30), dtype=np.float32)
  values = np.concatenate([v, v[:, :1]], axis=1)
  fn = functools.partial(rl.generalized_advantage_estimation, axis=1)
  _assert_close(jax.jit(fn)(r, d, values, 0.9), np.asarray(fn(r, d, values, 0.9)), np.float32)


def test_lambda_above_one_is_accepted_eagerly_and_jitted_as_rlax():
  # rlax passes importance ratios up to 2 as `lambda_` in its own TD-error test.
  rng = np.random.default_rng(8)
  r, d, v = _trajectories(rng, (3, 20))
  values = np.concatenate([v, v[:, :1]], axis=1)
  for lam in (rng.uniform(0.5, 2.0, r.shape), 1.5):
    per_step = np.broadcast_to(lam, r.shape)
    cases = [
        (lambda lam: rl.lambda_returns(r, d, v, lam, axis=1),
         jax.vmap(rlax.lambda_returns)(r, d, v, per_step)),
        (lambda lam: rl.generalized_advantage_estimation(r, d, values, lam, axis=1),
         jax.vmap(rlax.truncated_generalized_advantage_estimation)(r, d, per_step, values)),
    ]
    for fn, expected in cases:
      eager = fn(lam)
      np.testing.assert_allclose(eager, jax.jit(fn)(lam), rtol=1e-12)
      np.testing.assert_allclose(eager, expected, rtol=1e-10, atol=1e-10)


def test_bfloat16_inputs_accumulate_in_float32():
  rng = np.random.default_rng(7)
  r, d, v = _trajectories(rng, (512, 2), dtype=np.float32)
  values = np.concatenate([v, v[:1]])
  low = rl.generalized_advantage_estimation(
      r.astype(jnp.bfloat16), d.astype(jnp.bfloat16), values.astype(jnp.bfloat16), 0.95
  )
  assert low.dtype == jnp.bfloat16
  as_rounded = lambda x: np.asarray(x.astype(jnp.bfloat16), np.float32)
  expected = rl.generalized_advantage_estimation(
      as_rounded(r), as_rounded(d), as_rounded(values), 0.95
  )
  # One rounding of the output, none along the 512 steps.
  np.testing.assert_allclose(np.asarray(low, np.float32), expected, rtol=2 ** -8, atol=1e-2)


def test_errors_name_the_argument():
  r, d, v = np.ones((5, 2)), np.full((5, 2), 0.9), np.ones((5, 2))
  values = np.ones((6, 2))
  gae = rl.generalized_advantage_estimation
  with pytest.raises(ValueError, match="`lambda_` must be >= 0"):
    gae(r, d, values, -0.5)
  with pytest.raises(ValueError, match="`lambda_` must be >= 0"):
    rl.lambda_returns(r, d, v, np.full((5, 2), -0.1))
  with pytest.raises(ValueError, match=r"`values` must have shape \(6, 2\) \(T \+ 1 = 6"):
    gae(r, d, v, 0.9)
  with pytest.raises(ValueError, match="`discounts` must be a scalar or have the shape"):
    gae(r, d[:, :1], values, 0.9)
  with pytest.raises(ValueError, match="`values` must have shape"):
    rl.lambda_returns(r, d, values, 0.9)
  with pytest.raises(ValueError, match="`bootstrap_value` must be a scalar"):
    rl.discounted_returns(r, d, np.ones(5))
  with pytest.raises(ValueError, match="`mode` must be one of"):
    gae(r, d, values, 0.9, mode="fast")
  with pytest.raises(ValueError, match="`n` must be a positive int"):
    rl.n_step_returns(r, d, v, 0)
  with pytest.raises(ValueError, match="`truncated` and `final_values` go together"):
    gae(r, d, values, 0.9, truncated=np.zeros((5, 2), bool))
  with pytest.raises(TypeError, match="`truncated` must be a boolean array"):
    gae(r, d, values, 0.9, truncated=np.zeros((5, 2)), final_values=r)
  with pytest.raises(ValueError, match="`final_values` must have shape"):
    gae(r, d, values, 0.9, truncated=np.zeros((5, 2), bool), final_values=r[:, :1])
  with pytest.raises(TypeError, match="`rewards` must have a real floating dtype"):
    gae(np.ones((5, 2), int), d, values, 0.9)
  with pytest.raises(ValueError, match="`axis`=2 is out of range"):
    gae(r, d, values, 0.9, axis=2)
  with pytest.raises(ValueError, match="`rewards` must have a time axis"):
    rl.discounted_returns(1.0, 0.9)


@pytest.mark.parametrize("mode", MODES)
def test_nan_in_the_next_episode_stays_out_of_a_truncated_one(mode):
  """Steps 0 and 1 end in a truncation; the next episode's reward and values are NaN. The cut
  episode's returns, and their gradients, are those of the same rollout without the NaNs."""
  r = np.array([1.0, 2.0, np.nan, 1.0])
  d = np.full(4, 0.9)
  values = np.array([0.5, 0.25, np.nan, np.nan, 0.0])
  cut = dict(truncated=np.array([False, True, False, False]), final_values=np.full(4, 10.0))
  estimators = [
      lambda r, v: rl.discounted_returns(r, d, v[-1], mode=mode, **cut),
      lambda r, v: rl.lambda_returns(r, d, v[1:], 0.8, mode=mode, **cut),
      lambda r, v: rl.generalized_advantage_estimation(r, d, v, 0.8, mode=mode, **cut),
      lambda r, v: rl.n_step_returns(r, d, v[1:], 3, 0.8, **cut),
  ]
  clean = np.nan_to_num(r), np.nan_to_num(values)
  for estimator in estimators:
    f = jax.jit(lambda r, v, f=estimator: f(r, v)[:2])
    _assert_close(f(r, values), f(*clean))
    grads = jax.jit(jax.grad(lambda r, v, f=f: jnp.sum(f(r, v)), argnums=(0, 1)))
    for got, want in zip(grads(r, values), grads(*clean), strict=True):
      _assert_close(got[:2], want[:2])
