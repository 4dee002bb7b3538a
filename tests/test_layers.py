"""`ssmkit.layers`: one contract every layer meets, then each layer against its paper."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
import scipy.linalg
from flax import nnx

import compiled
import registered
from ssmkit import layers
from ssmkit._src import hippo
from ssmkit._src.layers.registry import LAYERS as REGISTRY
from ssmkit.scan import Mode

# Every layer of the registry in each of its test configurations, small enough for fast tests.
LAYERS = registered.linen_cases()
MODES = ["sequential", "parallel", "chunked", "auto"]


# Inputs and checks in NumPy: a jax.numpy call outside the functions under test compiles a
# program of its own for every shape.


def _x(shape, seed=0, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _resets(shape, seed=1):
  return np.random.default_rng(seed).uniform(size=shape) < 0.2


def _set(x, index, value):
  """A copy of `x` with `x[index] = value`."""
  x = np.array(x)
  x[index] = value
  return x


def _stepped(layer, params, x, reset=None):
  """The layer's step method over time (axis -2), from the zero state."""
  step = compiled.run(layer, method="step")
  state = layer.initialize_state(x[..., 0, :].shape)
  ys = []
  for t in range(x.shape[-2]):
    r_t = None if reset is None else reset[..., t]
    state, y_t = step(params, state, x[..., t, :], r_t)
    ys.append(np.asarray(y_t))
  return np.stack(ys, axis=-2)


def _assert_close(actual, expected, rtol=1e-5):
  scale = float(np.max(np.abs(np.asarray(expected, np.float64))))
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=rtol * scale)


@pytest.fixture(params=list(LAYERS))
def any_layer(request):
  """Every layer and configuration variant: for the numerical contract."""
  return LAYERS[request.param]()


@pytest.fixture(params=registered.names())
def layer(request):
  """One configuration per layer: for the contract's structural parts."""
  return LAYERS[request.param]()


# `layer` for one layer of each kind of state, where flax runs every layer the same way.
one_of_each = pytest.mark.parametrize("layer", registered.ONE_OF_EACH_STATE, indirect=True)


# The contract runs every layer on inputs of one shape (the shape is not what it tests), each
# computation compiled once and shared by the tests that run it.
SHAPE = (2, 13, 4)
X = _x(SHAPE)
RESET = _resets(SHAPE[:2])


def _params(layer):
  return registered.drawn_where_zero(compiled.init(layer, SHAPE))


@pytest.mark.parametrize("with_reset", [False, True])
def test_sequence_equals_step_by_step(any_layer, with_reset):
  layer = any_layer
  reset = RESET if with_reset else None
  params = _params(layer)
  _assert_close(compiled.run(layer)(params, X, reset), _stepped(layer, params, X, reset))


def test_every_mode_agrees(any_layer):
  layer = any_layer
  params = _params(layer)
  reference = compiled.run(layer, mode="sequential")(params, X, RESET)
  for mode in MODES[1:]:
    _assert_close(compiled.run(layer, mode=mode)(params, X, RESET), reference)


def test_reset_cuts_information_flow(layer):
  """In every mode, the outputs from a reset on are the same to the last bit whatever the inputs
  before it (the reset inside a chunk of the chunked layers; the programs of
  `test_every_mode_agrees`)."""
  reset = _set(np.zeros(SHAPE[:2], bool), (slice(None), 6), True)
  params = _params(layer)
  changed = _set(X, (slice(None), slice(None, 6)), _x((2, 6, 4), seed=5))
  for mode in MODES:
    run = compiled.run(layer, mode=mode)
    y, y_changed = run(params, X, reset), run(params, changed, reset)
    np.testing.assert_array_equal(y[:, 6:], y_changed[:, 6:], err_msg=mode)
    assert not np.allclose(y[:, :6], y_changed[:, :6])
  # Without the reset the change does reach the later steps, but for a layer without state.
  run = compiled.run(layer)
  reaches = not np.allclose(run(params, X, None)[:, 6:], run(params, changed, None)[:, 6:])
  assert reaches == bool(jax.tree.leaves(layer.initialize_state((2, 4))))


def test_sequence_continues_from_a_state_and_returns_the_last(any_layer):
  """Steps 0..5 one at a time, then 6..12 as a sequence from that state, equal all 13 stepped."""
  layer = any_layer
  params = _params(layer)
  step = compiled.run(layer, method="step")
  state, stepped = layer.initialize_state((2, 4)), []
  for t in range(13):
    if t == 6:
      middle = state
    state, y_t = step(params, state, X[:, t], RESET[:, t])
    stepped.append(y_t)
  y, last = compiled.run(layer, mode="parallel", return_state=True)(params, X[:, 6:], RESET[:, 6:],
                                                            initial_state=middle)
  _assert_close(y, np.stack(stepped[6:], axis=1))
  for got, want in zip(jax.tree.leaves(last), jax.tree.leaves(state), strict=True):
    _assert_close(got, want)


def _wrong_state(layer):
  """A state of 3 sequences for inputs of 2; for a layer without state (`()`), an array."""
  state = layer.initialize_state((3, 4))
  return state if jax.tree.leaves(state) else jnp.zeros(3)


def test_a_state_of_the_wrong_shape_is_refused(layer):
  params = _params(layer)
  with pytest.raises(ValueError, match="initial_state"):
    layer.apply(params, X, initial_state=_wrong_state(layer))
  with pytest.raises(ValueError, match="`state`"):
    layer.apply(params, _wrong_state(layer), X[:, 0], method="step")


def test_jit_vmap_and_shapes(layer):
  params = _params(layer)
  y = layer.apply(params, X)  # eagerly, without jit
  assert y.shape == X.shape and y.dtype == X.dtype
  _assert_close(compiled.run(layer)(params, X, None), y)
  _assert_close(jax.jit(jax.vmap(layer.apply, in_axes=(None, 0)))(params, X), y)
  assert jax.eval_shape(layer.apply, params, X[0]).shape == SHAPE[1:]  # no batch axis


def _equations(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs inside it (jit, scan, custom rules)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for inner in value if isinstance(value, tuple | list) else (value,):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          yield from _equations(inner)


# The layers whose projections (outside the recurrence's own matrices) run in bfloat16 for
# bfloat16 inputs; the LRU's, S4D's and S5's matrices are their recurrences' B and C.
PROJECTING = frozenset({"FeedForward", "Mamba", "Mamba2", "Mamba3", "GatedDeltaNet",
                        "KimiDeltaAttention", "GatedDeltaProduct", "RWKV7", "RGLRU", "MinGRU",
                        "Attention", "ShortConv", "Parallel", "LatentAttention"})


def test_bfloat16_inputs_keep_their_dtype_and_project_in_bfloat16(layer):
  params = _params(layer)
  run = compiled.run(layer)
  y = run(params, X.astype(jnp.bfloat16), None)
  assert y.dtype == jnp.bfloat16
  # In norm, not elementwise: a head whose output is near zero before its RMSNorm turns the
  # rounding of bfloat16 projections into a large change of that step (KDA's step [1, 9] moves
  # as much under a 2^-9 perturbation of its float32 weights).
  expected = np.asarray(run(params, X.astype(jnp.bfloat16).astype(jnp.float32), None))
  error = np.linalg.norm(np.asarray(y, np.float32) - expected) / np.linalg.norm(expected)
  assert error < 2e-2, error
  products = lambda x: [eqn for eqn in _equations(jax.make_jaxpr(layer.apply)(params, x).jaxpr)
                        if eqn.primitive.name == "dot_general"]
  narrow = [eqn for eqn in products(X.astype(jnp.bfloat16))
            if all(v.aval.dtype == jnp.bfloat16 for v in eqn.invars)]
  # bfloat16 products sum in float32.
  assert all(eqn.outvars[0].aval.dtype == jnp.float32 for eqn in narrow)
  assert bool(narrow) == (type(layer).__name__ in PROJECTING)
  assert all(v.aval.dtype != jnp.bfloat16 for eqn in products(X) for v in eqn.invars)


def _after_a_reset(params, x, reset, state, *, layer):
  """Every mode's outputs from `state`, and gradients of those from step 6 on with respect to
  `x`."""
  results = []
  for mode in ("sequential", "chunked", "parallel"):
    run = lambda x, state, mode=mode: layer.apply(params, x, reset, mode=mode, initial_state=state)
    loss = lambda x, state, run=run: jnp.sum(jnp.sin(run(x, state)[:, 6:]))
    results.append((run(x, state), jax.grad(loss)(x, state)))
  return results


def _poisoned_state(layer):
  """The zero state with every float entry NaN (None for a bidirectional layer: it has none)."""
  if getattr(layer, "bidirectional", False):
    return None
  return jax.tree.map(lambda s: np.full(s.shape, np.nan, s.dtype) if jnp.issubdtype(
      s.dtype, jnp.inexact) else np.asarray(s), layer.initialize_state((2, 4)))


def test_nan_before_a_reset_reaches_no_output_or_gradient_after_it(layer):
  """A NaN input at step 2, or a NaN state to start from, and a reset at step 6: every mode's
  outputs and input gradients from step 6 on are finite. A NaN input passes eagerly as under
  jit, no error: the layer's decays, computed from it, are not checked as values."""
  params = _params(layer)
  reset = _set(np.zeros(SHAPE[:2], bool), (slice(None), 6), True)
  clean = None if getattr(layer, "bidirectional", False) else layer.initialize_state((2, 4))
  for x, state in ((_set(X, (slice(None), 2), np.nan), clean), (X, _poisoned_state(layer))):
    if state is None and x is X:
      continue
    expected = compiled.run(layer)(params, x, reset, initial_state=state)
    if x is not X:
      np.testing.assert_allclose(layer.apply(params, x, reset, initial_state=state), expected,
                                 rtol=1e-5, atol=1e-6)
    for y, dx in compiled.compiled(_after_a_reset, layer=layer)(params, x, reset, state):
      assert np.all(np.isfinite(y[:, 6:])) and np.all(np.isfinite(dx[:, 6:]))
      _assert_close(y[:, 6:], expected[:, 6:])


def test_inputs_that_saturate_every_gate_and_decay_stay_finite(layer):
  """Inputs of magnitude 1000 drive step sizes, gates and data-dependent decays to their
  extremes (decays of exp(-1000) and below): every mode's outputs and input gradients stay
  finite, and the modes agree to 1e-4 of the largest output (Mamba-3, turned by thousands of
  radians: 4.8e-5)."""
  params = _params(layer)
  reset = _set(np.zeros(SHAPE[:2], bool), (slice(None), 6), True)
  start = None if getattr(layer, "bidirectional", False) else layer.initialize_state((2, 4))
  results = compiled.compiled(_after_a_reset, layer=layer)(params, 1000 * X, reset, start)
  for y, dx in results:
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))
    _assert_close(y, results[0][0], rtol=1e-4)


def test_bfloat16_parameters_compute_as_their_float32_values(layer):
  """`param_dtype=bfloat16` keeps the parameters in bfloat16 (complex ones form in float32)."""
  low = layer.clone(param_dtype=jnp.bfloat16)
  params = compiled.init(low, SHAPE)
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
  y = compiled.run(low)(params, X, RESET)
  assert y.dtype == X.dtype and np.all(np.isfinite(y))
  as_float32 = jax.tree.map(lambda p: np.asarray(p, np.float32), params)
  _assert_close(y, compiled.run(layer)(as_float32, X, RESET), rtol=2e-2)


@pytest.mark.parametrize("length", [0, 1])
def test_lengths_zero_and_one(layer, length):
  params = _params(layer)
  x = X[:, :length]
  y = compiled.run(layer)(params, x, RESET[:, :length])
  assert y.shape == x.shape
  if length:
    _assert_close(y, compiled.run(layer)(params, X, RESET)[:, :1])
  if getattr(layer, "bidirectional", False):
    return
  start = layer.initialize_state((2, 4))
  _, state = compiled.run(layer, return_state=True)(params, x, None, initial_state=start)
  if length == 0:  # nothing happened: the state is the one given
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(start), strict=True):
      np.testing.assert_array_equal(got, want)


def _squared_output_gradients(params, x, *, layer):
  def loss(p, x):  # every parameter in use
    return jnp.sum(registered.as_later_layer(layer, functools.partial(layer.apply, p), x) ** 2)

  return jax.grad(loss, argnums=(0, 1))(params, x)


def test_gradients_are_finite(layer):
  grads = compiled.compiled(_squared_output_gradients, layer=layer)(_params(layer), X)
  for g in jax.tree.leaves(grads):
    assert np.all(np.isfinite(g)) and np.any(g != 0)


def test_forward_mode_matches_finite_differences(layer):
  """The layer's own maths in forward mode, in the chunked mode (the scans' forward mode is
  tested per mode in their own tests); jacfwd (a vmapped jvp) equals jacrev."""
  # In float64 (parameters cast after init), so central differences resolve the tangents.
  x = _x((2, 9, 4), dtype=jnp.float64)
  reset = _resets((2, 9))
  params = jax.tree.map(lambda p: np.asarray(p, np.float64), _params(layer))
  f = jax.jit(lambda p, x: layer.apply(p, x, reset, mode="chunked"))
  jax.test_util.check_grads(f, (params, x), order=1, modes=["fwd"], eps=1e-6)
  jac = lambda d: jax.jit(d(lambda x: f(params, x)))(x)
  np.testing.assert_allclose(jac(jax.jacfwd), jac(jax.jacrev), rtol=1e-10, atol=1e-12)


class _StepCell(nn.Module):
  """A layer's step as a linen cell, `(state, x_t) -> (state, y_t)`."""

  layer: nn.Module

  def __call__(self, state, x_t):
    return self.layer.step(state, x_t)


@one_of_each
def test_inside_nn_scan(layer):
  scanned = nn.scan(_StepCell, variable_broadcast="params", split_rngs={"params": False},
                    in_axes=1, out_axes=1)(layer=layer)
  state = layer.initialize_state((2, 4))
  variables = jax.jit(scanned.init)(jax.random.key(0), state, X)
  _, y = jax.jit(scanned.apply)(variables, state, X)
  _assert_close(y, compiled.run(layer)({"params": variables["params"]["layer"]}, X, None))


@one_of_each
def test_from_nnx_through_the_bridge(layer):
  model = nnx.bridge.ToNNX(layer, rngs=nnx.Rngs(0))
  nnx.bridge.lazy_init(model, X)
  params = {name: value[...] for name, value in vars(model).items() if isinstance(value, nnx.Param)}
  _assert_close(model(X), compiled.run(layer)({"params": params}, X, None))


def test_bad_input_names_the_argument(layer):
  params = _params(layer)
  with pytest.raises(ValueError, match="`reset`"):
    layer.apply(params, X, jnp.zeros((2, 12), bool))
  with pytest.raises(TypeError, match="`reset`"):
    layer.apply(params, X, jnp.zeros((2, 13)))
  with pytest.raises(ValueError, match="`x`"):
    layer.apply(params, X[0, 0])


def _lru_reference(params, x, reset=None):
  """The paper's recurrence in float64 NumPy, from the parameters."""
  p = {k: np.asarray(v, np.float64) for k, v in params["params"].items()}
  lam = np.exp(-np.exp(p["nu_log"]) + 1j * np.exp(p["theta_log"]))
  b = (p["B_re"] + 1j * p["B_im"]) * np.exp(p["gamma_log"])[:, None]
  c = p["C_re"] + 1j * p["C_im"]
  x = np.asarray(x, np.float64)
  h = np.zeros(lam.shape, complex)
  ys = []
  for t in range(x.shape[0]):
    if reset is not None and reset[t]:
      h = np.zeros_like(h)
    h = lam * h + b @ x[t]
    ys.append((c @ h).real + p["D"] * x[t])
  return np.stack(ys)


def test_lru_matches_float64_reference():
  layer = layers.LRU(d_state=5)
  x = _x((31, 3))
  reset = np.asarray(_resets((31,)))
  params = compiled.init(layer, x.shape, 2)
  _assert_close(compiled.run(layer)(params, x, reset), _lru_reference(params, x, reset))


def test_lru_initialisation_follows_the_paper():
  layer = layers.LRU(d_state=512, r_min=0.4, r_max=0.9, max_phase=np.pi / 4)
  params = layer.init(jax.random.key(3), _x((1, 8)))["params"]
  lam = np.exp(-np.exp(np.asarray(params["nu_log"], np.float64))
               + 1j * np.exp(np.asarray(params["theta_log"], np.float64)))
  radius, phase = np.abs(lam), np.angle(lam) % (2 * np.pi)
  assert radius.min() >= 0.4 - 1e-6 and radius.max() <= 0.9 + 1e-6
  assert phase.min() >= 0 and phase.max() <= np.pi / 4 + 1e-6
  # Uniform on the ring: r^2 is uniform in [r_min^2, r_max^2], so its mean is the midpoint.
  assert np.mean(radius**2) == pytest.approx((0.4**2 + 0.9**2) / 2, abs=0.03)
  np.testing.assert_allclose(np.exp(params["gamma_log"]), np.sqrt(1 - radius**2), rtol=1e-5)
  # B ~ N(0, 1 / (2 H)) per part, C ~ N(0, 1 / N) per part, D ~ N(0, 1).
  assert np.std(params["B_re"]) == pytest.approx(1 / np.sqrt(2 * 8), rel=0.1)
  assert np.std(params["C_im"]) == pytest.approx(1 / np.sqrt(512), rel=0.1)


def test_lru_rejects_a_ring_outside_the_unit_disk():
  with pytest.raises(ValueError, match="r_max"):
    layers.LRU(r_min=0.5, r_max=1.0).init(jax.random.key(0), _x((4, 2)))


def _s4d_kernel_reference(params, length):
  """K[l, h] = 2 Re sum_n C B_bar A_bar^l in float64, A_bar^l by repeated products."""
  p = {k: np.asarray(v, np.float64) for k, v in params["params"].items()}
  a = -np.exp(p["log_a_real"]) + 1j * p["a_imag"]
  dt = np.exp(p["log_dt"])[:, None]
  a_bar = np.exp(dt * a)
  b_bar = (a_bar - 1) / a * (p["B_re"] + 1j * p["B_im"])
  c = p["C_re"][0] + 1j * p["C_im"][0]
  power, kernel = np.ones_like(a_bar), []
  for _ in range(length):
    kernel.append(2 * np.sum(c * b_bar * power, axis=-1).real)
    power = power * a_bar
  return np.stack(kernel)


def test_s4d_kernel_matches_direct_evaluation():
  layer = layers.S4D(d_state=8)
  x = _x((40, 3))
  params = compiled.init(layer, x.shape, 4)
  kernel = layer.apply(params, 40, 3, method="kernel")
  _assert_close(kernel[0], _s4d_kernel_reference(params, 40))
  # The convolution mode is the causal convolution with that kernel, plus D u.
  direct = np.stack([
      sum(np.asarray(kernel[0, lag]) * np.asarray(x[t - lag]) for lag in range(t + 1)) for t in range(40)
  ]) + np.asarray(params["params"]["D"]) * np.asarray(x)
  _assert_close(compiled.run(layer, mode="convolution")(params, x), direct)


@pytest.mark.parametrize("discretization", ["zoh", "bilinear"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_s4d_convolution_equals_recurrence(discretization, bidirectional):
  layer = layers.S4D(d_state=8, discretization=discretization, bidirectional=bidirectional)
  x = _x((2, 29, 3))
  params = compiled.init(layer, x.shape, 5)
  convolution = compiled.run(layer, mode="convolution")(params, x)
  assert np.asarray(compiled.run(layer)(params, x) == convolution).all()  # auto convolves
  for mode in ["sequential", "parallel", "chunked"]:
    _assert_close(compiled.run(layer, mode=mode)(params, x), convolution)


@pytest.mark.parametrize("bidirectional_layer", [
    lambda: layers.S4D(d_state=8, bidirectional=True),
    lambda: layers.S5(d_state=8, bidirectional=True),
], ids=["S4D", "S5"])
def test_bidirectional_layers_keep_episodes_apart(bidirectional_layer):
  layer = bidirectional_layer()
  x = _x((1, 20, 3))
  reset = _set(np.zeros((1, 20), bool), (0, 9), True)
  params = compiled.init(layer, x.shape, 6)
  run = compiled.run(layer)
  y = run(params, x, reset)
  past_zero = _set(x, (slice(None), slice(None, 9)), 0.0)
  future_zero = _set(x, (slice(None), slice(9, None)), 0.0)
  before = run(params, past_zero, reset)
  after = run(params, future_zero, reset)
  np.testing.assert_array_equal(y[:, 9:], before[:, 9:])
  np.testing.assert_array_equal(y[:, :9], after[:, :9])
  # Without the reset the future does reach the past.
  assert not np.allclose(run(params, x, None)[:, :9], run(params, future_zero, None)[:, :9])
  with pytest.raises(ValueError, match="no step mode"):
    layer.apply(params, layer.initialize_state((1, 3)), x[:, 0], method="step")


@pytest.mark.parametrize("a_init", ["legs", "lin"])
def test_s4d_initialisation(a_init):
  params = layers.S4D(d_state=16, a_init=a_init, dt_min=0.01, dt_max=0.2).init(
      jax.random.key(7), _x((5, 64)))["params"]
  a = -np.exp(params["log_a_real"]) + 1j * np.asarray(params["a_imag"])
  b = np.asarray(params["B_re"]) + 1j * np.asarray(params["B_im"])
  if a_init == "lin":
    expected_a, expected_b = -0.5 + 1j * np.pi * np.arange(8), np.ones(8)
  else:
    expected_a, expected_b = hippo.s4d_legs(8)
  np.testing.assert_allclose(a, np.broadcast_to(expected_a, (64, 8)), rtol=1e-5)
  np.testing.assert_allclose(b, np.broadcast_to(expected_b, (64, 8)), rtol=1e-5, atol=1e-6)
  dt = np.exp(params["log_dt"])
  assert dt.min() >= 0.01 * (1 - 1e-5) and dt.max() <= 0.2 * (1 + 1e-5)


def test_s4d_rejects_bad_configuration():
  x = _x((4, 2))
  with pytest.raises(ValueError, match="`d_state`"):
    layers.S4D(d_state=5).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="`a_init`"):
    layers.S4D(a_init="inv").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="`discretization`"):
    layers.S4D(discretization="euler").init(jax.random.key(0), x)
  params = layers.S4D(d_state=4).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="cannot take `reset`"):
    layers.S4D(d_state=4).apply(params, x, jnp.zeros(4, bool), mode="convolution")


def test_s4d_auto_as_enum_or_string_takes_the_same_path():
  layer = layers.S4D(d_state=4)
  x = _x((2, 9, 4))
  params = layer.init(jax.random.key(0), x)
  convolved = layer.apply(params, x, mode="convolution")
  # Bit for bit: both convolve (the recurrence rounds differently).
  np.testing.assert_array_equal(layer.apply(params, x, mode=Mode.AUTO), convolved)
  np.testing.assert_array_equal(layer.apply(params, x, mode="auto"), convolved)


def _state_size_option(layer: type) -> str:
  """The option that sizes a layer's state: `d_state`, attention's `cache_size` or RWKV-7's
  `head_dim`; a feed-forward layer's hidden `width`; a short convolution's taps; a parallel
  layer's branches' (its first branch's `d_state`)."""
  fields = {f.name for f in dataclasses.fields(layer)}
  return next(name for name in ("d_state", "cache_size", "head_dim", "width", "d_conv", "layers")
              if name in fields)


def _sized(factory: type, size: object) -> tuple[nn.Module, str]:
  """`(layer, option)`: the layer with its state sized by `size`, and the option named."""
  option = _state_size_option(factory)
  if option == "layers":
    return factory(layers=(functools.partial(layers.Mamba2, d_state=size),)), "d_state"
  return factory(**{option: size}), option


@pytest.mark.parametrize("factory", [entry.layer for entry in REGISTRY.values()], ids=list(REGISTRY))
@pytest.mark.parametrize("size", [0, -2, 2.5])
def test_state_size_that_is_not_a_positive_int_is_refused(factory, size):
  layer, option = _sized(factory, size)
  with pytest.raises(ValueError, match=f"`{option}` must be a positive int"):
    layer.init(jax.random.key(0), _x((2, 5, 4)))


@pytest.mark.parametrize(("options", "match"), [
    (dict(d_conv=0), "`d_conv` must be a positive int"),
    (dict(d_conv=-1), "`d_conv` must be a positive int"),
    (dict(expand=0), "`expand` must be a positive int"),
    (dict(expand=1.5), "`expand` must be a positive int"),
    (dict(dt_rank=0), "`dt_rank` must be a positive int"),
    (dict(dt_min=0.0), "dt_min"),
    (dict(dt_min=0.2, dt_max=0.1), "dt_min"),
])
def test_mamba_options_out_of_range_are_named(options, match):
  with pytest.raises(ValueError, match=match):
    layers.Mamba(**options).init(jax.random.key(0), _x((2, 5, 4)))


def _s5_reference(layer, params, x, reset=None):
  """x_t = Lambda_bar x_{t-1} + B_bar u_t, y_t = (2) Re(C x_t) + D u_t in float64 (ZOH)."""
  p = {k: np.asarray(v, np.float64) for k, v in params["params"].items()}
  lam = p["Lambda_re"] + 1j * p["Lambda_im"]
  dt = np.exp(p["log_dt"])
  lam_bar = np.exp(lam * dt)
  b_bar = ((lam_bar - 1) / lam)[:, None] * (p["B"][0] + 1j * p["B"][1])
  c = p["C"][0, 0] + 1j * p["C"][1, 0]
  h = np.zeros(lam.shape, complex)
  ys = []
  for t in range(x.shape[0]):
    if reset is not None and reset[t]:
      h = np.zeros_like(h)
    h = lam_bar * h + b_bar @ np.asarray(x[t], np.float64)
    ys.append((2 if layer.conj_sym else 1) * (c @ h).real + p["D"] * np.asarray(x[t]))
  return np.stack(ys)


@pytest.mark.parametrize("conj_sym", [True, False])
def test_s5_matches_float64_reference(conj_sym):
  layer = layers.S5(d_state=8, blocks=2, conj_sym=conj_sym)
  x, reset = _x((25, 3)), np.asarray(_resets((25,)))
  params = compiled.init(layer, x.shape, 8)
  _assert_close(compiled.run(layer)(params, x, reset), _s5_reference(layer, params, x, reset))


def test_s5_initialisation_is_hippo_n_in_its_eigenbasis():
  layer = layers.S5(d_state=16, blocks=2, conj_sym=False)
  params = layer.init(jax.random.key(9), _x((4, 5)))["params"]
  eigenvalues, v, _ = hippo.legs_normal_diagonalized(8)
  lam = np.asarray(params["Lambda_re"]) + 1j * np.asarray(params["Lambda_im"])
  np.testing.assert_allclose(lam, np.tile(eigenvalues, 2), rtol=1e-5, atol=1e-6)
  # B was drawn real in the original basis: V B_tilde is real again.
  b = np.asarray(params["B"][0], np.float64) + 1j * np.asarray(params["B"][1], np.float64)
  original = scipy.linalg.block_diag(v, v) @ b
  assert np.max(np.abs(original.imag)) < 1e-5 * np.max(np.abs(original.real))
  half = layers.S5(d_state=16, blocks=2).init(jax.random.key(9), _x((4, 5)))["params"]
  assert half["Lambda_re"].shape == (8,)  # one of each conjugate pair


def test_s5_rejects_bad_blocks():
  with pytest.raises(ValueError, match="`blocks`"):
    layers.S5(d_state=8, blocks=3).init(jax.random.key(0), _x((4, 2)))
  with pytest.raises(ValueError, match="`blocks`"):
    layers.S5(d_state=6, blocks=2).init(jax.random.key(0), _x((4, 2)))


def _mamba_reference(params, x, reset, d_conv, selective_norm_eps=None):
  """The Mamba block one step at a time in float64 NumPy, from the parameters."""
  p = {k: np.asarray(v, np.float64) for k, v in params["params"].items()}
  x = np.asarray(x, np.float64)
  inner, n = p["A_log"].shape
  rank = p["dt_proj"].shape[0]
  a = -np.exp(p["A_log"])
  window = np.zeros((d_conv, inner))
  h = np.zeros((inner, n))
  softplus = lambda v: np.log1p(np.exp(v))
  silu = lambda v: v / (1 + np.exp(-v))
  ys = []
  for t in range(x.shape[0]):
    if reset[t]:
      window, h = np.zeros_like(window), np.zeros_like(h)
    v, z = np.split(x[t] @ p["in_proj"] + p.get("in_proj_bias", 0), 2)
    window = np.concatenate([window[1:], v[None]])
    u = silu(np.sum(window * p["conv_kernel"], axis=0) + p["conv_bias"])
    dbc = u @ p["x_proj"]
    step_rank, b, c = dbc[:rank], dbc[rank : rank + n], dbc[rank + n :]
    if selective_norm_eps is not None:  # Falcon-Mamba's weightless RMSNorms
      norm = lambda v: v / np.sqrt(np.mean(v**2) + selective_norm_eps)
      step_rank, b, c = norm(step_rank), norm(b), norm(c)
    dt = softplus(step_rank @ p["dt_proj"] + p["dt_bias"])
    h = np.exp(dt[:, None] * a) * h + (dt * u)[:, None] * b[None, :]
    ys.append(((h @ c + p["D"] * u) * silu(z)) @ p["out_proj"] + p.get("out_proj_bias", 0))
  return np.stack(ys)


@pytest.mark.parametrize(("use_bias", "selective_norm_eps"), [(False, None), (True, 0.1)])
def test_mamba_matches_float64_loop(use_bias, selective_norm_eps):
  layer = layers.Mamba(d_state=5, d_conv=4, use_bias=use_bias, selective_norm_eps=selective_norm_eps)
  x, reset = _x((23, 6)), np.asarray(_resets((23,)))
  params = compiled.init(layer, x.shape, 11)
  if use_bias:  # biases that are not zero, so that the test sees them
    params = {"params": {**params["params"], "in_proj_bias": _x((24,)), "out_proj_bias": _x((6,))}}
  expected = _mamba_reference(params, x, reset, 4, selective_norm_eps)
  _assert_close(compiled.run(layer)(params, x, reset), expected)
  _assert_close(_stepped(layer, params, x, reset), expected)


def test_mamba_initialisation_follows_the_paper():
  params = layers.Mamba(d_state=16, dt_min=0.002, dt_max=0.05).init(
      jax.random.key(12), _x((4, 32)))["params"]
  np.testing.assert_allclose(np.exp(params["A_log"]), np.broadcast_to(np.arange(1, 17), (64, 16)),
                             rtol=1e-6)
  dt = np.asarray(jax.nn.softplus(params["dt_bias"]))
  assert dt.min() >= 0.002 * (1 - 1e-4) and dt.max() <= 0.05 * (1 + 1e-4)
  assert params["dt_proj"].shape == (2, 64)  # rank ceil(32 / 16)
  np.testing.assert_array_equal(params["D"], np.ones(64))
