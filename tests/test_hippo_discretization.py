"""HiPPO matrices against their closed forms; discretisations against `scipy.linalg.expm`."""

import jax
import numpy as np
import pytest
import scipy.linalg

from ssmkit._src import discretization, hippo

SIZES = [1, 2, 3, 8, 13, 64]


def _by_imag(x):
  """Complex eigenvalues sorted by imaginary part (the real parts are all -1/2 here)."""
  return x[np.argsort(x.imag)]


@pytest.mark.parametrize("n", SIZES)
def test_legs_matches_its_definition(n):
  a, b = hippo.legs(n)
  for i in range(n):
    assert b[i] == pytest.approx(np.sqrt(2 * i + 1))
    for j in range(n):
      if i > j:
        expected = -np.sqrt(2 * i + 1) * np.sqrt(2 * j + 1)
      elif i == j:
        expected = -(i + 1.0)
      else:
        expected = 0.0
      assert a[i, j] == pytest.approx(expected, abs=0)


@pytest.mark.parametrize("n", SIZES)
def test_legs_normal_is_minus_half_plus_skew_and_normal(n):
  s, p = hippo.legs_normal(n)
  np.testing.assert_allclose(p, np.sqrt(np.arange(n) + 0.5))
  np.testing.assert_allclose(s + s.T, -np.eye(n), atol=1e-12)
  np.testing.assert_allclose(s @ s.T, s.T @ s, atol=1e-9 * n**2)
  np.testing.assert_allclose(s - np.outer(p, p), hippo.legs(n)[0], atol=1e-12)


@pytest.mark.parametrize("n", SIZES)
def test_diagonalization_reconstructs_hippo_n(n):
  s, _ = hippo.legs_normal(n)
  eigenvalues, v, b = hippo.legs_normal_diagonalized(n)
  np.testing.assert_allclose(v.conj().T @ v, np.eye(n), atol=1e-10)
  np.testing.assert_allclose(v @ np.diag(eigenvalues) @ v.conj().T, s, atol=1e-9 * n)
  np.testing.assert_allclose(eigenvalues.real, -0.5)
  np.testing.assert_allclose(np.sort(eigenvalues.imag), -np.sort(eigenvalues.imag)[::-1], atol=1e-9)
  np.testing.assert_allclose(v @ b, hippo.legs(n)[1], atol=1e-9 * n)
  np.testing.assert_allclose(
      _by_imag(eigenvalues), _by_imag(np.linalg.eigvals(s)), atol=1e-8 * n
  )


@pytest.mark.parametrize("n", [1, 4, 32])
def test_s4d_initialisations(n):
  np.testing.assert_allclose(hippo.s4d_lin(n), [-0.5 + 1j * np.pi * k for k in range(n)])
  eigenvalues, b = hippo.s4d_legs(n)
  assert eigenvalues.shape == b.shape == (n,)
  _, v, b_all = hippo.legs_normal_diagonalized(2 * n)
  np.testing.assert_allclose(b, b_all[hippo.legs_normal_diagonalized(2 * n).eigenvalues.imag > 0])
  np.testing.assert_allclose(v @ b_all, hippo.legs(2 * n)[1], atol=1e-8 * n)
  full = np.linalg.eigvals(hippo.legs_normal(2 * n)[0])
  np.testing.assert_allclose(
      eigenvalues, _by_imag(full[full.imag > 0]), atol=1e-8 * n
  )


def test_bad_sizes_raise():
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match="state size"):
      hippo.legs(bad)


def _zoh_reference(a, b, dt):
  """exp(dt [[A, B], [0, 0]]) = [[A_bar, B_bar], [0, I]]: no inverse of A needed."""
  n, h = b.shape
  m = np.zeros((n + h, n + h), dtype=np.result_type(a, b))
  m[:n, :n], m[:n, n:] = a, b
  e = scipy.linalg.expm(dt * m)
  return e[:n, :n], e[:n, n:]


def _bilinear_reference(a, b, dt):
  eye = np.eye(a.shape[0])
  inverse = np.linalg.inv(eye - dt / 2 * a)
  return inverse @ (eye + dt / 2 * a), inverse @ (dt * b)


def _random_system(rng, n, h, complex_):
  a = -np.abs(rng.normal(size=n)) - 0.1 + (1j * rng.normal(size=n) if complex_ else 0)
  b = rng.normal(size=(n, h)) + (1j * rng.normal(size=(n, h)) if complex_ else 0)
  return a, b


@pytest.mark.parametrize("method", ["zoh", "bilinear"])
@pytest.mark.parametrize("complex_", [False, True])
def test_diagonal_discretization_matches_dense_reference(method, complex_):
  rng = np.random.default_rng(0)
  a, b = _random_system(rng, 5, 3, complex_)
  dt = rng.uniform(0.01, 0.5, 5)
  reference = _zoh_reference if method == "zoh" else _bilinear_reference
  fn = getattr(discretization, method)
  a_bar, b_bar = fn(a, b, dt)  # one step per state
  a_one, b_one = fn(a, b[:, 0], dt)  # one input per state, as in S4D
  for k in range(5):  # a per-state step is a diagonal system per state
    ref_a, ref_b = reference(np.array([[a[k]]]), b[k : k + 1], dt[k])
    np.testing.assert_allclose(a_bar[k], ref_a[0, 0], rtol=1e-12)
    np.testing.assert_allclose(b_bar[k], ref_b[0], rtol=1e-12)
    np.testing.assert_allclose(b_one[k], ref_b[0, 0], rtol=1e-12)
  np.testing.assert_allclose(a_one, a_bar)


@pytest.mark.parametrize("method", ["zoh", "bilinear"])
def test_dense_discretization_matches_reference(method):
  rng = np.random.default_rng(1)
  a = rng.normal(size=(4, 4)) - 2 * np.eye(4)
  b = rng.normal(size=(4, 2))
  reference = _zoh_reference if method == "zoh" else _bilinear_reference
  fn = getattr(discretization, method)
  a_bar, b_bar = fn(a, b, np.array(0.3), diagonal=False)
  ref_a, ref_b = reference(a, b, 0.3)
  np.testing.assert_allclose(a_bar, ref_a, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(b_bar, ref_b, rtol=1e-10, atol=1e-12)
  hippo_a, hippo_b = hippo.legs(6)
  a_bar, b_bar = fn(hippo_a, hippo_b[:, None], np.array(0.05), diagonal=False)
  ref_a, ref_b = reference(hippo_a, hippo_b[:, None], 0.05)
  np.testing.assert_allclose(a_bar, ref_a, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(b_bar, ref_b, rtol=1e-9, atol=1e-12)


def test_discretization_shape_errors_name_the_argument():
  with pytest.raises(ValueError, match="`b` must be"):
    discretization.zoh(np.ones(4), np.ones((3, 2)), 0.1)
  with pytest.raises(ValueError, match="`a` must be square"):
    discretization.bilinear(np.ones((4, 3)), np.ones((4, 2)), 0.1, diagonal=False)


def test_log_step_init_spans_its_range():
  init = discretization.log_step_init(1e-3, 1e-1)
  log_dt = np.asarray(init(jax.random.key(0), (10000,)))
  assert log_dt.min() >= np.log(1e-3) and log_dt.max() <= np.log(1e-1)
  assert np.quantile(log_dt, 0.05) < np.log(1e-3) + 0.5
  assert np.quantile(log_dt, 0.95) > np.log(1e-1) - 0.5
  with pytest.raises(ValueError, match="dt_min"):
    discretization.log_step_init(0.1, 0.01)
