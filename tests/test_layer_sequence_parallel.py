"""Every registered layer with its time axis split over 8 host devices (models over 4 and 8)
equals the layer on one device: outputs, final state and the gradients to the parameters, the
inputs and the initial state, with documents that cross device boundaries.

In float64 to 1e-9 (relative to the largest magnitude): sharding only moves and reassociates
the same operations.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import compiled
import registered
import ssmkit.nnx as snx
from ssmkit import layers
from ssmkit._src.layers.convolution import causal_conv
from ssmkit._src.layers.model import pool

pytestmark = pytest.mark.usefixtures("host_devices")

TOL = 1e-9
TIME = P(None, "seq")
LENGTH = 24  # slices of 3 steps (6 for the models)
# Every layer over 8 devices, slices of 3 steps: shorter than the chunks and than some
# convolution windows, the hardest split. The modes take turns over the cases. The models below
# split over 4 and 8 devices, test_sequence_parallel's functions over 4 to 8.
DEVICES = 8
MODES = ("sequential", "auto", "chunked")


def _mesh(devices: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:devices]), ("seq",))


def _random_like(tree, rng):
  """A pytree like `tree` with random entries of each leaf's dtype."""

  def draw(leaf):
    leaf = np.asarray(leaf)
    if leaf.dtype == bool:
      return rng.uniform(size=leaf.shape) < 0.7
    if np.issubdtype(leaf.dtype, np.integer):
      return rng.integers(0, 5, size=leaf.shape).astype(leaf.dtype)
    if np.issubdtype(leaf.dtype, np.complexfloating):
      return (rng.normal(size=leaf.shape) + 1j * rng.normal(size=leaf.shape)).astype(leaf.dtype)
    return rng.normal(size=leaf.shape).astype(leaf.dtype)

  return jax.tree.map(draw, tree)


def _floats(tree):
  """The inexact leaves of `tree` (the ones with gradients), None elsewhere."""
  return jax.tree.map(lambda x: x if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else None, tree)


def _loss_and_outputs(apply, params, x, reset, state, read):
  """A loss weighing every float output with fixed numbers, the outputs `(B, T, H)` only where
  `read` `(B, T)`; its gradient to params, x and state."""

  def loss(params, x, state_floats):
    state_full = jax.tree.map(lambda f, s: s if f is None else f, state_floats, state,
                              is_leaf=lambda v: v is None)
    y, final = apply(params, x, reset, state_full)
    out = (jnp.where(read[..., None], y, 0), final)
    weights = jax.tree.map(lambda v: jnp.cos(jnp.arange(v.size).reshape(v.shape)), _floats(out))
    total = sum(jnp.sum(jnp.real(w * v)) for w, v in
                zip(jax.tree.leaves(weights), jax.tree.leaves(_floats(out)), strict=True))
    return total, (y, final)

  return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(params, x, _floats(state))


def _assert_close(actual, expected):
  actual, expected = np.asarray(actual), np.asarray(expected)
  if not np.issubdtype(expected.dtype, np.inexact):
    np.testing.assert_array_equal(actual, expected)
    return
  # The layers keep their states in float32 whatever the inputs: a state's gradient sums the
  # devices' parts in float32.
  tol = TOL if expected.dtype in (np.float64, np.complex128) else 1e-6
  scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


def _apply(layer, mode, params, x, reset, state, axis_name=None):
  return layer.apply(params, x, reset, mode, initial_state=state, return_state=True,
                     axis_name=axis_name)


# Every layer in its own configuration, and the variants that cross devices another way:
# global attention (an all-gather of keys and values) and MIMO Mamba-3 (rank axes).
CASES = {case: factory for case, factory in registered.linen_cases().items()
         if case in registered.names() or case.startswith(("attention", "mamba3"))}


@pytest.mark.parametrize("case", CASES)
def test_layer_across_devices_equals_one_device(case):
  layer = CASES[case]().clone(param_dtype=jnp.float64)
  if "chunk_size" in {f.name for f in dataclasses.fields(layer)}:
    # Chunks of 5 in slices of 3 steps: each device's one chunk is partial.
    layer = layer.clone(chunk_size=5)
  rng = np.random.default_rng(len(case))
  x = rng.normal(size=(2, LENGTH, 4))
  # A reset in slices of every device count, one at a slice's first step, and a long document
  # across the middle.
  reset = np.zeros((2, LENGTH), bool)
  reset[0, [3, 6, 17]] = True
  reset[1, [12, 22]] = True
  # A NaN before a reset reaches no output after it, nor the inputs' gradients there, on any
  # device; the outputs that do read it are left out of the loss.
  poisoned = x.copy()
  poisoned[1, 2, 1] = np.nan
  read = np.ones((2, LENGTH), bool)
  read[1, 2:12] = False
  params = registered.drawn_where_zero(jax.jit(layer.init)(compiled.key(0), x))
  params = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
  state = _random_like(layer.initialize_state((2, 4)), rng)

  # One device runs "sequential": test_layers finds every mode equal there.
  alone = jax.jit(functools.partial(_loss_and_outputs, functools.partial(_apply, layer, "sequential")))
  mode = MODES[list(CASES).index(case) % len(MODES)]
  sharded = jax.shard_map(functools.partial(_apply, layer, mode, axis_name="seq"),
                          mesh=_mesh(DEVICES),
                          in_specs=(P(), TIME, TIME, P()), out_specs=(TIME, P()))
  across = jax.jit(functools.partial(_loss_and_outputs, sharded))
  for inputs, weights in ((x, np.ones_like(read)), (poisoned, read)):
    (_, out), grads = across(params, inputs, reset, state, weights)
    (_, want), want_grads = alone(params, inputs, reset, state, weights)
    if inputs is x:
      jax.tree.map(_assert_close, (out, grads), (want, want_grads))
      continue
    # What follows the reset, and the other row, must be finite and equal.
    jax.tree.map(_assert_close, out[1], want[1])
    y = np.asarray(out[0])[read]
    assert np.all(np.isfinite(y))
    _assert_close(y, np.asarray(want[0])[read])
    dx, want_dx = np.asarray(grads[1]), np.asarray(want_grads[1])
    for got, expected in ((dx[0], want_dx[0]), (dx[1, 12:], want_dx[1, 12:])):
      assert np.all(np.isfinite(got))
      _assert_close(got, expected)


@pytest.mark.parametrize("slice_length", [1, 2, 5])
def test_convolution_window_reaches_across_several_short_slices(slice_length):
  """A window of 4 steps over slices of 1 and 2 steps comes from several earlier devices."""
  rng = np.random.default_rng(slice_length)
  devices = 8 if slice_length < 5 else 2
  length = devices * slice_length
  x = rng.normal(size=(3, length, 2))
  kernel, bias, window = rng.normal(size=(5, 2)), rng.normal(size=2), rng.normal(size=(3, 4, 2))
  reset = rng.uniform(size=(3, length)) < 0.2
  conv = lambda x, reset, window, axis_name=None: causal_conv(x, kernel, bias, window, reset,
                                                              axis_name)
  sharded = jax.shard_map(functools.partial(conv, axis_name="seq"), mesh=_mesh(devices),
                          in_specs=(TIME, TIME, P()), out_specs=(TIME, P()))
  jax.tree.map(_assert_close, jax.jit(sharded)(x, reset, window), conv(x, reset, window))


def _partial(cls, **options):
  return functools.partial(cls, param_dtype=jnp.float64, **options)


MODELS = {
    # A hybrid language model: recurrent and local-attention blocks, scanned, with a cache.
    "hybrid-lm": dict(num_outputs=11, vocab_size=11, pooling="none", block="mixer", norm="rms",
                      mlp="swiglu", num_blocks=3, scan_blocks=True,
                      layer=(_partial(layers.RGLRU, num_heads=2, d_conv=3),
                             _partial(layers.Attention, num_heads=2, head_dim=4, window=7))),
    # A classifier over real inputs, pooled over the real steps of every device; the first
    # RWKV7 block's values pass over the Gated DeltaNet block to the third.
    "last-pooled": dict(num_outputs=3, pooling="last", num_blocks=3, norm="batch",
                        layer=(_partial(layers.RWKV7, head_dim=4),
                               _partial(layers.GatedDeltaNet, num_heads=2, d_conv=3))),
}


@pytest.mark.parametrize("name", MODELS)
def test_model_across_devices_equals_one_device(name):
  options = MODELS[name]
  model = layers.SequenceModel(features=8, param_dtype=jnp.float64, **options)
  rng = np.random.default_rng(3)
  tokens = options.get("vocab_size") is not None
  x = rng.integers(0, 11, size=(2, LENGTH)) if tokens else rng.normal(size=(2, LENGTH, 3))
  reset = rng.uniform(size=(2, LENGTH)) < 0.15
  # Padding at both ends, so that the last real step is on an inner device.
  mask = np.ones((2, LENGTH), bool)
  mask[0, :5] = mask[1, 14:] = False
  variables = jax.jit(model.init)(compiled.key(0), x, mask)
  state = _random_like(model.initialize_state(x.shape[:1] if tokens else (2, 3)), rng)
  pooled = options["pooling"] != "none"
  out_spec = P() if pooled else TIME

  def apply(variables, x, mask, reset, state, axis_name=None):
    return model.apply(variables, x, mask, reset, initial_state=state, return_state=True,
                       axis_name=axis_name)

  sharded = jax.shard_map(functools.partial(apply, axis_name="seq"), mesh=_mesh(4),
                          in_specs=(P(), TIME, TIME, TIME, P()), out_specs=(out_spec, P()))

  def loss(apply, variables, x, mask, reset, state):
    y, final = apply(variables, x, mask, reset, state)
    weights = jnp.cos(jnp.arange(y.size).reshape(y.shape))
    return jnp.sum(weights * y) + sum(jnp.sum(jnp.real(s)) for s in jax.tree.leaves(_floats(final))
                                      if s is not None), (y, final)

  got = jax.jit(jax.value_and_grad(functools.partial(loss, sharded), has_aux=True))(
      variables, x, mask, reset, state)
  want = jax.jit(jax.value_and_grad(functools.partial(loss, apply), has_aux=True))(
      variables, x, mask, reset, state)
  jax.tree.map(_assert_close, got, want)


def test_batch_statistics_across_devices_are_refused():
  model = layers.SequenceModel(num_outputs=2, features=4, norm="batch", num_blocks=1)
  x = np.ones((2, 8, 3))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  train = functools.partial(model.apply, train=True, axis_name="seq", mutable=["batch_stats"])
  with pytest.raises(ValueError, match="norm='batch'"):
    jax.shard_map(lambda x: train(variables, x)[0], mesh=_mesh(2), in_specs=TIME,
                  out_specs=P())(x)


def test_nnx_model_across_devices_equals_one_device():
  model = snx.SequenceModel(None, 7, vocab_size=7, features=8, num_blocks=2, pooling="none",
                            block="mixer", norm="rms",
                            layer=functools.partial(snx.KimiDeltaAttention, num_heads=2, d_conv=3,
                                                    param_dtype=jnp.float64),
                            param_dtype=jnp.float64, rngs=nnx.Rngs(0))
  model.eval()
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  rng = np.random.default_rng(4)
  x = rng.integers(0, 7, size=(2, LENGTH))
  reset = rng.uniform(size=(2, LENGTH)) < 0.15

  def apply(params, rest, x, reset, axis_name=None):
    return nnx.merge(graph, params, rest)(x, reset=reset, return_state=True, axis_name=axis_name)

  sharded = jax.shard_map(functools.partial(apply, axis_name="seq"), mesh=_mesh(8),
                          in_specs=(P(), P(), TIME, TIME), out_specs=(TIME, P()))
  loss = lambda apply, params, *args: (jnp.sum(jnp.sin(apply(params, *args)[0])),
                                       apply(params, *args))
  got = jax.jit(jax.value_and_grad(functools.partial(loss, sharded), has_aux=True))(
      params, rest, x, reset)
  want = jax.jit(jax.value_and_grad(functools.partial(loss, apply), has_aux=True))(
      params, rest, x, reset)
  jax.tree.map(_assert_close, got, want)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_pooling_reads_the_real_steps_of_every_device(pooling):
  rng = np.random.default_rng(5)
  x = rng.normal(size=(3, LENGTH, 2))
  mask = np.ones((3, LENGTH), bool)
  mask[0, :5] = mask[1, 14:] = False  # the last real step on an inner device
  mask[2] = False  # no real step at all: zeros
  sharded = jax.shard_map(lambda x, mask: pool(x, mask, pooling, "seq"), mesh=_mesh(4),
                          in_specs=(TIME, TIME), out_specs=P())
  _assert_close(jax.jit(sharded)(x, mask), pool(x, mask, pooling))
