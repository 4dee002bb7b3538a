"""Sequence parallelism: scans with time split over 8 host devices equal the one-device scans.

Every comparison is in float64 to 1e-9 (relative to the largest magnitude): the sharded
scan only reassociates the same operations, so it agrees to rounding. The tests run on the
default backend's devices where it has 8, else on the CPU's (the `host_devices` fixture).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import references
from ssmkit import layers, rl
from ssmkit._src import state_pass
from ssmkit.scan import (
  Mamba3State,
  associative_scan,
  delta_product,
  delta_rule,
  generalized_delta_rule,
  linear_attention,
  linear_recurrence,
  linear_recurrence_final_state,
  mamba3,
  operators,
)

pytestmark = pytest.mark.usefixtures("host_devices")

DEVICES = 8
TOL = 1e-9
SEQ = P("seq")

MODES = [
    dict(mode="sequential"),
    dict(mode="parallel"),
    dict(mode="chunked", chunk_size=2, inner="sequential"),
    dict(mode="chunked", chunk_size=3, inner="parallel"),
    dict(mode="chunked", chunk_size=2, inner="cumsum"),
]  # "auto" is one of these: "sequential" on CPU
MODE_IDS = ["sequential", "parallel", "chunked-seq", "chunked-par", "chunked-cumsum"]


@functools.cache
def _mesh(shape=(DEVICES,), names=("seq",)):
  return Mesh(np.array(jax.devices()[:DEVICES]).reshape(shape), names)


def _sharded(f, in_specs, out_specs, mesh=None):
  return jax.shard_map(f, mesh=mesh or _mesh(), in_specs=in_specs, out_specs=out_specs)


def _outputs_and_grads(f, argnums, *args):
  """f(*args) and the gradient of a loss that weighs every output with fixed random numbers."""

  def loss(*args):
    out = f(*args)
    weights = jax.tree.map(lambda x: jnp.cos(jnp.arange(x.size).reshape(x.shape)), out)
    pairs = zip(jax.tree.leaves(weights), jax.tree.leaves(out), strict=True)
    return sum(jnp.sum(jnp.real(w * x)) for w, x in pairs), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*args)
  return out, grads


def _assert_close(actual, expected):
  actual, expected = np.asarray(actual), np.asarray(expected)
  if expected.dtype == bool:
    np.testing.assert_array_equal(actual, expected)
    return
  finite = np.abs(expected[np.isfinite(expected)])
  scale = max(1.0, float(np.max(finite, initial=0.0)))
  np.testing.assert_allclose(actual, expected, rtol=TOL, atol=TOL * scale)


def _assert_trees_close(actual, expected):
  jax.tree.map(_assert_close, actual, expected)


def _resets(rng, length, width=1):
  """Flags at a slice start, a slice end and inside a slice; several slices have none."""
  step = length // DEVICES
  reset = np.zeros((length, width), bool)
  reset[2 * step] = True  # the first step of device 2
  reset[4 * step - 1] = True  # the last step of device 3
  reset[5 * step + rng.integers(step)] = True  # somewhere in device 5
  reset[rng.integers(length), rng.integers(width)] = True
  return reset


def _decay_and_input(rng, shape, complex_):
  a = rng.uniform(0.5, 1.0, shape)
  b = rng.normal(size=shape)
  if complex_:
    a = a * np.exp(1j * rng.uniform(-np.pi, np.pi, shape))
    b = b + 1j * rng.normal(size=shape)
  return a, b


# ---------------------------------------------------------------------------------------------
# associative_scan


def _operator_case(name, rng, length):
  """(operator, elements): every built-in operator, segmented ones included."""
  x = rng.normal(size=(length, 3))
  reset = rng.uniform(size=(length, 3)) < 0.3
  reset[::DEVICES // 2] = True  # some at slice starts
  match name:
    case "add":
      return operators.add, x
    case "maximum":
      return operators.maximum, x
    case "logaddexp":
      return operators.logaddexp, x
    case "forward_fill":
      return operators.forward_fill, np.where(rng.uniform(size=x.shape) < 0.7, 0.0, x)
    case "affine":
      return operators.affine, (rng.uniform(0.5, 1.0, x.shape), x)
    case "matrix_affine":
      return operators.matrix_affine, (rng.normal(size=(length, 3, 3)) / 2, x)
    case "with_resets(affine)":
      return operators.with_resets(operators.affine), (reset, (rng.uniform(0.5, 1.0, x.shape), x))
    case "with_resets(maximum)":
      return operators.with_resets(operators.maximum), (reset[:, 0], x)
  raise ValueError(name)


OPERATORS = ["add", "maximum", "logaddexp", "forward_fill", "affine", "matrix_affine",
             "with_resets(affine)", "with_resets(maximum)"]


@pytest.mark.parametrize("name", OPERATORS)
@pytest.mark.parametrize("reverse", [False, True])
def test_every_operator_scans_across_devices_as_on_one(name, reverse):
  seed = 2 * OPERATORS.index(name) + reverse
  rng = np.random.default_rng(seed)
  length = DEVICES * [1, 2, 3][seed % 3]
  op, elems = _operator_case(name, rng, length)
  kwargs = [dict(mode="sequential"), dict(mode="parallel"), dict(mode="chunked", chunk_size=2)][
      seed // 2 % 3
  ]

  def inclusive_and_exclusive(x, axis_name=None):
    kw = dict(reverse=reverse, axis_name=axis_name, **kwargs)
    return associative_scan(op, x, **kw), associative_scan(op, x, exclusive=True, **kw)

  sharded = _sharded(functools.partial(inclusive_and_exclusive, axis_name="seq"), SEQ, SEQ)
  _assert_trees_close(jax.jit(sharded)(elems), jax.jit(inclusive_and_exclusive)(elems))


def test_scan_of_a_plain_function_across_devices_and_its_gradient():
  """A function without a known identity, differentiated through the collectives."""
  mats = np.random.default_rng(0).normal(size=(8, 2, 2)) / 2
  scan = lambda m, axis_name=None: associative_scan(jnp.matmul, m, reverse=True, axis_name=axis_name)
  sharded = _sharded(functools.partial(scan, axis_name="seq"), SEQ, SEQ)
  out, grads = _outputs_and_grads(sharded, 0, mats)
  _assert_close(out, jax.lax.associative_scan(jnp.matmul, mats, reverse=True))
  _assert_close(grads, _outputs_and_grads(scan, 0, mats)[1])


# ---------------------------------------------------------------------------------------------
# linear_recurrence


@pytest.mark.parametrize("kwargs", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("reverse", [False, True])
def test_linear_recurrence_and_gradients_across_devices_equal_one_device(kwargs, reverse):
  seed = 2 * MODES.index(kwargs) + reverse
  rng = np.random.default_rng(seed)
  length = DEVICES * [1, 2, 3, 5][seed % 4]  # T = 8 gives every device a single step
  complex_ = seed // 2 % 2 == 1
  a, b = _decay_and_input(rng, (length, 3), complex_)
  _, h0 = _decay_and_input(rng, (3,), complex_)
  reset = None if kwargs.get("inner") == "cumsum" else _resets(rng, length)

  def run(a, b, h0, reset, axis_name=None):
    return linear_recurrence(a, b, h0, reset=reset, reverse=reverse, return_final_state=True,
                             axis_name=axis_name, **kwargs)

  sharded = _sharded(functools.partial(run, axis_name="seq"), (SEQ, SEQ, P(), SEQ), (SEQ, P()))
  (h, h_final), grads = _outputs_and_grads(sharded, (0, 1, 2), a, b, h0, reset)
  expected = references.linear_recurrence(a, b, h0, reset, reverse)
  _assert_close(h, expected)
  _assert_close(h_final, expected[0 if reverse else -1])
  _assert_trees_close(grads, _outputs_and_grads(run, (0, 1, 2), a, b, h0, reset)[1])


@pytest.mark.parametrize(("mode", "reverse"), [("sequential", False), ("parallel", True)])
def test_decay_factors_across_devices(mode, reverse):
  """Per-step, per-feature and scalar factors; the time-invariant ones are replicated."""
  rng = np.random.default_rng(20 + reverse)
  d, lam, scale = rng.uniform(0.5, 1.0, (24, 3)), rng.uniform(0.5, 1.0, (3,)), np.float64(0.9)
  b, h0 = rng.normal(size=(24, 3)), rng.normal(size=3)
  reset = _resets(rng, 24, width=3)

  def run(d, lam, scale, b, h0, reset, axis_name=None):
    return linear_recurrence((d, lam, scale), b, h0, reset=reset, reverse=reverse, mode=mode,
                             axis_name=axis_name)

  specs = (SEQ, P(), P(), SEQ, P(), SEQ)
  sharded = _sharded(functools.partial(run, axis_name="seq"), specs, SEQ)
  args = (d, lam, scale, b, h0, reset)
  h, grads = _outputs_and_grads(sharded, range(5), *args)
  _assert_close(h, references.linear_recurrence(d * lam * scale, b, h0, reset, reverse))
  _assert_trees_close(grads, _outputs_and_grads(run, range(5), *args)[1])


@pytest.mark.parametrize(("mode", "reverse"), [("chunked", False), ("sequential", True)])
def test_final_state_across_devices_is_that_of_the_whole_sequence(mode, reverse):
  rng = np.random.default_rng(30 + reverse)
  a, b = _decay_and_input(rng, (16, 3), True)
  _, h0 = _decay_and_input(rng, (3,), True)
  reset = _resets(rng, 16, width=3)

  def final(a, b, h0, reset, axis_name=None):
    return linear_recurrence_final_state(a, b, h0, reset=reset, reverse=reverse, mode=mode,
                                         chunk_size=1, axis_name=axis_name)

  sharded = _sharded(functools.partial(final, axis_name="seq"), (SEQ, SEQ, P(), SEQ), P())
  h_final, grads = _outputs_and_grads(sharded, (0, 1, 2), a, b, h0, reset)
  _assert_close(h_final, references.linear_recurrence(a, b, h0, reset, reverse)[0 if reverse else -1])
  _assert_trees_close(grads, _outputs_and_grads(final, (0, 1, 2), a, b, h0, reset)[1])


# ---------------------------------------------------------------------------------------------
# Combining the devices' maps: all-gathered, or in log2(devices) rounds of ppermute


def _combined_states(a, u, cut, state, matrix, reverse):
  """The states entering each device's slice and after the last, one device after another."""
  order = range(len(u) - 1, -1, -1) if reverse else range(len(u))
  entering, s = [None] * len(u), state
  for d in order:
    entering[d] = s
    new = (a[d] @ s if matrix else a[d] * s) + u[d]
    s = np.where(cut[d][..., None, None], u[d], new)
  return np.stack(entering), s


@pytest.mark.parametrize(("devices", "matrix", "reverse"),
                         [(8, False, False), (5, False, True), (8, True, True), (6, True, False)])
def test_log_depth_combine_equals_the_all_gather_and_a_loop(devices, matrix, reverse):
  rng = np.random.default_rng(devices + 2 * matrix + reverse)
  rows, heads, dim_k, dim_v = 2, 2, 3, 2
  shape = (devices, rows, heads, dim_k)
  a = 0.6 * rng.normal(size=(*shape, dim_k)) if matrix else rng.uniform(0.5, 1.0, (*shape, 1))
  u = rng.normal(size=(*shape, dim_v))
  cut = rng.uniform(size=(devices, rows, 1)) < 0.3
  state = rng.normal(size=(*shape[1:], dim_v))
  mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))

  def run(a, u, cut, state, combine):
    entering, final = state_pass.across_devices(
        state_pass.Maps(a[0], u[0], cut[0]), state, matrix=matrix, axis_name="seq",
        reverse=reverse, combine=combine)
    return entering[None], final

  results = {}
  for combine in ("gather", "ppermute"):
    sharded = _sharded(functools.partial(run, combine=combine), (SEQ, SEQ, SEQ, P()), (SEQ, P()),
                       mesh=mesh)
    results[combine] = _outputs_and_grads(sharded, (0, 1, 3), a, u, cut, state)
  _assert_trees_close(results["ppermute"], results["gather"])
  expected = _combined_states(a, u, cut, state, matrix, reverse)
  _assert_trees_close(results["ppermute"][0], expected)


def test_scans_and_layers_take_the_log_depth_combine_past_its_mesh_size(monkeypatch):
  """With the all-gather limited to one device, the recurrences combine their devices' maps by
  ppermute: the same outputs, final states and gradients."""
  monkeypatch.setattr(state_pass, "GATHER_MAX_DEVICES", 1)
  rng = np.random.default_rng(40)
  a, b = _decay_and_input(rng, (24, 3), True)
  _, h0 = _decay_and_input(rng, (3,), True)
  reset = _resets(rng, 24)

  def run(a, b, h0, reset, axis_name=None):
    return linear_recurrence(a, b, h0, reset=reset, reverse=True, return_final_state=True,
                             axis_name=axis_name)

  sharded = _sharded(functools.partial(run, axis_name="seq"), (SEQ, SEQ, P(), SEQ), (SEQ, P()))
  _assert_trees_close(_outputs_and_grads(sharded, (0, 1, 2), a, b, h0, reset),
                      _outputs_and_grads(run, (0, 1, 2), a, b, h0, reset))

  q, k = rng.normal(size=(2, 24, 2, 3)), rng.normal(size=(2, 24, 2, 3))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v, beta = rng.normal(size=(2, 24, 2, 2)), rng.uniform(size=(2, 24, 2))
  g, state = -rng.uniform(size=(2, 24, 2)), rng.normal(size=(2, 2, 3, 2))

  def rule(q, k, v, beta, g, state, reset, axis_name=None):
    return delta_rule(q, k, v, beta, g, initial_state=state, reset=reset, mode="chunked",
                      chunk_size=2, return_final_state=True, axis_name=axis_name)

  time = P(None, "seq")
  sharded = _sharded(functools.partial(rule, axis_name="seq"), (time,) * 5 + (P(), time),
                     (time, P()))
  args = (q, k, v, beta, g, state, reset.T.repeat(2, axis=0))
  _assert_trees_close(_outputs_and_grads(sharded, tuple(range(6)), *args),
                      _outputs_and_grads(rule, tuple(range(6)), *args))


def test_sequence_and_data_parallel_on_a_two_axis_mesh():
  """Time split over 4 devices of axis "seq", the batch over 2 of axis "batch"."""
  mesh = _mesh((4, 2), ("seq", "batch"))
  rng = np.random.default_rng(40)
  a, b = _decay_and_input(rng, (12, 4, 3), False)
  h0 = rng.normal(size=(4, 3))
  reset = rng.uniform(size=(12, 4, 1)) < 0.2

  def run(a, b, h0, reset, axis_name=None):
    return linear_recurrence(a, b, h0, reset=reset, axis_name=axis_name, return_final_state=True)

  data = P("seq", "batch")
  sharded = _sharded(functools.partial(run, axis_name="seq"), (data, data, P("batch"), data),
                     (data, P("batch")), mesh=mesh)
  _assert_trees_close(jax.jit(sharded)(a, b, h0, reset), run(a, b, h0, reset))


def test_gradients_are_right_without_shard_map_vma_checks():
  """The collectives' transposes do not rely on `check_vma` to sum cotangents over devices."""
  rng = np.random.default_rng(45)
  a, b = _decay_and_input(rng, (16, 3), False)
  h0 = rng.normal(size=3)

  def run(a, b, h0, axis_name=None):
    return linear_recurrence(a, b, h0, axis_name=axis_name, return_final_state=True)

  sharded = jax.shard_map(functools.partial(run, axis_name="seq"), mesh=_mesh(),
                          in_specs=(SEQ, SEQ, P()), out_specs=(SEQ, P()), check_vma=False)
  out, grads = _outputs_and_grads(sharded, (0, 1, 2), a, b, h0)
  expected, expected_grads = _outputs_and_grads(run, (0, 1, 2), a, b, h0)
  _assert_trees_close(out, expected)
  _assert_trees_close(grads, expected_grads)


def test_nan_before_a_reset_on_another_device_does_not_leak():
  a = jnp.full((16, 2), 0.9)
  b = jnp.ones((16, 2)).at[3].set(jnp.nan)  # device 1
  reset = jnp.zeros((16, 1), bool).at[6].set(True)  # the first step of device 3
  sharded = _sharded(lambda a, b, reset: linear_recurrence(a, b, reset=reset, axis_name="seq"),
                     SEQ, SEQ)
  h, g = jax.jit(lambda b: (sharded(a, b, reset), jax.grad(
      lambda b: jnp.sum(sharded(a, b, reset)[6:]))(b)))(b)
  h = np.asarray(h)
  assert np.isnan(h[3:6]).all() and np.isfinite(h[6:]).all()
  _assert_close(h[6:], references.linear_recurrence(np.full((10, 2), 0.9), np.ones((10, 2))))
  # The gradient of the part after the reset does not touch the NaN segment either.
  assert np.isfinite(g).all() and (np.asarray(g[:6]) == 0).all()


# ---------------------------------------------------------------------------------------------
# ssmkit.rl


def _trajectory(rng, length, batch):
  rewards = rng.normal(size=(length, batch))
  discounts = 0.9 * (rng.uniform(size=(length, batch)) > 0.15)
  values = rng.normal(size=(length + 1, batch))
  lambda_ = rng.uniform(0.5, 1.0, (length, batch))
  truncated = rng.uniform(size=(length, batch)) < 0.1
  truncated[length // DEVICES - 1] = True  # at the end of device 0's slice
  final_values = rng.normal(size=(length, batch))
  return rewards, discounts, values, lambda_, truncated, final_values


def _per_device_values(values, axis=0):
  """GAE's sharded layout: each device's T_local values, then v(s_T) of the whole rollout."""
  values = np.moveaxis(values, axis, 0)
  blocks = np.split(values[:-1], DEVICES)
  return np.moveaxis(np.concatenate([np.concatenate([v, values[-1:]]) for v in blocks]), 0, axis)


def _discounted(r, d, v, lam, trunc, final, **kw):
  return rl.discounted_returns(r, d, v, truncated=trunc, final_values=final, **kw)


def _lambda(r, d, v, lam, trunc, final, **kw):
  return rl.lambda_returns(r, d, v, lam, truncated=trunc, final_values=final, **kw)


def _gae(r, d, v, lam, trunc, final, **kw):
  return rl.generalized_advantage_estimation(r, d, v, lam, truncated=trunc, final_values=final,
                                             **kw)


def _n_step(r, d, v, lam, trunc, final, **kw):
  return rl.n_step_returns(r, d, v, 4, lam, truncated=trunc, final_values=final, **kw)


# estimator, and its values from v(s_0) ... v(s_T): one device's, the sharded ones, their spec.
ESTIMATORS = {
    "discounted": (_discounted, lambda v: (v[-1], v[-1], P())),
    "discounted_per_step": (_discounted, lambda v: (v[1:], v[1:], SEQ)),
    "lambda": (_lambda, lambda v: (v[1:], v[1:], SEQ)),
    "gae": (_gae, lambda v: (v, _per_device_values(v), SEQ)),
    "n_step": (_n_step, lambda v: (v[1:], v[1:], SEQ)),  # n - 1 = 3 steps: one whole slice
}


@pytest.mark.parametrize("name", ESTIMATORS)
def test_rl_estimators_and_gradients_across_devices_equal_one_device(name):
  rng = np.random.default_rng(50)
  r, d, v, lam, trunc, final = _trajectory(rng, 24, 2)
  estimator, values = ESTIMATORS[name]
  v_one, v_sharded, v_spec = values(v)
  sharded = _sharded(functools.partial(estimator, axis_name="seq"),
                     (SEQ, SEQ, v_spec, SEQ, SEQ, SEQ), SEQ)
  out, grads = _outputs_and_grads(sharded, (0, 1), r, d, v_sharded, lam, trunc, final)
  expected, expected_grads = _outputs_and_grads(estimator, (0, 1), r, d, v_one, lam, trunc, final)
  _assert_close(out, expected)
  _assert_trees_close(grads, expected_grads)


def test_gae_across_devices_with_time_on_axis_1():
  rng = np.random.default_rng(60)
  r, d, v, lam, _, _ = (np.swapaxes(x, 0, 1) for x in _trajectory(rng, 16, 3))
  gae = lambda r, d, v, lam, axis_name=None: rl.generalized_advantage_estimation(
      r, d, v, lam, axis=1, mode="parallel", axis_name=axis_name)
  time = P(None, "seq")
  sharded = _sharded(functools.partial(gae, axis_name="seq"), time, time)
  _assert_close(jax.jit(sharded)(r, d, _per_device_values(v, axis=1), lam),
                jax.jit(gae)(r, d, v, lam))


# ---------------------------------------------------------------------------------------------
# errors


CALLS = {
    "associative_scan": lambda x, name: associative_scan(operators.add, x, axis_name=name),
    "linear_recurrence": lambda x, name: linear_recurrence(0.5, x, axis_name=name),
    "final_state": lambda x, name: linear_recurrence_final_state(0.5, x, axis_name=name),
    "discounted_returns": lambda x, name: rl.discounted_returns(x, 0.9, axis_name=name),
    "gae": lambda x, name: rl.generalized_advantage_estimation(
        x[:-1], 0.9, x, 0.9, axis_name=name),
    "n_step_returns": lambda x, name: rl.n_step_returns(x, 0.9, x, 2, axis_name=name),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_axis_name_outside_shard_map_or_unknown_is_refused(call):
  x = jnp.ones(16)
  with pytest.raises(ValueError, match="`axis_name`='seq'"):
    jax.jit(lambda x: call(x, "seq"))(x)
  with pytest.raises(ValueError, match="`axis_name`='time'"):
    _sharded(lambda x: call(x, "time"), SEQ, SEQ)(x)


def test_lru_axis_name_outside_shard_map_is_refused():
  init = lambda x: layers.LRU(d_state=2).init(jax.random.key(0), x, axis_name="seq")
  with pytest.raises(ValueError, match="`axis_name`='seq'"):
    jax.eval_shape(init, jnp.ones((8, 2)))


def test_n_step_window_longer_than_a_slice_is_refused():
  x = jnp.ones(16)
  call = lambda x: rl.n_step_returns(x, 0.9, x, 4, axis_name="seq")
  with pytest.raises(ValueError, match="`n`=4"):
    _sharded(call, SEQ, SEQ)(x)


# ---------------------------------------------------------------------------------------------
# linear_attention and delta_rule

MATRIX_MODES = ["sequential", "chunked", "parallel", "auto"]
# Every mode of linear attention, which the others build on; the delta rule in the mode that no
# layer of test_layer_sequence_parallel runs across devices, and the others chunked (the
# devices combine the same summaries whatever the mode inside a slice, and test_matrix_state
# checks each mode).
MATRIX_CASES = [("linear_attention", m) for m in MATRIX_MODES] + [("delta_rule", "parallel")] + [
    (f, "chunked") for f in ("kda", "rwkv7", "delta_product")]


def _matrix_state(function, q, k, v, g, beta, a, b, **kwargs):
  match function:
    case "linear_attention":
      return linear_attention(q, k, v, g[..., 0], **kwargs)
    case "delta_rule":
      return delta_rule(q, k, v, beta, g[..., 0], **kwargs)
    case "kda":
      return delta_rule(q, k, v, beta, g, **kwargs)
    case "rwkv7":
      return generalized_delta_rule(q, k, v, a, b, g, **kwargs)
    case "delta_product":  # two steps per token: k, v, beta and -a, b, 1 - beta
      two = lambda x, y: jnp.stack([x, y], axis=2)
      return delta_product(q, two(k, -a), two(v, b[..., :v.shape[-1]]), two(beta, 1 - beta),
                           g[..., 0], **kwargs)


@pytest.mark.parametrize("function, mode", MATRIX_CASES, ids=[f"{f}-{m}" for f, m in MATRIX_CASES])
def test_matrix_state_across_devices_equals_one_device(function, mode):
  """Initial state on device 0, resets at and inside slice edges, the final state, gradients.
  "parallel" and KDA run one batch row of 4 heads, which the chunks take as 2 rows of 2."""
  rng = np.random.default_rng(3 + MATRIX_CASES.index((function, mode)))
  batch, heads = (1, 4) if mode == "parallel" or function == "kda" else (2, 2)
  length, dim_k, dim_v = DEVICES * 9, 3, 2
  q = rng.normal(size=(batch, length, heads, dim_k))
  k = rng.normal(size=(batch, length, heads, dim_k))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.normal(size=(batch, length, heads, dim_v))
  g = -rng.uniform(0.0, 1.0, (batch, length, heads, dim_k))
  beta = rng.uniform(0.0, 1.0, (batch, length, heads))
  kappa = rng.normal(size=(batch, length, heads, dim_k))
  kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
  a, b = -kappa, kappa * rng.uniform(0.0, 1.0, kappa.shape)
  state = rng.normal(size=(batch, heads, dim_k, dim_v))
  reset = _resets(rng, length, batch).T

  def run(q, k, v, g, beta, a, b, state, reset, axis_name=None):
    return _matrix_state(function, q, k, v, g, beta, a, b, initial_state=state, reset=reset,
                         mode=mode, chunk_size=4, return_final_state=True, axis_name=axis_name)

  time = P(None, "seq")
  sharded = _sharded(functools.partial(run, axis_name="seq"), (time,) * 7 + (P(), time),
                     (time, P()))
  argnums = tuple(range(8))
  out, grads = _outputs_and_grads(sharded, argnums, q, k, v, g, beta, a, b, state, reset)
  expected, expected_grads = _outputs_and_grads(run, argnums, q, k, v, g, beta, a, b, state, reset)
  _assert_trees_close(out, expected)
  _assert_trees_close(grads, expected_grads)


def test_mamba3_angles_over_several_blocks_per_device_equal_one_device():
  """Mamba-3's rotation angles are summed in blocks of 64 steps and carried between blocks and
  devices: slices of 130 steps (two whole blocks and part of a third), resets at and inside
  slice edges, the final state and every gradient."""
  rng = np.random.default_rng(11)
  batch, length, heads, n, p, angles = 2, DEVICES * 130, 2, 4, 2, 2
  q, k = (rng.normal(size=(batch, length, heads, n)) for _ in range(2))
  v = rng.normal(size=(batch, length, heads, p))
  dt = rng.uniform(0.05, 1.0, (batch, length, heads))
  log_decay = -rng.uniform(0.5, 2.0, dt.shape) * dt
  trapezoid = rng.uniform(0.0, 1.0, dt.shape)
  rate = dt[..., None] * np.pi * np.tanh(rng.normal(size=(*dt.shape, angles)))
  state = Mamba3State(*(rng.normal(size=shape) for shape in (
      (batch, heads, n, p), (batch, heads, angles), (batch, heads, n), (batch, heads, p))))
  reset = _resets(rng, length, batch).T

  def run(q, k, v, log_decay, dt, trapezoid, rate, state, reset, axis_name=None):
    return mamba3(q, k, v, log_decay, dt, trapezoid, rate, initial_state=state, reset=reset,
                  mode="chunked", chunk_size=8, return_final_state=True, axis_name=axis_name)

  time = P(None, "seq")
  sharded = _sharded(functools.partial(run, axis_name="seq"), (time,) * 7 + (P(), time),
                     (time, P()))
  args = (q, k, v, log_decay, dt, trapezoid, rate, state, reset)
  out, grads = _outputs_and_grads(sharded, tuple(range(8)), *args)
  expected, expected_grads = _outputs_and_grads(run, tuple(range(8)), *args)
  _assert_trees_close(out, expected)
  _assert_trees_close(grads, expected_grads)


@pytest.mark.parametrize("delta", [False, True], ids=["linear_attention", "delta_rule"])
def test_matrix_state_nan_initial_state_before_a_reset_reaches_no_other_device(delta):
  """Device 0 holds the initial state and a reset after it: an Inf there is zeroed before any
  product, so no other device's gradient meets it as 0 * Inf."""
  rng = np.random.default_rng(30)
  length, heads, dim = DEVICES * 4, 2, 3
  q, k, v = (rng.normal(size=(length, heads, dim)) for _ in range(3))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  g = -rng.uniform(0.0, 1.0, (length, heads))
  beta = rng.uniform(0.0, 1.0, (length, heads))
  state = np.zeros((heads, dim, dim))
  state[0, 1, 2] = np.inf
  reset = np.zeros(length, bool)
  reset[2] = True

  def loss(q, k, v, g, beta, state, reset, axis_name=None):
    kwargs = dict(initial_state=state, reset=reset, mode="chunked", chunk_size=2,
                  axis_name=axis_name)
    out = delta_rule(q, k, v, beta, g, **kwargs) if delta else linear_attention(q, k, v, g, **kwargs)
    step = jnp.arange(out.shape[0])
    if axis_name is not None:
      step = step + out.shape[0] * jax.lax.axis_index(axis_name)
    total = jnp.sum(jnp.where((step >= 2)[:, None, None], jnp.sin(out), 0))
    return total if axis_name is None else jax.lax.psum(total, axis_name)

  sharded = _sharded(functools.partial(loss, axis_name="seq"), (SEQ,) * 5 + (P(), SEQ), P())
  argnums = (0, 1, 2, 3, 4)
  grads = jax.jit(jax.grad(sharded, argnums))(q, k, v, g, beta, state, reset)
  expected = jax.jit(jax.grad(loss, argnums))(q, k, v, g, beta, state, reset)
  for got, want in zip(grads, expected, strict=True):
    assert np.all(np.isfinite(np.asarray(got)[2:]))
    _assert_close(np.asarray(got)[2:], np.asarray(want)[2:])
