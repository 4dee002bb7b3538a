"""`forward_fill` and `expand_runs` against NumPy loops; gradients routed to the source."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssmkit.scan import expand_runs, forward_fill

MODES = ["sequential", "parallel", "chunked"]
# Compiled once per shape and options for the drawn examples: called eagerly, every primitive
# inside would compile a program of its own for each shape.
_forward_fill = jax.jit(forward_fill, static_argnames=("reverse", "axis", "mode"))
_expand_runs = jax.jit(expand_runs, static_argnames=("length", "axis", "mode"))


def _fill_loop(x, mask, reverse, fill):
  out = np.full_like(x, fill)
  order = range(len(x) - 1, -1, -1) if reverse else range(len(x))
  current = None
  for t in order:
    if mask[t]:
      current = x[t]
    if current is not None:
      out[t] = current
  return out


@pytest.mark.parametrize("mode", MODES)
def test_right_flood_and_gradient_routed_to_source(mode):
  x = jnp.array([1.0, 0, 0, 3, 0, 6, 0, 0])
  np.testing.assert_array_equal(forward_fill(x, mode=mode), [1, 1, 1, 3, 3, 6, 6, 6])
  grad = jax.grad(lambda x: forward_fill(x, mode=mode).sum())(x)
  np.testing.assert_array_equal(grad, [3, 0, 0, 2, 0, 3, 0, 0])


@settings(max_examples=15, deadline=None)
@given(
    length=st.sampled_from([0, 1, 2, 7, 13, 40]),
    reverse=st.booleans(),
    mode=st.sampled_from(MODES),
    fill=st.sampled_from([0.0, -1.0]),
    seed=st.integers(0, 1000),
)
def test_masked_fill_matches_loop_on_each_column(length, reverse, mode, fill, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(length, 3))
  x[rng.uniform(size=x.shape) < 0.2] = np.nan  # NaNs in non-sources never spread
  mask = (rng.uniform(size=x.shape) < 0.3) & ~np.isnan(x)
  out = _forward_fill(x, mask, reverse=reverse, mode=mode, fill_value=fill)
  for j in range(3):
    np.testing.assert_array_equal(out[:, j], _fill_loop(x[:, j], mask[:, j], reverse, fill))


@pytest.mark.parametrize("mode", MODES)
def test_mask_lines_up_with_the_leading_axes_even_when_square(mode):
  # A `(T,)` mask of a `(T, D)` input marks steps; with T == D right-aligned broadcasting
  # would read it as marking columns.
  rng = np.random.default_rng(3)
  x = rng.normal(size=(5, 5))
  steps = rng.uniform(size=5) < 0.5
  out = _forward_fill(x, steps, mode=mode)
  for j in range(5):
    np.testing.assert_array_equal(out[:, j], _fill_loop(x[:, j], steps, False, 0.0))
  # Batch-major, time on axis 1: a `(B, T)` mask of a `(B, T, D)` input.
  sources = rng.uniform(size=(2, 5)) < 0.5
  out = _forward_fill(np.stack([x, x]), sources, axis=1, mode=mode)
  for i, j in np.ndindex(2, 5):
    np.testing.assert_array_equal(out[i, :, j], _fill_loop(x[:, j], sources[i], False, 0.0))


@pytest.mark.parametrize("mode", MODES)
def test_forward_mode_routes_the_tangent_from_the_source(mode):
  x = jnp.array([1.0, 0, 0, 3, 0, 6, 0, 0])
  t = jnp.arange(1.0, 9.0)
  _, tangent = jax.jvp(lambda x: forward_fill(x, x != 0, mode=mode), (x,), (t,))
  np.testing.assert_array_equal(tangent, [1, 1, 1, 4, 4, 6, 6, 6])


def test_fill_along_a_batch_major_axis():
  x = jnp.array([[0.0, 2.0, 0.0, 0.0], [5.0, 0.0, 7.0, 0.0]])
  np.testing.assert_array_equal(forward_fill(x, axis=1), [[0, 2, 2, 2], [5, 5, 7, 7]])
  np.testing.assert_array_equal(forward_fill(x, axis=-1, reverse=True), [[2, 2, 0, 0], [5, 7, 7, 0]])


@settings(max_examples=15, deadline=None)
@given(
    counts=st.lists(st.integers(0, 4), min_size=0, max_size=12),
    extra=st.integers(-3, 3),
    mode=st.sampled_from(MODES),
)
def test_expand_runs_inverts_stream_compaction(counts, extra, mode):
  counts = np.array(counts, np.int32)
  values = np.arange(1.0, len(counts) + 1.0)
  length = max(0, int(counts.sum()) + extra)
  expected = np.repeat(values, counts)[:length]
  expected = np.concatenate([expected, np.full(length - len(expected), -9.0)])
  out = _expand_runs(values, counts, length, mode=mode, fill_value=-9.0)
  np.testing.assert_array_equal(out, expected)


def test_expand_runs_gradient_counts_repeats():
  counts = jnp.array([2, 0, 3])
  grad = jax.grad(lambda v: expand_runs(v, counts, 5).sum())(jnp.ones(3))
  np.testing.assert_array_equal(grad, [2, 0, 3])


def test_bad_input_raises_naming_the_argument():
  with pytest.raises(TypeError, match="`mask`"):
    forward_fill(jnp.ones(3), jnp.ones(3))
  with pytest.raises(ValueError, match="`mask`"):
    forward_fill(jnp.ones(3), jnp.ones(4, bool))
  with pytest.raises(ValueError, match=r"`mask` .* leading axes of `x`"):
    forward_fill(jnp.ones((3, 2)), jnp.ones(2, bool))
  with pytest.raises(ValueError, match="`axis`"):
    forward_fill(jnp.ones(3), axis=1)
  with pytest.raises(ValueError, match="`counts`"):
    expand_runs(jnp.ones(3), jnp.ones(2, jnp.int32), 4)
  with pytest.raises(TypeError, match="`counts`"):
    expand_runs(jnp.ones(3), jnp.ones(3), 4)
  with pytest.raises(ValueError, match="`length`"):
    expand_runs(jnp.ones(3), jnp.ones(3, jnp.int32), -1)
