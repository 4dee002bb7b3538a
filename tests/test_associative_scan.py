"""`associative_scan`: every operator and mode against a float64 loop and lax.associative_scan."""

import collections
import operator

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import references
from ssmkit.scan import Mode, associative_scan, operators

MODES = [
    dict(mode="sequential"),
    dict(mode="parallel"),
    dict(mode="chunked", chunk_size=4, inner="sequential"),
    dict(mode="chunked", chunk_size=3, inner="parallel"),
    dict(mode="auto"),
]
MODE_IDS = ["sequential", "parallel", "chunked-seq", "chunked-par", "auto"]

# Jitted: a test then compiles one program, where an eager call of the parallel and chunked
# modes dispatches hundreds of small operations, each compiled on its own. The eager path
# keeps its own tests (the enum and error tests).
scan = jax.jit(
    associative_scan,
    static_argnums=0,
    static_argnames=("reverse", "axis", "mode", "chunk_size", "inner", "exclusive"),
)


def _np_affine(x, y):
  return x[0] * y[0], y[0] * x[1] + y[1]


def _np_matrix_affine(x, y):
  return y[0] @ x[0], np.einsum("...ij,...j->...i", y[0], x[1]) + y[1]


def _np_with_resets(fn):
  def combine(x, y):
    r1, *v1 = x
    r2, *v2 = y
    merged = fn(tuple(v1), tuple(v2))
    keep = lambda new, old: np.where(r2.reshape(r2.shape + (1,) * (old.ndim - r2.ndim)), old, new)
    return (r1 | r2, *(keep(n, o) for n, o in zip(merged, v2, strict=True)))

  return combine


def _case(name, rng, length):
  """(operator, elements as a tuple, float64 NumPy operator on tuples)."""
  x = rng.normal(size=(length, 3))
  if name == "add":
    return operators.add, (x,), lambda u, v: (u[0] + v[0],)
  if name == "maximum":
    return operators.maximum, (x,), lambda u, v: (np.maximum(u[0], v[0]),)
  if name == "logaddexp":
    return operators.logaddexp, (x,), lambda u, v: (np.logaddexp(u[0], v[0]),)
  if name == "forward_fill":
    x = np.where(rng.uniform(size=x.shape) < 0.6, 0.0, x)
    return operators.forward_fill, (x,), lambda u, v: (np.where(v[0] != 0, v[0], u[0]),)
  if name == "affine":
    return operators.affine, (rng.uniform(0.5, 1.0, x.shape), x), _np_affine
  if name == "matrix_affine":
    a = rng.normal(size=(length, 3, 3)) / 2
    return operators.matrix_affine, (a, x), _np_matrix_affine
  if name == "segmented_affine":
    reset = rng.uniform(size=(length, 3)) < 0.3
    elems = (reset, rng.uniform(0.5, 1.0, x.shape), x)
    return operators.with_resets(operators.affine), elems, _np_with_resets(_np_affine)
  raise ValueError(name)


OPERATORS = ["add", "maximum", "logaddexp", "forward_fill", "affine", "matrix_affine",
             "segmented_affine"]


def _structured(name, elems):
  """The ssmkit element structure: (reset, (a, b)) for the segmented operator."""
  if name == "segmented_affine":
    return (elems[0], (elems[1], elems[2]))
  if len(elems) == 1:
    return elems[0]
  return elems


@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", OPERATORS)
@pytest.mark.parametrize("length", [0, 1, 2, 13, 32])
@pytest.mark.parametrize("reverse", [False, True])
def test_every_operator_and_mode_matches_float64_loop(kwargs, name, length, reverse):
  rng = np.random.default_rng(length)
  op, elems, np_op = _case(name, rng, length)
  out = scan(op, _structured(name, elems), reverse=reverse, **kwargs)
  expected = references.scan_loop(np_op, elems, reverse=reverse)
  for got, want in zip(jax.tree.leaves(out), expected, strict=True):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("reverse", [False, True])
def test_drop_in_for_lax_associative_scan_with_non_commutative_operator(kwargs, reverse):
  """Matrix products do not commute: the operand order of `reverse` must match lax."""
  mats = jax.random.normal(jax.random.key(0), (11, 2, 3, 3), jnp.float64)
  ours = scan(jnp.matmul, mats, reverse=reverse, **kwargs)
  theirs = jax.jit(lambda m: lax.associative_scan(jnp.matmul, m, reverse=reverse))(mats)
  np.testing.assert_allclose(ours, theirs, rtol=1e-10)


@settings(max_examples=10, deadline=None)
@given(
    length=st.sampled_from([0, 1, 2, 3, 5, 17, 31, 64]),
    axis=st.sampled_from([0, 1, 2, -1, -3]),
    mode=st.sampled_from(["sequential", "parallel", "chunked"]),
    inner=st.sampled_from(["sequential", "parallel"]),
    chunk=st.integers(1, 10),
    reverse=st.booleans(),
)
def test_any_axis_and_pytree_matches_lax(length, axis, mode, inner, chunk, reverse):
  shape = [2, 3]
  shape.insert(axis % 3, length)
  rng = np.random.default_rng(length)
  elems = {"a": rng.uniform(0.5, 1.0, shape), "b": [rng.normal(size=shape)]}
  fn = lambda x, y: {"a": x["a"] * y["a"], "b": [y["a"] * x["b"][0] + y["b"][0]]}
  inner = inner if mode == "chunked" else None  # the in-chunk strategy of the chunked mode
  ours = scan(fn, elems, axis=axis, reverse=reverse, mode=mode, inner=inner, chunk_size=chunk)
  # lax.associative_scan cannot take an empty sequence; its scan of nothing is nothing.
  theirs = elems if length == 0 else jax.jit(
      lambda e: lax.associative_scan(fn, e, axis=axis % 3, reverse=reverse))(elems)
  # Both sides are float64 with different association orders: rounding is relative to the
  # largest magnitude, not to each (possibly cancelled, near-zero) element.
  def close(u, v):
    np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12 * np.max(np.abs(v), initial=0.0))

  jax.tree.map(close, ours, theirs)


@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("reverse", [False, True])
def test_fn_written_for_lax_with_vmap_or_indexing_the_scan_axis_works_in_every_mode(kwargs, reverse):
  # lax.associative_scan's docstring suggests writing `fn` with jax.vmap over the scan axis:
  # it gets arrays that keep that axis, with some length >= 1.
  x = jnp.arange(1.0, 12.0)
  added = scan(jax.vmap(lambda a, b: a + b), x, reverse=reverse, **kwargs)
  np.testing.assert_array_equal(added, np.cumsum(x[::-1])[::-1] if reverse else np.cumsum(x))
  # An `fn` that indexes the scan axis where it stands (last here), named from either end.
  mats = jax.random.normal(jax.random.key(1), (3, 3, 13), jnp.float64) / 2
  fn = lambda a, b: jnp.einsum("ijt,jkt->ikt", a, b)
  theirs = jax.jit(lambda m: lax.associative_scan(fn, m, axis=2, reverse=reverse))(mats)
  for axis in (2, -1):
    ours = scan(fn, mats, axis=axis, reverse=reverse, **kwargs)
    np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
def test_fn_gets_the_scan_axis_in_place(kwargs):
  shapes = []

  def fn(a, b):
    shapes.append((a.shape, b.shape))
    return a + b

  scan(fn, jnp.ones((2, 23, 3)), axis=1, **kwargs)
  assert shapes
  for a_shape, b_shape in shapes:
    # lax.associative_scan itself (the parallel modes) also combines empty pieces.
    assert a_shape == b_shape and len(a_shape) == 3 and a_shape[0::2] == (2, 3)


# JAX's own tests of lax.associative_scan (tests/lax_control_flow_test.py), in every mode.
@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
@pytest.mark.parametrize(("shape", "axis"), [
    (shape, axis)
    for shape in [[0], [1], [2], [5], [1000], [7, 5], [5, 6, 7]]
    for axis in range(-len(shape), len(shape) - 1)
])
def test_lax_associative_scan_unstructured(kwargs, shape, axis):
  data = np.arange(np.prod(shape)).reshape(shape) + 7
  result = scan(operator.add, data, axis=axis, **kwargs)
  np.testing.assert_array_equal(result, np.cumsum(data, axis=axis))


@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
def test_lax_associative_scan_cases(kwargs):
  data = np.arange(1000) + 32
  reversed_sum = scan(operator.add, data, reverse=True, **kwargs)
  np.testing.assert_array_equal(reversed_sum, np.cumsum(data[::-1])[::-1])
  # Structured3: a namedtuple of arrays.
  pair = collections.namedtuple("pair", ("first", "second"))
  data = pair(first=np.array([0.0, 1.0, 2.0]), second=np.array([0.0, 10.0, 20.0]))
  fn = lambda a, b: pair(first=a.first + b.first, second=a.second + b.second)
  result = scan(fn, data, **kwargs)
  np.testing.assert_array_equal(result.first, [0.0, 1.0, 3.0])
  np.testing.assert_array_equal(result.second, [0.0, 10.0, 30.0])
  # OfBools.
  x = jnp.array([False, True, True, True, False, True])
  np.testing.assert_array_equal(scan(lax.bitwise_xor, x, **kwargs),
                                [False, True, False, True, True, False])


@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("length", [2, 43, 100])
def test_lax_associative_scan_solving_regression(kwargs, length):
  # A batch-sensitive operator (solve) written with jax.vmap must not raise. It is not
  # associative, so only the shapes, and lax's own mode, are compared.
  ms = np.repeat(np.eye(2).reshape(1, 2, 2), length, axis=0)
  vs = np.ones((length, 2))

  @jax.vmap
  def fn(a, b):
    m1, v1 = a
    m2, v2 = b
    return m1 + m2, jsp.linalg.solve(m1, v2) + jsp.linalg.solve(m2, v1)

  out = scan(fn, (ms, vs), **kwargs)
  assert out[0].shape == ms.shape and out[1].shape == vs.shape
  if kwargs["mode"] == "parallel":
    np.testing.assert_array_equal(out[1], jax.jit(lambda e: lax.associative_scan(fn, e))((ms, vs))[1])


@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
def test_operator_that_is_not_elementwise_is_named(kwargs):
  with pytest.raises(ValueError, match="`fn` must return an element like its operands"):
    associative_scan(lambda a, b: (a * b).sum(axis=0), jnp.ones((9, 3)), **kwargs)
  with pytest.raises(ValueError, match="`fn` must return an element like its operands"):
    associative_scan(lambda a, b: (a + b, a), (jnp.ones(9), jnp.ones(9), jnp.ones(9)), **kwargs)


@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
def test_segmented_elements_that_are_not_pairs_are_named(kwargs):
  op = operators.with_resets(operators.add)
  flags, x = jnp.zeros(9, bool), jnp.ones(9)
  with pytest.raises(TypeError, match=r"with_resets\(fn\).*tuple of 3"):
    associative_scan(op, (flags, x, x), **kwargs)
  with pytest.raises(TypeError, match=r"with_resets\(fn\).*boolean flags"):
    associative_scan(op, (x, x), **kwargs)


@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("reverse", [False, True])
def test_exclusive_scan_is_shifted_inclusive_scan(kwargs, reverse):
  x = jnp.arange(1.0, 8.0)
  inclusive = np.asarray(scan(operators.add, x, reverse=reverse, **kwargs))
  exclusive = scan(operators.add, x, reverse=reverse, exclusive=True, **kwargs)
  expected = np.append(inclusive[1:], 0.0) if reverse else np.insert(inclusive[:-1], 0, 0.0)
  np.testing.assert_array_equal(exclusive, expected)
  m = scan(operators.maximum, x, exclusive=True, **kwargs)
  assert m[0] == -np.inf


def test_segmented_operator_keeps_nan_inside_its_segment():
  values = jnp.array([1.0, jnp.nan, 2.0, 3.0, jnp.inf, 1.0])
  flags = jnp.array([False, False, True, False, True, False])
  for mode in ["sequential", "parallel", "chunked"]:
    _, out = scan(operators.with_resets(operators.add), (flags, values), mode=mode, chunk_size=2)
    np.testing.assert_array_equal(out, [1.0, np.nan, 2.0, 5.0, np.inf, np.inf])
    _, out = scan(operators.with_resets(operators.maximum), (flags, -values), mode=mode,
                  reverse=True)
    # Reversed, a flag at t cuts t off from t+1: the NaN at 1 reaches 0, never 2.
    np.testing.assert_array_equal(out, [np.nan, np.nan, -2.0, -3.0, -np.inf, -1.0])


def test_matrix_affine_runs_a_second_order_recurrence_in_companion_form():
  """y_t = c1 y_{t-1} + c2 y_{t-2} + u_t as h_t = A h_{t-1} + (u_t, 0)."""
  rng = np.random.default_rng(0)
  c1, c2, u = 0.5, -0.3, rng.normal(size=40)
  companion = np.broadcast_to(np.array([[c1, c2], [1.0, 0.0]]), (40, 2, 2))
  b = np.stack([u, np.zeros(40)], axis=1)
  _, h = scan(operators.matrix_affine, (companion, b), mode="chunked", chunk_size=6)
  y, prev = np.zeros(40), (0.0, 0.0)
  for t in range(40):
    y[t] = c1 * prev[0] + c2 * prev[1] + u[t]
    prev = (y[t], prev[0])
  np.testing.assert_allclose(h[:, 0], y, rtol=1e-12, atol=1e-12)


def test_modes_are_an_enum_and_strings_are_accepted():
  x = jnp.arange(5.0)
  np.testing.assert_array_equal(associative_scan(operators.add, x, mode=Mode.CHUNKED),
                                associative_scan(operators.add, x, mode="chunked"))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: associative_scan(operators.add, jnp.ones(3), mode="fastest"), ValueError, "`mode`"),
        (lambda: associative_scan(operators.add, jnp.ones(3), axis=2), ValueError, "`axis`"),
        (lambda: associative_scan(operators.add, jnp.ones(3), chunk_size=-1), ValueError,
         "chunk_size"),
        (lambda: associative_scan(operators.add, (jnp.ones(3), jnp.ones(4))), ValueError, "length"),
        (lambda: associative_scan(jnp.add, jnp.ones(3), exclusive=True), TypeError, "identity"),
        (lambda: associative_scan("add", jnp.ones(3)), TypeError, "`fn`"),
        (lambda: associative_scan(operators.add, jnp.ones(3), inner="cumsum"), ValueError,
         "`inner`"),
        (lambda: associative_scan(operators.add, ()), ValueError, "`elems`"),
        (lambda: associative_scan(operators.add, jnp.ones(3), mode="sequential", inner="parallel"),
         ValueError, "`inner`.*mode='sequential'"),
        (lambda: associative_scan(operators.add, jnp.ones(3), mode="parallel", inner="sequential"),
         ValueError, "`inner`.*mode='parallel'"),
    ],
)
def test_bad_input_raises_naming_the_argument(call, error, match):
  with pytest.raises(error, match=match):
    call()
