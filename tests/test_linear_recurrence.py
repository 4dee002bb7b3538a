"""`linear_recurrence`: every mode against a float64 loop, gradients, resets, dtypes, errors."""

import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.test_util import check_grads

import references
from ssmkit._src import modes
from ssmkit.scan import linear_recurrence, linear_recurrence_final_state

MODES = [
    dict(mode="sequential"),
    dict(mode="parallel"),
    dict(mode="chunked", chunk_size=4, inner="sequential"),
    dict(mode="chunked", chunk_size=5, inner="parallel"),
    dict(mode="chunked", chunk_size=3, inner="cumsum"),
    dict(mode="chunked"),
    dict(mode="auto"),
]
LENGTHS = [0, 1, 2, 7, 13, 64, 97]

# Jitted: a test then compiles one program, where an eager call of the parallel and chunked
# modes dispatches hundreds of small operations, each compiled on its own. The eager path
# keeps its own tests (test_jit_equals_no_jit_..., the error and chunk-length tests).
recurrence = jax.jit(
    linear_recurrence,
    static_argnames=("reverse", "axis", "mode", "chunk_size", "inner", "return_final_state"),
)
final_state = jax.jit(
    linear_recurrence_final_state, static_argnames=("reverse", "axis", "mode", "chunk_size")
)


def _inputs(rng, shape, dtype, axis=0, a_shape=None, low=0.5):
  """Decays in [low, 1) (unit modulus below 1 for complex) and normal inputs."""
  a_shape = shape if a_shape is None else a_shape
  a = rng.uniform(low, 1.0, a_shape)
  b = rng.normal(size=shape)
  if np.issubdtype(dtype, np.complexfloating):
    a = a * np.exp(1j * rng.uniform(-np.pi, np.pi, a_shape))
    b = b + 1j * rng.normal(size=shape)
  return a.astype(dtype), b.astype(dtype)


def _tolerance(dtype):
  return {np.float32: 2e-5, np.complex64: 2e-5, np.float64: 1e-12, np.complex128: 1e-12}[
      np.dtype(dtype).type
  ]


def _assert_close(actual, expected, dtype):
  tol = _tolerance(dtype)
  scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("kwargs", MODES, ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("reverse", [False, True])
def test_every_mode_matches_float64_loop(kwargs, length, reverse):
  rng = np.random.default_rng(length)
  a, b = _inputs(rng, (length, 3), np.float32)
  h0 = rng.normal(size=3).astype(np.float32)
  expected = references.linear_recurrence(a, b, h0, reverse=reverse)
  h = recurrence(a, b, h0, reverse=reverse, **kwargs)
  chex.assert_shape(h, (length, 3))
  assert h.dtype == jnp.float32
  _assert_close(h, expected, np.float32)


@pytest.mark.parametrize("kwargs", [m for m in MODES if m.get("inner") != "cumsum"],
                         ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
@pytest.mark.parametrize("reverse", [False, True])
def test_resets_h0_and_dtypes_match_float64_loop(kwargs, dtype, reverse):
  rng = np.random.default_rng(1)
  a, b = _inputs(rng, (29, 2, 3), dtype)
  h0 = _inputs(rng, (2, 3), dtype)[1]
  reset = rng.uniform(size=(29, 2, 1)) < 0.2
  expected = references.linear_recurrence(a, b, h0, reset, reverse=reverse)
  h, last = recurrence(
      a, b, h0, reset=reset, reverse=reverse, return_final_state=True, **kwargs
  )
  assert h.dtype == dtype
  _assert_close(h, expected, dtype)
  _assert_close(last, expected[0 if reverse else -1], dtype)


@pytest.mark.parametrize("kwargs", [m for m in MODES if m.get("inner") != "cumsum"],
                         ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("dtype", [np.float32, np.complex64])
@pytest.mark.parametrize("reverse", [False, True])
def test_a_reset_cuts_every_input_before_it_exactly(kwargs, dtype, reverse):
  """The states from a reset on (in scan order), and the final state, are the same to the last
  bit whatever came before it: every input before the reset and h0 changed (the programs of
  the test above)."""
  rng = np.random.default_rng(2)
  a, b = _inputs(rng, (29, 2, 3), dtype)
  h0 = _inputs(rng, (2, 3), dtype)[1]
  reset = np.zeros((29, 2, 1), bool)
  first = [13, 9]  # each row's reset: inside a chunk of 4, of 5 and of the default size
  for row, t in enumerate(first):
    reset[t, row] = True
  before = lambda row: slice(first[row] + 1, None) if reverse else slice(None, first[row])
  after = lambda row: slice(None, first[row] + 1) if reverse else slice(first[row], None)
  a2, b2 = a.copy(), b.copy()
  other_a, other_b = _inputs(rng, (29, 2, 3), dtype)
  for row in range(2):
    a2[before(row), row], b2[before(row), row] = other_a[before(row), row], other_b[before(row), row]
  run = lambda a, b, h0: recurrence(a, b, h0, reset=reset, reverse=reverse,
                                    return_final_state=True, **kwargs)
  (h, last), (h2, last2) = run(a, b, h0), run(a2, b2, 2 * h0)
  for row in range(2):
    np.testing.assert_array_equal(h[after(row), row], h2[after(row), row])
    assert not np.allclose(h[before(row), row], h2[before(row), row])
  np.testing.assert_array_equal(last, last2)


def _optimised_program(f, *args):
  """The compiled HLO of `f`, without names, source locations and metadata."""
  text = jax.jit(f).lower(*args).compile().as_text()
  # The module's computations, after its header and the tables of source locations.
  computations = text[text.index("\n\n", text.index("\nStackFrames")):]
  return re.sub(r", metadata=\{[^}]*\}", "", computations)


def test_auto_on_cpu_compiles_to_a_hand_written_lax_scan(monkeypatch):
  """Without resets or a starting state, `auto` on CPU is one `lax.scan` and nothing else: no
  copy, selection or layout change around it (the compiled programs are the same)."""
  monkeypatch.setattr(modes.jax, "default_backend", lambda: "cpu")
  a, b = _inputs(np.random.default_rng(3), (64, 8), np.float32)

  def by_hand(a, b):
    def body(h, ab):
      h = ab[0] * h + ab[1]
      return h, h

    return lax.scan(body, jnp.zeros(b.shape[1:], b.dtype), (a, b))[1]

  with jax.default_device(jax.devices("cpu")[0]):
    assert (_optimised_program(lambda a, b: linear_recurrence(a, b), a, b)
            == _optimised_program(by_hand, a, b))


@settings(max_examples=12, deadline=None)
@given(
    length=st.integers(0, 40),
    batch=st.integers(1, 3),
    axis=st.sampled_from([0, 1, -1, -2]),
    a_kind=st.sampled_from(["full", "per_feature", "scalar", "time_only"]),
    mode=st.sampled_from(["sequential", "parallel", "chunked"]),
    chunk=st.integers(1, 9),
    reverse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_axis_and_broadcast_decay_match_loop(
    length, batch, axis, a_kind, mode, chunk, reverse, seed
):
  rng = np.random.default_rng(seed)
  shape = [batch, 4]
  time_axis = axis % 3
  shape.insert(time_axis, length)
  b = rng.normal(size=shape)
  feature_axis = 1 if time_axis == 2 else 2  # a given as (1, 4) or (4, 1): right-aligned, lower rank
  a_shape = {
      "full": tuple(shape),
      "per_feature": tuple(4 if i == feature_axis else 1 for i in range(3))[1:],
      "scalar": (),
      "time_only": tuple(n if i == time_axis else 1 for i, n in enumerate(shape)),
  }[a_kind]
  a = rng.uniform(0.3, 1.0, a_shape)
  h = recurrence(a, b, reverse=reverse, axis=axis, mode=mode, chunk_size=chunk)
  a_full = np.moveaxis(np.broadcast_to(a, shape), time_axis, 0)
  expected = references.linear_recurrence(a_full, np.moveaxis(b, time_axis, 0), reverse=reverse)
  np.testing.assert_allclose(h, np.moveaxis(expected, 0, time_axis), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["sequential", "parallel", "chunked"])
def test_bfloat16_accumulates_in_float32(mode):
  rng = np.random.default_rng(2)
  a, b = _inputs(rng, (500, 4), np.float32, low=0.99)
  a16, b16 = jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
  # Jitted, a bfloat16 accumulator still rounds every step (checked: it fails this test).
  h = recurrence(a16, b16, mode=mode)
  assert h.dtype == jnp.bfloat16
  expected = references.linear_recurrence(np.asarray(a16, np.float64), np.asarray(b16, np.float64))
  # One bfloat16 rounding of the output (2^-8 relative); a bf16 accumulator drifts far more.
  scale = np.max(np.abs(expected))
  np.testing.assert_allclose(np.asarray(h, np.float64), expected, rtol=2**-8, atol=2**-8 * scale)


def test_bfloat16_streamed_step_by_step_carries_a_float32_state():
  rng = np.random.default_rng(2)
  a, b = _inputs(rng, (200, 4), np.float32, low=0.99)
  a16, b16 = jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
  expected = references.linear_recurrence(np.asarray(a16, np.float64), np.asarray(b16, np.float64))
  step = jax.jit(lambda a, b, h: linear_recurrence(a, b, h, return_final_state=True))
  state, hs = np.zeros(4, np.float32), []
  for t in range(200):
    h, state = step(a16[t:t + 1], b16[t:t + 1], state)
    assert h.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    hs.append(np.asarray(h, np.float64))
  scale = np.max(np.abs(expected))
  np.testing.assert_allclose(np.concatenate(hs), expected, rtol=2**-8, atol=2**-8 * scale)


def _sequential_reference(a, b, h0, reset=None, reverse=False):
  """Plain lax.scan differentiated by JAX autodiff: the gradient reference."""
  a = jnp.broadcast_to(a, b.shape)
  reset = jnp.zeros(b.shape, bool) if reset is None else jnp.broadcast_to(reset, b.shape)

  def body(h, x):
    a_t, b_t, r_t = x
    h = jnp.where(r_t, b_t, a_t * h + b_t)
    return h, h

  return lax.scan(body, h0, (a, b, reset), reverse=reverse)[1]


GRADIENT_CASES = [
    (kwargs, reverse, with_reset)
    for kwargs, reverse, with_reset in itertools.product(MODES[:5], [False, True], [False, True])
    if not (with_reset and kwargs.get("inner") == "cumsum")  # cumsum takes no `reset`
]


@pytest.mark.parametrize(("kwargs", "reverse", "with_reset"), GRADIENT_CASES,
                         ids=lambda v: "-".join(map(str, v.values())) if isinstance(v, dict) else str(v))
@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_gradients_match_autodiff_of_sequential_scan(kwargs, dtype, reverse, with_reset):
  rng = np.random.default_rng(3)
  a, b = _inputs(rng, (23, 3), dtype)
  h0 = _inputs(rng, (3,), dtype)[1]
  reset = (rng.uniform(size=(23, 1)) < 0.25) if with_reset else None
  w = _inputs(rng, (23, 3), dtype)[1]
  loss = lambda f: lambda a, b, h0: jnp.real(jnp.sum(w * f(a, b, h0)))
  ours = jax.jit(jax.grad(
      loss(lambda a, b, h0: linear_recurrence(a, b, h0, reset=reset, reverse=reverse, **kwargs)),
      argnums=(0, 1, 2),
  ))(a, b, h0)
  ref = jax.jit(jax.grad(
      loss(lambda a, b, h0: _sequential_reference(a, b, h0, reset, reverse)), argnums=(0, 1, 2)
  ))(a, b, h0)
  for g, r in zip(ours, ref, strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["sequential", "parallel", "chunked"])
@pytest.mark.parametrize("reverse", [False, True])
def test_gradients_match_finite_differences(mode, reverse):
  rng = np.random.default_rng(4)
  a, b = _inputs(rng, (11, 2), np.float64)
  h0 = rng.normal(size=2)
  reset = jnp.asarray(rng.uniform(size=(11, 2)) < 0.2)
  f = lambda a, b, h0: linear_recurrence(
      a, b, h0, reset=reset, reverse=reverse, mode=mode, chunk_size=3, return_final_state=True
  )
  # Jitted, so the many evaluations at perturbed inputs reuse one compilation.
  check_grads(jax.jit(f), (a, b, h0), order=2, modes=["rev"], eps=1e-6)


@pytest.mark.parametrize("a_shape", [(2,), (), (1, 2), (17, 1)])
@pytest.mark.parametrize("mode", ["sequential", "parallel"])
def test_gradient_of_broadcast_decay_has_its_shape(a_shape, mode):
  rng = np.random.default_rng(5)
  a = rng.uniform(0.5, 1.0, a_shape)
  b = rng.normal(size=(17, 2))
  f = lambda a: jnp.sum(jnp.sin(linear_recurrence(a, b, mode=mode)))
  g = jax.jit(jax.grad(f))(a)
  assert g.shape == a.shape
  ref = jax.jit(jax.grad(lambda a: jnp.sum(jnp.sin(_sequential_reference(a, b, jnp.zeros(2))))))(a)
  np.testing.assert_allclose(g, ref, rtol=1e-10)


@pytest.mark.parametrize("kwargs", MODES[:5], ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("reverse", [False, True])
def test_decay_as_factors_equals_their_product(kwargs, reverse):
  rng = np.random.default_rng(8)
  d = rng.uniform(0.5, 1.0, (19, 3))
  lam, scale = rng.uniform(0.5, 1.0, (19, 3)), rng.uniform(0.5, 1.0, (3,))
  b, h0, w = rng.normal(size=(19, 3)), rng.normal(size=3), rng.normal(size=(19, 3))
  reset = None if kwargs.get("inner") == "cumsum" else rng.uniform(size=(19, 1)) < 0.2
  expected = references.linear_recurrence(d * lam * scale, b, h0, reset, reverse)
  run = lambda a, b, h0: linear_recurrence(a, b, h0, reset=reset, reverse=reverse, **kwargs)
  _assert_close(jax.jit(run)((d, lam, scale), b, h0), expected, np.float64)
  loss = lambda d, lam, scale, b, h0: jnp.sum(w * run((d, lam, scale), b, h0))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(d, lam, scale, b, h0)
  ref = jax.jit(jax.grad(
      lambda d, lam, scale, b, h0: jnp.sum(
          w * _sequential_reference(d * lam * scale[None], b, h0, reset, reverse)
      ),
      argnums=(0, 1, 2, 3, 4),
  ))(d, lam, scale, b, h0)
  for g, r in zip(grads, ref, strict=True):
    assert g.shape == r.shape
    np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-10)


def _leading(flags, ndim):
  """`flags` with unit axes appended up to rank `ndim`: the leading-axes rule, in NumPy."""
  return flags.reshape(flags.shape + (1,) * (ndim - flags.ndim))


@pytest.mark.parametrize("mode", ["sequential", "parallel", "chunked"])
@pytest.mark.parametrize("reset_shape", [(5,), (5, 5), (5, 1), (5, 5, 5)])
def test_reset_lines_up_with_the_leading_axes_even_when_square(mode, reset_shape):
  # T == B == D: right-aligned NumPy broadcasting would take `(T, B)` flags for `(B, D)`.
  rng = np.random.default_rng(11)
  a, b = _inputs(rng, (5, 5, 5), np.float64)
  reset = rng.uniform(size=reset_shape) < 0.3
  expected = references.linear_recurrence(a, b, None, _leading(reset, 3))
  _assert_close(recurrence(a, b, reset=reset, mode=mode, chunk_size=2), expected, np.float64)
  # Batch-major, time on axis 1: `(B, T)` flags.
  swapped = lambda x: np.swapaxes(x, 0, 1)
  got = recurrence(swapped(a), swapped(b), reset=swapped(reset) if reset.ndim > 1 else None,
                   axis=1, mode=mode, chunk_size=2)
  if reset.ndim > 1:
    _assert_close(got, swapped(expected), np.float64)


@pytest.mark.parametrize("reset_shape", [(4,), (6, 4), (1, 3), (6, 3, 2, 1), (6, 3, 2, 5, 1)])
def test_reset_that_does_not_line_up_is_refused(reset_shape):
  with pytest.raises(ValueError, match=r"`reset` with shape .* leading axes of `b`"):
    linear_recurrence(jnp.ones((6, 3, 2)), jnp.ones((6, 3, 2)), reset=jnp.zeros(reset_shape, bool))


def _tangents(rng, *xs):
  return tuple(_inputs(rng, np.shape(x), np.asarray(x).dtype)[1] for x in xs)


JVP_CASES = [
    (kwargs, reverse, with_reset)
    for kwargs, reverse, with_reset in itertools.product(MODES[:5], [False, True], [False, True])
    if not (with_reset and kwargs.get("inner") == "cumsum")
]


@pytest.mark.parametrize(("kwargs", "reverse", "with_reset"), JVP_CASES,
                         ids=lambda v: "-".join(map(str, v.values())) if isinstance(v, dict) else str(v))
def test_jvp_matches_jvp_of_sequential_scan(kwargs, reverse, with_reset):
  rng = np.random.default_rng(12)
  a, b = _inputs(rng, (23, 3), np.complex128)
  h0 = _inputs(rng, (3,), np.complex128)[1]
  reset = (rng.uniform(size=(23,)) < 0.25) if with_reset else None
  primals = (a, b, h0)
  tangents = _tangents(rng, *primals)
  ours = jax.jit(lambda p, t: jax.jvp(
      lambda a, b, h0: linear_recurrence(a, b, h0, reset=reset, reverse=reverse,
                                         return_final_state=True, **kwargs), p, t))(primals, tangents)
  flags = None if reset is None else reset[:, None]
  ref_h, ref_dh = jax.jit(lambda p, t: jax.jvp(
      lambda a, b, h0: _sequential_reference(a, b, h0, flags, reverse), p, t))(primals, tangents)
  edge = 0 if reverse else -1
  for got, want in zip(ours, ((ref_h, ref_h[edge]), (ref_dh, ref_dh[edge])), strict=True):
    for x, y in zip(got, want, strict=True):
      np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["sequential", "parallel", "chunked"])
@pytest.mark.parametrize("reverse", [False, True])
def test_forward_mode_matches_finite_differences(mode, reverse):
  rng = np.random.default_rng(13)
  a = _inputs(rng, (11, 2), np.float64)[0]  # a real decay of a complex state
  b = _inputs(rng, (11, 2), np.complex128)[1]
  h0 = _inputs(rng, (2,), np.complex128)[1]
  reset = jnp.asarray(rng.uniform(size=(11, 2)) < 0.2)
  kw = dict(reset=reset, reverse=reverse, mode=mode, chunk_size=3)
  f = lambda a, b, h0: linear_recurrence(a, b, h0, return_final_state=True, **kw)
  # Second order: jvp of jvp (jacfwd of jacfwd). Reverse mode has its own test above.
  check_grads(jax.jit(f), (a, b, h0), order=2, modes=["fwd"], eps=1e-6)
  final = lambda a, b, h0: linear_recurrence_final_state(a, b, h0, **kw)
  check_grads(jax.jit(final), (a, b, h0), order=2, modes=["fwd"], eps=1e-6)


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
def test_jacfwd_jacrev_and_hessian_through_factors_and_vmap(mode):
  rng = np.random.default_rng(14)
  d, lam = rng.uniform(0.5, 1.0, (7, 3)), rng.uniform(0.5, 1.0, (3,))
  b = rng.normal(size=(2, 7, 3))
  f = lambda d, lam, b: jax.vmap(
      lambda b: linear_recurrence((d, lam), b, mode=mode, return_final_state=True)[1])(b)
  fwd = jax.jit(jax.jacfwd(f, argnums=(0, 1, 2)))(d, lam, b)
  rev = jax.jit(jax.jacrev(f, argnums=(0, 1, 2)))(d, lam, b)
  ref = jax.jit(jax.jacrev(
      lambda d, lam, b: jax.vmap(lambda b: _sequential_reference(d * lam[None], b, jnp.zeros(3))[-1])(b),
      argnums=(0, 1, 2)))(d, lam, b)
  for x, y, z in zip(fwd, rev, ref, strict=True):
    np.testing.assert_allclose(x, z, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(y, z, rtol=1e-10, atol=1e-12)
  # jax.hessian is jacfwd of jacrev: forward mode through the transposed tangents.
  loss = lambda f: lambda d: jnp.sum(jnp.sin(f(d, lam, b)))
  reference = lambda d, lam, b: jax.vmap(
      lambda b: _sequential_reference(d * lam[None], b, jnp.zeros(3))[-1])(b)
  np.testing.assert_allclose(jax.jit(jax.hessian(loss(f)))(d),
                             jax.jit(jax.hessian(loss(reference)))(d), rtol=1e-10, atol=1e-12)


def test_gradient_temp_memory_stays_at_lax_scan_autodiff():
  t, d = 4096, 64
  a = jnp.full((t, d), 0.99, jnp.float32)
  b = jnp.ones((t, d), jnp.float32)
  w = jnp.ones((t, d), jnp.float32)

  def temp_bytes(f):
    grad = jax.jit(jax.grad(lambda a, b, w: jnp.sum(f(a, b) * w), argnums=(0, 1)))
    return grad.lower(a, b, w).compile().memory_analysis().temp_size_in_bytes

  def plain_scan(a, b):
    step = lambda h, x: (x[0] * h + x[1],) * 2
    return lax.scan(step, jnp.zeros(d), (a, b))[1]

  assert temp_bytes(lambda a, b: linear_recurrence(a, b, mode="sequential")) <= temp_bytes(plain_scan)


@pytest.mark.parametrize("mode", ["sequential", "parallel", "chunked"])
def test_an_argument_b_is_not_copied(mode):
  # Writing states over an argument `b` (or h0 into its first row) makes XLA copy it first:
  # a whole extra pass over memory in a memory-bound recurrence.
  a = jnp.full((64, 8), 0.9, jnp.float32)
  b = jnp.ones((64, 8), jnp.float32)
  f = jax.jit(lambda a, b: linear_recurrence(a, b, mode=mode, chunk_size=8))
  assert "f32[64,8]{1,0} copy(" not in f.lower(a, b).compile().as_text()


@pytest.mark.parametrize("reverse", [False, True])
def test_overwrite_b_is_a_speed_hint_that_keeps_the_result(reverse):
  rng = np.random.default_rng(15)
  a, b = _inputs(rng, (29, 3), np.float64)
  h0 = rng.normal(size=3)
  reset = rng.uniform(size=29) < 0.2
  expected = references.linear_recurrence(a, b, h0, _leading(reset, 2), reverse)
  for overwrite_b in (False, True):
    run = jax.jit(lambda a, b, h0, w=overwrite_b: linear_recurrence(
        a, 2.0 * b, h0, reset=reset, reverse=reverse, mode="sequential", overwrite_b=w))
    _assert_close(run(a, b / 2.0, h0), expected, np.float64)
    grads = jax.jit(jax.grad(lambda a, b, w=overwrite_b: jnp.sum(jnp.sin(linear_recurrence(
        a, b, h0, reset=reset, reverse=reverse, mode="sequential", overwrite_b=w))),
        argnums=(0, 1)))(a, b)
    ref = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(_sequential_reference(
        a, b, h0, reset[:, None], reverse))), argnums=(0, 1)))(a, b)
    for g, r in zip(grads, ref, strict=True):
      np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)


def test_real_decay_complex_input_gives_real_gradient():
  rng = np.random.default_rng(6)
  a = rng.uniform(0.5, 1.0, (9, 2))
  b = rng.normal(size=(9, 2)) + 1j * rng.normal(size=(9, 2))
  f = lambda a, b: jnp.sum(jnp.abs(linear_recurrence(a, b)) ** 2)
  ga, gb = jax.jit(jax.grad(f, argnums=(0, 1)))(a, b)
  assert ga.dtype == np.float64 and gb.dtype == np.complex128
  ref_loss = lambda a, b: jnp.sum(jnp.abs(_sequential_reference(a, b, jnp.zeros(2, b.dtype))) ** 2)
  ref = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(a, b)
  np.testing.assert_allclose(ga, ref[0], rtol=1e-10)
  np.testing.assert_allclose(gb, ref[1], rtol=1e-10)


@pytest.mark.parametrize("mode", ["sequential", "parallel", "chunked"])
def test_nan_before_reset_does_not_leak(mode):
  a = jnp.full((8, 2), 0.9)
  b = jnp.ones((8, 2)).at[2].set(jnp.nan)
  reset = jnp.zeros((8, 1), bool).at[4].set(True)
  h = recurrence(a, b, reset=reset, mode=mode, chunk_size=3)
  assert np.isnan(h[2:4]).all() and np.isfinite(h[4:]).all()
  expected = references.linear_recurrence(np.full((4, 2), 0.9), np.ones((4, 2)))
  np.testing.assert_allclose(h[4:], expected, rtol=1e-12)
  # The gradient of the part after the reset does not touch the NaN segment either.
  g = jax.jit(jax.grad(lambda b: jnp.sum(linear_recurrence(a, b, reset=reset, mode=mode)[4:])))(b)
  assert np.isfinite(g).all() and (np.asarray(g[:4]) == 0).all()


@pytest.mark.parametrize(("mode", "chunk_size"),
                         [("sequential", None), ("parallel", None), ("chunked", 3), ("chunked", 8)])
def test_nan_or_inf_in_any_input_before_a_reset_reaches_no_gradient_after_it(mode, chunk_size):
  """A NaN and an Inf in `a`, in `b` or in `h0`, in the chunk of the reset or an earlier one:
  the gradients of a loss on the steps from the last reset on are finite from there on."""
  rng = np.random.default_rng(40)
  reset = np.zeros((20, 1), bool)
  reset[[6, 12]] = True

  @jax.jit
  def values_and_gradients(inputs):
    run = lambda inputs: linear_recurrence(*inputs, reset=reset, mode=mode, chunk_size=chunk_size)
    return run(inputs), jax.grad(lambda inputs: jnp.sum(jnp.sin(run(inputs)[12:])))(inputs)

  for name in ("a", "b", "h0"):
    inputs = dict(a=rng.uniform(0.5, 0.9, (20, 2)), b=rng.normal(size=(20, 2)),
                  h0=rng.normal(size=2))
    if name == "h0":
      inputs[name][0] = np.nan
    else:
      inputs[name][3, 1], inputs[name][9, 0] = np.nan, np.inf
    h, g = values_and_gradients((inputs["a"], inputs["b"], inputs["h0"]))
    expected = references.linear_recurrence(inputs["a"][12:], inputs["b"][12:])
    np.testing.assert_allclose(h[12:], expected, rtol=1e-12)
    assert np.isfinite(g[0][12:]).all() and np.isfinite(g[1][12:]).all(), name


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_strong_decays_in_every_mode_values_and_gradients(dtype):
  """Decays of exp(-47) to exp(-50) a step, with resets: products underflow to 0, which is
  right; nothing may overflow or divide by them (the cumsum form, documented unsafe, aside)."""
  rng = np.random.default_rng(41)
  a = np.exp(-rng.uniform(47.0, 50.0, (70, 3))).astype(dtype)
  b = rng.normal(size=(70, 3)).astype(dtype)
  h0 = rng.normal(size=3).astype(dtype)
  reset = rng.uniform(size=(70, 1)) < 0.1
  tol = 1e-12 if dtype == np.float64 else 1e-6
  expected = references.linear_recurrence(a, b, h0, reset)
  loss = lambda f: lambda a, b, h0: jnp.sum(jnp.sin(f(a, b, h0)))
  every_feature = np.broadcast_to(reset, (70, 3))
  reference = loss(lambda a, b, h0: _sequential_reference(a, b, h0, every_feature))
  expected_grads = jax.jit(jax.grad(reference, argnums=(0, 1, 2)))(a, b, h0)
  for kwargs in MODES:
    if kwargs.get("inner") == "cumsum":
      continue
    run = lambda a, b, h0, kwargs=kwargs: linear_recurrence(a, b, h0, reset=reset, **kwargs)
    np.testing.assert_allclose(jax.jit(run)(a, b, h0), expected, rtol=tol, atol=tol)
    grads = jax.jit(jax.grad(loss(run), argnums=(0, 1, 2)))(a, b, h0)
    for got, want in zip(grads, expected_grads, strict=True):
      assert np.all(np.isfinite(got)), kwargs
      np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("mode", ["sequential", "parallel", "chunked"])
@pytest.mark.parametrize("reverse", [False, True])
def test_streaming_in_pieces_equals_one_pass(mode, reverse):
  rng = np.random.default_rng(7)
  a, b = _inputs(rng, (50, 3), np.float64)
  whole = recurrence(a, b, reverse=reverse, mode=mode)
  pieces = [slice(0, 13), slice(13, 14), slice(14, 50)]
  if reverse:
    pieces = pieces[::-1]
  state, outs = None, {}
  for piece in pieces:
    outs[piece.start], state = recurrence(
        a[piece], b[piece], state, reverse=reverse, mode=mode, return_final_state=True
    )
  streamed = np.concatenate([outs[k] for k in sorted(outs)])
  np.testing.assert_allclose(streamed, whole, rtol=1e-12)


@pytest.mark.parametrize("mode", ["sequential", "parallel", "chunked"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("length", [0, 1, 10, 37])
def test_final_state_path_matches_last_state_and_gradient(mode, reverse, length):
  rng = np.random.default_rng(8)
  a, b = _inputs(rng, (length, 3), np.complex128)
  h0 = _inputs(rng, (3,), np.complex128)[1]
  reset = rng.uniform(size=(length, 3)) < 0.2
  kw = dict(reset=reset, reverse=reverse, mode=mode, chunk_size=4)
  final = final_state(a, b, h0, **kw)
  expected = references.linear_recurrence(a, b, h0, reset, reverse)
  expected = expected[0 if reverse else -1] if length else h0
  np.testing.assert_allclose(final, expected, rtol=1e-12)
  loss = lambda f: lambda a, b, h0: jnp.real(jnp.sum(f(a, b, h0) * jnp.arange(1, 4)))
  final_grad = jax.grad(loss(lambda *x: linear_recurrence_final_state(*x, **kw)), argnums=(0, 1, 2))
  g = jax.jit(final_grad)(a, b, h0)
  full = lambda a, b, h0: linear_recurrence(a, b, h0, return_final_state=True, **kw)[1]
  ref = jax.jit(jax.grad(loss(full), argnums=(0, 1, 2)))(a, b, h0)
  for x, y in zip(g, ref, strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)


def test_final_state_path_keeps_no_sequence_of_states():
  a = jnp.full((4096, 64), 0.99, jnp.float32)
  b = jnp.ones((4096, 64), jnp.float32)
  final = jax.jit(lambda a, b: linear_recurrence_final_state(a, b, mode="sequential"))
  full = jax.jit(lambda a, b: linear_recurrence(a, b, mode="sequential"))
  states_bytes = 4096 * 64 * 4
  final_mem = final.lower(a, b).compile().memory_analysis()
  full_mem = full.lower(a, b).compile().memory_analysis()
  assert final_mem.temp_size_in_bytes + final_mem.output_size_in_bytes < states_bytes / 16
  assert full_mem.output_size_in_bytes >= states_bytes


def test_cumsum_strategy_is_exact_in_its_domain_and_breaks_outside():
  rng = np.random.default_rng(9)
  b = rng.normal(size=(256, 2)).astype(np.float32)
  safe = rng.uniform(0.9, 1.0, (256, 2)).astype(np.float32)  # 16 * -log(0.9) ~ 1.7 < 20
  h = linear_recurrence(safe, b, mode="chunked", chunk_size=16, inner="cumsum")
  _assert_close(h, references.linear_recurrence(safe, b), np.float32)
  # Decays of 1e-3 over chunks of 32 steps drive the running product to 1e-96: it
  # underflows in float32 and the closed form divides by zero.
  tiny = np.full((256, 2), 1e-3, np.float32)
  h = linear_recurrence(tiny, b, mode="chunked", chunk_size=32, inner="cumsum")
  assert not np.isfinite(np.asarray(h)).all()
  assert np.isfinite(np.asarray(linear_recurrence(tiny, b, mode="chunked", chunk_size=32))).all()


def test_cumsum_rejects_reset():
  with pytest.raises(ValueError, match="cumsum"):
    linear_recurrence(jnp.ones(4), jnp.ones(4), reset=jnp.zeros(4, bool), mode="chunked",
                      inner="cumsum")


@pytest.mark.parametrize("mode", ["sequential", "parallel", "chunked"])
def test_jit_equals_no_jit_and_second_call_does_not_retrace(mode):
  rng = np.random.default_rng(10)
  a, b = _inputs(rng, (31, 4), np.float32)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(a, b):
    return linear_recurrence(a, b, mode=mode, reverse=True)

  first = f(a, b)
  second = f(a + 0.0, b * 2.0)
  # Compiled and op-by-op float32 differ only by fused multiply-adds.
  eager = linear_recurrence(a, b, mode=mode, reverse=True)
  np.testing.assert_allclose(first, eager, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(second, 2 * np.asarray(first), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(a=jnp.ones((5, 3)), b=jnp.ones((4, 3))), ValueError, "`a`"),
        (dict(a=jnp.ones(4, jnp.int32), b=jnp.ones(4)), TypeError, "`a`"),
        (dict(a=jnp.ones(4), b=jnp.ones(4, jnp.int32)), TypeError, "`b`"),
        (dict(a=jnp.ones(4), b=jnp.ones(4), axis=1), ValueError, "`axis`"),
        (dict(a=jnp.ones(4), b=jnp.ones(4), mode="fast"), ValueError, "`mode`"),
        (dict(a=jnp.ones(4), b=jnp.ones(4), mode="chunked", chunk_size=0), ValueError, "chunk_size"),
        (dict(a=jnp.ones(4), b=jnp.ones(4), chunk_size=2.5), TypeError, "chunk_size"),
        (dict(a=jnp.ones(4), b=jnp.ones(4), inner="magic"), ValueError, "`inner`"),
        (dict(a=jnp.ones(4), b=jnp.ones(4), mode="sequential", inner="cumsum"), ValueError,
         "`inner`.*mode='sequential'"),
        (dict(a=jnp.ones((4, 3)), b=jnp.ones((4, 3)), h0=jnp.ones(4)), ValueError, "`h0`"),
        (dict(a=jnp.ones(4), b=jnp.ones(4), reset=jnp.zeros(4)), TypeError, "`reset`"),
        (dict(a=jnp.ones(4), b=jnp.ones(4), reset=jnp.zeros(5, bool)), ValueError, "`reset`"),
        (dict(a=jnp.ones(()), b=jnp.ones(())), ValueError, "`b`"),
        (dict(a=(jnp.ones(4), jnp.ones(5)), b=jnp.ones(4)), ValueError, r"`a\[1\]`"),
        (dict(a=(), b=jnp.ones(4)), ValueError, "`a`"),
    ],
)
def test_bad_input_raises_naming_the_argument(kwargs, error, match):
  with pytest.raises(error, match=match):
    jax.jit(lambda: linear_recurrence(**kwargs))()


@pytest.mark.parametrize("mode", ["parallel", "chunked"])
def test_final_state_with_chunks_longer_than_the_sequence(mode):
  final = linear_recurrence_final_state(jnp.full(3, 0.5), jnp.ones(3), mode=mode, chunk_size=8)
  np.testing.assert_allclose(final, references.linear_recurrence(np.full(3, 0.5), np.ones(3))[-1])
