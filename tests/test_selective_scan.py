"""`selective_scan`: every mode against a float64 loop, chunking, resets, gradients, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import references
from ssmkit._src.selective_scan import selective_scan
from ssmkit.scan import linear_recurrence

# (T, chunk_size): empty, one step, chunks of one, chunks that do not divide T (padded tail),
# the default chunks, chunks that divide T.
LENGTHS_AND_CHUNKS = [(0, None), (1, None), (2, 1), (7, 4), (13, 5), (64, None), (100, 4)]
MODES = ["sequential", "chunked", "parallel", "auto"]


def _inputs(seed, batch, length, d=3, n=4, dtype=np.float64):
  """(u, dt, a, b, c, h0) as the Mamba block makes them: dt > 0 and a < 0."""
  rng = np.random.default_rng(seed)
  u = rng.normal(size=(*batch, length, d))
  dt = rng.uniform(0.01, 0.5, (*batch, length, d))
  a = -rng.uniform(0.5, 4.0, (d, n))
  b, c = rng.normal(size=(2, *batch, length, n))
  h0 = rng.normal(size=(*batch, d, n))
  return tuple(x.astype(dtype) for x in (u, dt, a, b, c, h0))


def _resets(seed, batch, length, starts=()):
  """Random episode starts (about one step in five), plus every step in `starts` below T."""
  reset = np.random.default_rng(seed).random((*batch, length)) < 0.2
  reset[..., [t for t in starts if t < length]] = True
  return reset


def _materialised(u, dt, a, b, c, h0, reset):
  """The formulation the Mamba block had: (..., T, D, N) decays and inputs, then contracted."""
  lead = lambda v, ndim: v.reshape((1,) * (ndim - v.ndim) + v.shape)
  decay = jnp.exp(dt[..., None] * lead(a, dt.ndim + 1))
  inputs = (dt * u)[..., None] * b[..., None, :]
  h, last = linear_recurrence(decay, inputs, h0, reset=reset[..., None, None], axis=-3,
                              mode="sequential", return_final_state=True)
  return jnp.einsum("...dn,...n->...d", h, c), last


def _assert_close(actual, expected, rtol=1e-10):
  expected = np.asarray(expected)
  scale = float(np.max(np.abs(expected))) if expected.size else 0.0
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize(("length", "chunk_size"), LENGTHS_AND_CHUNKS)
@pytest.mark.parametrize("mode", ["sequential", "chunked"])
def test_matches_float64_loop(length, chunk_size, mode):
  """Chunks that do and do not divide T, resets at step 0 and at chunk boundaries, h0, last state."""
  batch = (2, 3)
  u, dt, a, b, c, h0 = _inputs(0, batch, length)
  reset = _resets(1, batch, length, starts=(0, 4, 5, 10, 20, 60))
  y, last = selective_scan(u, dt, a, b, c, h0=h0, reset=reset, chunk_size=chunk_size, mode=mode)
  y_ref, last_ref = references.selective_scan(u, dt, a, b, c, h0, reset)
  assert y.shape == u.shape and last.shape == h0.shape
  assert y.dtype == last.dtype == jnp.float64
  _assert_close(y, y_ref)
  _assert_close(last, last_ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", [(), (5,), (2, 1, 3), (0,)])
def test_every_mode_and_batch_shape(mode, batch):
  u, dt, a, b, c, h0 = _inputs(2, batch, 37)
  reset = _resets(3, batch, 37)
  y, last = selective_scan(u, dt, a, b, c, h0=h0, reset=reset, chunk_size=8, mode=mode)
  y_ref, last_ref = references.selective_scan(u, dt, a, b, c, h0, reset)
  _assert_close(y, y_ref)
  _assert_close(last, last_ref)


@pytest.mark.parametrize("mode", ["sequential", "chunked"])
def test_defaults_start_from_zero_without_resets(mode):
  u, dt, a, b, c, _ = _inputs(4, (3,), 50)
  y, last = selective_scan(u, dt, a, b, c, mode=mode)
  y_ref, last_ref = references.selective_scan(u, dt, a, b, c)
  _assert_close(y, y_ref)
  _assert_close(last, last_ref)


@pytest.mark.parametrize("mode", ["sequential", "chunked"])
def test_float32_stays_float32(mode):
  u, dt, a, b, c, h0 = _inputs(5, (2,), 29, dtype=np.float32)
  reset = _resets(6, (2,), 29)
  y, last = selective_scan(u, dt, a, b, c, h0=h0, reset=reset, chunk_size=6, mode=mode)
  assert y.dtype == last.dtype == jnp.float32
  y_ref, last_ref = references.selective_scan(u, dt, a, b, c, h0, reset)
  _assert_close(y, y_ref, rtol=1e-5)
  _assert_close(last, last_ref, rtol=1e-5)


@pytest.mark.parametrize("mode", ["sequential", "chunked"])
def test_reset_at_step_zero_drops_a_non_finite_initial_state(mode):
  u, dt, a, b, c, h0 = _inputs(7, (2,), 9)
  h0 = np.full_like(h0, np.nan)
  reset = np.zeros((2, 9), bool)
  reset[:, 0] = True
  y, last = selective_scan(u, dt, a, b, c, h0=h0, reset=reset, chunk_size=4, mode=mode)
  y_ref, last_ref = references.selective_scan(u, dt, a, b, c, None, reset)
  _assert_close(y, y_ref)
  _assert_close(last, last_ref)


@pytest.mark.parametrize(("mode", "chunk_size"),
                         [("sequential", None), ("parallel", None), ("chunked", 3), ("chunked", 8)])
def test_nan_or_inf_before_a_reset_reaches_no_gradient_after_it(mode, chunk_size):
  """A NaN and an Inf in any input (an Inf in `h0`), in the chunk of the reset or an earlier
  one: the loss on the steps from the last reset on has finite gradients from there on."""
  reset = np.zeros(20, bool)
  reset[[6, 12]] = True

  @jax.jit
  def values_and_gradients(inputs, a):
    def run(inputs):
      u, dt, b, c, h0 = inputs
      return selective_scan(u, dt, a, b, c, h0=h0, reset=reset, chunk_size=chunk_size, mode=mode)[0]

    return run(inputs), jax.grad(lambda inputs: jnp.sum(jnp.sin(run(inputs)[12:])))(inputs)

  for i, name in enumerate(("u", "dt", "b", "c", "h0")):
    u, dt, a, b, c, h0 = _inputs(10 + i, (), 20)
    inputs = [u, dt, b, c, h0]
    if name == "h0":
      h0[0, 0] = np.inf
    else:
      inputs[i][3, 1], inputs[i][9, 0] = np.nan, np.inf
    y, grads = values_and_gradients(inputs, a)
    after = [x[12:] for x in (u, dt, b, c)]
    _assert_close(y[12:], references.selective_scan(*after[:2], a, *after[2:], None, None)[0])
    for g in grads[:4]:
      assert np.isfinite(g[12:]).all(), name


def test_strong_decays_in_every_mode_values_and_gradients():
  """dt A down to -50 a step: the decays underflow to 0, which is right, and nothing else."""
  u, _, a, b, c, h0 = _inputs(20, (2,), 70)
  dt = np.random.default_rng(21).uniform(10.0, 12.5, u.shape)
  a = np.full_like(a, -4.0)
  reset = _resets(22, (2,), 70)
  expected = references.selective_scan(u, dt, a, b, c, h0, reset)
  loss = lambda mode: lambda u, dt, b, c, h0: jnp.sum(jnp.sin(selective_scan(
      u, dt, a, b, c, h0=h0, reset=reset, chunk_size=8, mode=mode)[0]))
  grads = {}
  for mode in MODES:
    y, last = jax.jit(lambda *x, mode=mode: selective_scan(*x, h0=h0, reset=reset, chunk_size=8,
                                                           mode=mode))(u, dt, a, b, c)
    _assert_close(y, expected[0])
    _assert_close(last, expected[1])
    grads[mode] = jax.jit(jax.grad(loss(mode), argnums=(0, 1, 2, 3, 4)))(u, dt, b, c, h0)
    for g in grads[mode]:
      assert np.all(np.isfinite(g)), mode
  # The sequential mode's hand-written gradient against autodiff of the others.
  for mode in MODES[1:]:
    for got, want in zip(grads[mode], grads["sequential"], strict=True):
      _assert_close(got, want)


@pytest.mark.parametrize("mode", ["sequential", "chunked"])
def test_jit_and_vmap(mode):
  u, dt, a, b, c, h0 = _inputs(8, (4,), 11)
  reset = _resets(9, (4,), 11)
  run = lambda u, dt, b, c, h0, reset: selective_scan(u, dt, a, b, c, h0=h0, reset=reset,
                                                      chunk_size=3, mode=mode)
  want = run(u, dt, b, c, h0, reset)
  for got in (jax.jit(run)(u, dt, b, c, h0, reset), jax.vmap(run)(u, dt, b, c, h0, reset)):
    for g, w in zip(got, want, strict=True):
      _assert_close(g, w)


@pytest.mark.parametrize("with_reset", [False, True])
@pytest.mark.parametrize("mode", ["sequential", "chunked"])
def test_gradients_match_finite_differences(mode, with_reset):
  u, dt, a, b, c, h0 = _inputs(10, (2,), 7, d=3, n=2)
  reset = _resets(11, (2,), 7, starts=(3,)) if with_reset else None
  f = lambda *args: selective_scan(*args[:5], h0=args[5], reset=reset, chunk_size=3, mode=mode)
  check_grads(jax.jit(f), (u, dt, a, b, c, h0), order=1, modes=["rev"], eps=1e-6)


@pytest.mark.parametrize(
    ("mode", "length", "chunk_size"),
    [("sequential", 1, None), ("sequential", 13, 5), ("sequential", 100, None), ("chunked", 13, 5),
     ("chunked", 64, 16), ("parallel", 13, None)],
)
def test_gradients_equal_the_materialised_formulation(mode, length, chunk_size):
  u, dt, a, b, c, h0 = _inputs(12, (2,), length)
  reset = _resets(13, (2,), length, starts=(0, 5, 10))
  rng = np.random.default_rng(14)
  w, v = rng.normal(size=u.shape), rng.normal(size=h0.shape)

  def loss(run):
    def f(u, dt, a, b, c, h0):
      y, last = run(u, dt, a, b, c, h0)
      return jnp.sum(y * w) + jnp.sum(last * v)

    return jax.jit(jax.grad(f, argnums=tuple(range(6))))(u, dt, a, b, c, h0)

  got = loss(lambda *args: selective_scan(*args[:5], h0=args[5], reset=reset, chunk_size=chunk_size,
                                          mode=mode))
  want = loss(lambda *args: _materialised(*args, reset))
  for g, x in zip(got, want, strict=True):
    _assert_close(g, x)


def test_bad_inputs_name_the_argument():
  u, dt, a, b, c, h0 = _inputs(15, (2,), 6)
  with pytest.raises(ValueError, match="`u`"):
    selective_scan(u[0, 0], dt, a, b, c)
  with pytest.raises(ValueError, match="`dt`"):
    selective_scan(u, dt[:, :5], a, b, c)
  with pytest.raises(ValueError, match="`a`"):
    selective_scan(u, dt, a[:2], b, c)
  with pytest.raises(ValueError, match="`b`"):
    selective_scan(u, dt, a, b[..., :3], c)
  with pytest.raises(ValueError, match="`c`"):
    selective_scan(u, dt, a, b, c[None])
  with pytest.raises(ValueError, match="`h0`"):
    selective_scan(u, dt, a, b, c, h0=h0[0])
  with pytest.raises(ValueError, match="`reset`"):
    selective_scan(u, dt, a, b, c, reset=np.zeros((2, 5), bool))
  with pytest.raises(TypeError, match="`reset`"):
    selective_scan(u, dt, a, b, c, reset=np.zeros((2, 6)))
  with pytest.raises(TypeError, match="`u`"):
    selective_scan(u.astype(np.int32), dt, a, b, c)
  with pytest.raises(ValueError, match="`chunk_size`"):
    selective_scan(u, dt, a, b, c, chunk_size=0)
  with pytest.raises(ValueError, match="`mode`"):
    selective_scan(u, dt, a, b, c, mode="fast")
