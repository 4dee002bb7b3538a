"""`ssmkit.nnx`: the layer contract on the NNX modules, and every NNX module against its linen twin
with the same parameters (converted both ways), in training and evaluation mode."""

import dataclasses
import functools
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import compiled
import registered
import ssmkit.nnx as snx
from ssmkit import layers
from ssmkit._src.layers.model import layer_pattern
from ssmkit._src.train.core.model import parameter_labels

# Every layer of the registry in each of its test configurations, and a bidirectional S4D:
# NNX factory and linen twin, width 4.
LAYERS = {
    **registered.nnx_cases(),
    "s4d-bidirectional": (functools.partial(snx.S4D, d_state=4, bidirectional=True),
                          layers.S4D(d_state=4, bidirectional=True)),
}
CAUSAL = [name for name in LAYERS if "bidirectional" not in name]
ONE_PER_LAYER = registered.names()
MODES = ["sequential", "parallel", "chunked", "auto"]
WIDTH = 4


def _x(shape, seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _resets(shape, seed=1):
  return jax.random.bernoulli(jax.random.key(seed), 0.2, shape)


def _assert_close(actual, expected, rtol=1e-5):
  scale = float(jnp.max(jnp.abs(expected)))
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=rtol * scale)


def _assert_trees_close(actual, expected, rtol=1e-5):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    _assert_close(got, want, rtol)


def _assert_states_equal(actual, expected):
  """NNX states equal leaf for leaf, PRNG keys (dropout streams) by their data."""
  as_data = lambda v: jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(as_data(got), as_data(want))


@pytest.fixture(params=ONE_PER_LAYER)
def layer(request):
  module = LAYERS[request.param][0](WIDTH, rngs=nnx.Rngs(0))
  nnx.update(module, registered.drawn_where_zero(nnx.state(module, nnx.Param)))
  return module


# `layer` for one layer of each kind of state, where the front end does the same for every layer:
# it computes as the linen layer in every mode (`test_every_mode_is_the_linen_layers`), and
# eagerly it runs the linen maths that test_layers runs eagerly for every layer.
one_of_each = pytest.mark.parametrize("layer", registered.ONE_OF_EACH_STATE, indirect=True)


# The layer contract, on the NNX modules (one shape throughout, so compiled code is shared).


# Shared by the tests: nnx.jit compiles once per module configuration and input shape. Called
# eagerly, every primitive inside a module compiles a program of its own.
_call = nnx.jit(lambda module, x, reset: module(x, reset))
_call_with_state = nnx.jit(lambda module, x, reset: module(x, reset, return_state=True))
_run = nnx.jit(lambda module, *args: module(*args))
_step = nnx.jit(lambda module, *args: module.step(*args))


def _apply(module, method=None):
  """The linen `module.apply`, compiled."""
  return jax.jit(functools.partial(module.apply, method=method))


@one_of_each
def test_sequence_equals_stepping_under_nnx_scan(layer):
  """A recurrent policy's loop: the layer steps through time inside `nnx.scan`, from resets."""
  x, reset = _x((2, 13, WIDTH)), _resets((2, 13))

  @nnx.scan(in_axes=(None, nnx.Carry, 1, 1), out_axes=(nnx.Carry, 1))
  def rollout(module, state, x_t, r_t):
    return module.step(state, x_t, r_t)

  last, y = rollout(layer, layer.initialize_state((2, WIDTH)), x, reset)
  whole, state = _call_with_state(layer, x, reset)
  _assert_close(y, whole)
  _assert_trees_close(last, state)


def test_every_mode_is_the_linen_layers(layer):
  """The front end passes `mode` and `reset` to the same maths: the linen layer's outputs, bit
  for bit (the modes' agreement is the linen contract's)."""
  x, reset = _x((2, 13, WIDTH)), _resets((2, 13))
  module, variables = snx.to_linen(layer)
  outputs = nnx.jit(lambda module: [module(x, reset, mode=mode) for mode in MODES])(layer)
  expected = jax.jit(lambda v: [module.apply(v, x, reset, mode=mode) for mode in MODES])(variables)
  for y, want in zip(outputs, expected, strict=True):
    np.testing.assert_array_equal(y, want)


@one_of_each
def test_reset_cuts_information_flow(layer):
  x = _x((2, 13, WIDTH))
  reset = jnp.zeros((2, 13), bool).at[:, 6].set(True)
  changed = x.at[:, :6].set(_x((2, 6, WIDTH), seed=5))
  y, y_changed = _call(layer, x, reset), _call(layer, changed, reset)
  np.testing.assert_array_equal(y[:, 6:], y_changed[:, 6:])
  assert not np.allclose(y[:, :6], y_changed[:, :6])
  assert not np.allclose(_call(layer, x, None)[:, 6:], _call(layer, changed, None)[:, 6:])


@one_of_each
def test_nnx_jit_equals_eager(layer):
  x, reset = _x((2, 13, WIDTH)), _resets((2, 13))
  _assert_close(_call(layer, x, reset), layer(x, reset))  # the second eagerly


@one_of_each
def test_gradients_through_nnx_grad_are_finite(layer):
  x = _x((2, 13, WIDTH))
  def loss(module, x):  # every parameter in use
    return jnp.sum(registered.as_later_layer(module, module, x) ** 2)

  grads, dx = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(layer, x)
  leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
  assert len(leaves) == len(jax.tree.leaves(nnx.state(layer, nnx.Param)))
  for g in [*leaves, dx]:
    assert np.all(np.isfinite(g)) and np.any(g != 0)


@pytest.mark.parametrize("name", ["lru", "mamba2", "rwkv7", "attention"])
def test_nnx_vmap_over_the_batch(name):
  """`nnx.vmap` over a batch axis, one diagonal, two matrix-state layers and attention: the
  front end's vmap is the same for every layer (`test_layers` vmaps each linen layer)."""
  layer = LAYERS[name][0](WIDTH, rngs=nnx.Rngs(0))
  nnx.update(layer, registered.drawn_where_zero(nnx.state(layer, nnx.Param)))
  x = _x((2, 13, WIDTH))
  y = nnx.vmap(lambda module, x: module(x), in_axes=(None, 0))(layer, x)
  _assert_close(y, _call(layer, x, None))
  assert nnx.eval_shape(lambda module: module(x[0]), layer).shape == (13, WIDTH)


@one_of_each
def test_bfloat16_inputs_keep_their_dtype(layer):
  x = _x((2, 13, WIDTH))
  y = _call(layer, x.astype(jnp.bfloat16), None)
  assert y.dtype == jnp.bfloat16
  _assert_close(y.astype(jnp.float32), _call(layer, x.astype(jnp.bfloat16).astype(jnp.float32), None),
                rtol=2e-2)


# The options are the linen layer's.


@pytest.mark.parametrize("name", ONE_PER_LAYER)
def test_options_and_defaults_are_the_linen_layers(name):
  cls = type(LAYERS[name][1])
  front_end = snx.front_end(cls)
  parameters = inspect.signature(front_end).parameters
  fields = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in ("parent", "name")}
  assert list(parameters) == ["features", *fields, "rngs"]
  assert {n: parameters[n].default for n in fields} == fields
  assert front_end.parameter_groups == cls.parameter_groups
  # The defaults serve widths that are multiples of 16; only the options are read: no parameters.
  default = nnx.eval_shape(lambda: front_end(16, rngs=nnx.Rngs(0)))
  assert all(getattr(default, n) == value for n, value in fields.items())


@pytest.mark.parametrize(("factory", "match"), [
    (functools.partial(snx.LRU, d_state=0), "`d_state` must be a positive int"),
    (functools.partial(snx.LRU, r_max=1.0), "r_max"),
    (functools.partial(snx.S4D, d_state=5), "`d_state`"),
    (functools.partial(snx.S4D, a_init="inv"), "`a_init`"),
    (functools.partial(snx.S5, discretization="euler"), "`discretization`"),
    (functools.partial(snx.S5, d_state=8, blocks=3), "`blocks`"),
    (functools.partial(snx.Mamba, d_state=2.5), "`d_state` must be a positive int"),
])
def test_bad_options_are_refused_on_construction(factory, match):
  with pytest.raises(ValueError, match=match):
    factory(WIDTH, rngs=nnx.Rngs(0))


def test_unknown_options_and_bad_width_are_refused():
  with pytest.raises(TypeError, match="d_stat"):
    snx.LRU(WIDTH, d_stat=4, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="name"):
    snx.LRU(WIDTH, name="lru", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`features`"):
    snx.LRU(0, rngs=nnx.Rngs(0))


def test_bad_input_names_the_argument(layer):
  x = _x((2, 13, WIDTH))
  with pytest.raises(ValueError, match="`reset`"):
    layer(x, jnp.zeros((2, 12), bool))
  with pytest.raises(ValueError, match="`x`"):
    layer(x[0, 0])
  wrong = layer.initialize_state((3, WIDTH))
  with pytest.raises(ValueError, match="initial_state"):
    layer(x, initial_state=wrong if jax.tree.leaves(wrong) else jnp.zeros(3))


# NNX against linen, with the same parameters.


# One configuration per layer: the conversion goes by parameter name, whatever the options.
@pytest.mark.parametrize("name", [*ONE_PER_LAYER, "s4d-bidirectional"])
def test_layer_equals_linen_with_converted_parameters(name):
  factory, linen_layer = LAYERS[name]
  x, reset = _x((2, 13, WIDTH)), _resets((2, 13))
  variables = compiled.init(linen_layer, x.shape, 3)
  layer = snx.from_linen(linen_layer, variables)
  assert type(layer) is factory.func and layer.features == WIDTH
  np.testing.assert_array_equal(_call(layer, x, reset), _apply(linen_layer)(variables, x, reset))
  np.testing.assert_array_equal(_call(layer, x, None), _apply(linen_layer)(variables, x, None))
  if name in CAUSAL:
    state = layer.initialize_state((2, WIDTH))
    _assert_trees_close(_step(layer, state, x[:, 0], reset[:, 0]),
                        _apply(linen_layer, "step")(variables, state, x[:, 0], reset[:, 0]))
  # And back: an NNX layer of its own parameters gives the linen layer that computes the same.
  fresh = nnx.jit(lambda: factory(WIDTH, rngs=nnx.Rngs(compiled.key(1))))()
  module, fresh_variables = snx.to_linen(fresh)
  assert module == linen_layer
  assert jax.tree.structure(fresh_variables) == jax.tree.structure(variables)
  np.testing.assert_array_equal(_apply(module)(fresh_variables, x, reset), _call(fresh, x, reset))


def test_round_trip_keeps_every_parameter_bit_for_bit(layer):
  module, variables = snx.to_linen(layer)
  back = snx.from_linen(module, variables)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(back, nnx.Param), nnx.state(layer, nnx.Param))
  again = snx.to_linen(back)[1]
  jax.tree.map(np.testing.assert_array_equal, again, variables)


def test_s4d_kernel_equals_linen():
  linen_layer = layers.S4D(d_state=8, bidirectional=True)
  variables = linen_layer.init(jax.random.key(4), _x((2, 13, WIDTH)))
  np.testing.assert_array_equal(snx.from_linen(linen_layer, variables).kernel(13),
                                linen_layer.apply(variables, 13, WIDTH, method="kernel"))


def test_from_linen_of_a_subclass_of_a_layer():
  class Traced(layers.LRU):
    pass

  linen_layer = Traced(d_state=4)
  x = _x((2, 13, WIDTH))
  variables = linen_layer.init(jax.random.key(0), x)
  layer = snx.from_linen(linen_layer, variables)
  assert type(layer) is snx.LRU
  np.testing.assert_array_equal(layer(x), linen_layer.apply(variables, x))


def test_conversion_refuses_what_does_not_fit():
  linen_layer = layers.LRU(d_state=4)
  variables = linen_layer.init(jax.random.key(0), _x((2, 13, WIDTH)))
  missing = {"params": {k: v for k, v in variables["params"].items() if k != "D"}}
  with pytest.raises(ValueError, match="`variables`"):
    snx.from_linen(linen_layer, missing)
  with pytest.raises(ValueError, match="`variables` must be the module's variables"):
    snx.from_linen(linen_layer, variables["params"])  # without the "params" wrapper
  extra = {"params": {**variables["params"], "E": variables["params"]["D"]}}
  with pytest.raises(ValueError, match="`variables`"):
    snx.from_linen(linen_layer, extra)
  block, block_variables = snx.to_linen(snx.SSMBlock(WIDTH, rngs=nnx.Rngs(0)))
  extra = {"params": {**block_variables["params"], "glu_extra": block_variables["params"]["glu_gate"]}}
  with pytest.raises(ValueError, match="hold params/glu_extra/bias, params/glu_extra/kernel"):
    snx.from_linen(block, extra)
  with pytest.raises(ValueError, match="`variables`"):
    snx.from_linen(layers.LRU(d_state=5), variables)
  with pytest.raises(TypeError, match="`module`"):
    snx.from_linen(nn.Dense(3), {"params": {}})
  with pytest.raises(TypeError, match="`model`"):
    snx.to_linen(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))


SMALL = {
    "LRU": (functools.partial(snx.LRU, d_state=4), functools.partial(layers.LRU, d_state=4)),
    "S4D-bidirectional": (functools.partial(snx.S4D, d_state=4, bidirectional=True),
                          functools.partial(layers.S4D, d_state=4, bidirectional=True)),
    "S5": (functools.partial(snx.S5, d_state=4), functools.partial(layers.S5, d_state=4)),
    "Mamba": (functools.partial(snx.Mamba, d_state=4, d_conv=3),
              functools.partial(layers.Mamba, d_state=4, d_conv=3)),
    "RGLRU": (functools.partial(snx.RGLRU, num_heads=2, d_conv=3),
              functools.partial(layers.RGLRU, num_heads=2, d_conv=3)),
    "Attention": (functools.partial(snx.Attention, num_heads=2, head_dim=4, window=4),
                  functools.partial(layers.Attention, num_heads=2, head_dim=4, window=4)),
}


def _linen_train(module, variables, *args, **kwargs):
  """Outputs and updated variables of a linen module in training mode, without dropout."""
  y, updates = module.apply(variables, *args, train=True, mutable=["batch_stats"], **kwargs)
  return y, {**variables, **updates}


@pytest.mark.parametrize(("name", "norm", "activation", "prenorm"), [
    ("S5", "rms", "half_glu", True),
    ("Mamba", "batch", "gelu", False),
])
def test_block_equals_linen_in_training_and_evaluation(name, norm, activation, prenorm):
  nnx_layer, _ = SMALL[name]
  block = snx.SSMBlock(8, layer=nnx_layer, norm=norm, activation=activation, prenorm=prenorm,
                       rngs=nnx.Rngs(0))
  module, variables = snx.to_linen(block)
  x, reset = _x((3, 11, 8)), _resets((3, 11))
  mask = jnp.arange(11)[None, :] < jnp.asarray([[4], [11], [8]])
  y, updated = _linen_train(module, variables, x, mask, reset)
  _assert_close(block(x, mask, reset), y)  # a new NNX module is in training mode
  _assert_trees_close(snx.to_linen(block)[1], updated)  # BatchNorm's averages moved alike
  block.eval()
  _assert_close(block(x, mask, reset), module.apply(updated, x, mask, reset))
  if name in CAUSAL:
    state = block.initialize_state((3, 8))
    _assert_trees_close(block.step(state, x[:, 0], reset[:, 0]),
                        module.apply(updated, state, x[:, 0], reset[:, 0], method="step"))


def _model(num_outputs=3, **options):
  """A small NNX model with BatchNorm, of 2 input features or of tokens with `vocab_size`."""
  config = dict(layer=SMALL["LRU"][0], features=8, num_blocks=2, norm="batch")
  rngs = options.pop("rngs", None) or nnx.Rngs(0)
  return snx.SequenceModel(None if options.get("vocab_size") else 2, num_outputs,
                           **{**config, **options}, rngs=rngs)


def _models(**options):
  """A small NNX model, and the linen model and variables converted from it."""
  model = nnx.jit(lambda: _model(**options))()
  return model, *snx.to_linen(model)


# Options of the model tests, the first also that of the generation test.
MODELS = {
    "S5-scanned-tokens": dict(layer="S5", scan_blocks=True, vocab_size=7, num_outputs=7, pooling="none"),
    "S4D-bidirectional-layer-norm-postnorm": dict(layer="S4D-bidirectional", norm="layer",
                                                  activation="gelu", prenorm=False, pooling="last"),
    # Griffin's pattern, 4 blocks, the first a head: after it one scanned repeat of the last
    # two places and a tail of one (the linen models' tests scan it without a head too).
    "Griffin-scanned-head-tail-lm-head": dict(
        layer=("RGLRU", "RGLRU", "Attention"), block="mixer", mlp="geglu", mlp_expansion=1.5,
        num_blocks=4, scan_blocks=True, head_blocks=1, vocab_size=7, num_outputs=7, pooling="none",
        tie_embeddings=True, scale_embeddings=True, logit_cap=3.0),
    "Mamba-Attention-unrolled-swiglu-bfloat16": dict(
        layer=("Mamba", "Attention"), block="mixer", norm="rms", mlp="swiglu", mlp_bias=True,
        num_blocks=3, pooling="last", dtype=jnp.bfloat16),
}


def _model_options(name):
  options = dict(MODELS[name])
  layer = options["layer"]
  return {**options, "layer": SMALL[layer][0] if isinstance(layer, str)
          else tuple(SMALL[name][0] for name in layer)}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_equals_linen_in_training_and_evaluation(name):
  options = MODELS[name]
  model, module, variables = _models(**_model_options(name))
  names = (options["layer"],) if isinstance(options["layer"], str) else options["layer"]
  assert ([make(parent=None) for make in layer_pattern(module.layer)]
          == [SMALL[name][1](parent=None) for name in names])
  tokens = "vocab_size" in options
  x = jax.random.randint(jax.random.key(2), (3, 11), 0, 7) if tokens else _x((3, 11, 2))
  mask = jnp.arange(11)[None, :] < jnp.asarray([[4], [11], [8]])
  reset = _resets((3, 11))
  y, updated = jax.jit(functools.partial(_linen_train, module))(variables, x, mask, reset)
  _assert_close(_run(model, x, mask, reset), y)
  _assert_trees_close(snx.to_linen(model)[1], updated)
  model.eval()
  _assert_close(_run(model, x, mask, reset), _apply(module)(updated, x, mask, reset))
  if options["pooling"] == "none":
    start = model.initialize_state(x[:, 0].shape)
    _assert_trees_close(start, module.initialize_state(x[:, 0].shape))
    _, state = nnx.jit(lambda m: m(x, reset=reset, return_state=True))(model)
    _assert_trees_close(_step(model, state, x[:, 0], reset[:, 0]),
                        _apply(module, "step")(updated, state, x[:, 0], reset[:, 0]))
  # Back again from linen, to the same NNX model.
  back = snx.from_linen(module, updated)
  back.eval()
  np.testing.assert_array_equal(_run(back, x, mask, reset), _run(model, x, mask, reset))


def test_model_defaults_are_the_linen_models():
  fields = {f.name: f.default for f in dataclasses.fields(layers.SequenceModel)
            if f.name not in ("parent", "name", "num_outputs", "layer")}
  parameters = inspect.signature(snx.SequenceModel.__init__).parameters
  assert {n: parameters[n].default for n in fields} == fields
  for linen, front_end in [(layers.SSMBlock, snx.SSMBlock), (layers.MixerBlock, snx.MixerBlock)]:
    block_fields = {f.name: f.default for f in dataclasses.fields(linen)
                    if f.name not in ("parent", "name", "layer")}
    parameters = inspect.signature(front_end.__init__).parameters
    assert {n: parameters[n].default for n in block_fields} == block_fields


def test_dropout_acts_only_in_training():
  model, module, _ = _models(dropout_rate=0.5)
  x = _x((3, 11, 2))
  assert not np.allclose(model(x), model(x))  # the dropout stream moves on
  model.eval()
  np.testing.assert_array_equal(model(x), model(x))
  _assert_close(model(x), module.apply(snx.to_linen(model)[1], x))


def test_from_linen_gives_the_random_streams_of_the_model_built_from_the_same_rngs():
  """`from_linen` sets every parameter from the variables and draws none itself; its dropout
  streams, and the `rngs` it is given, are where building the model from those `rngs` leaves
  them, so training the converted model drops what the built one would."""
  model, module, variables = _models(dropout_rate=0.5)
  given, built_from = nnx.Rngs(7, dropout=11), nnx.Rngs(7, dropout=11)
  converted = snx.from_linen(module, variables, rngs=given)
  built = _model(dropout_rate=0.5, rngs=built_from)
  nnx.update(built, nnx.state(model, nnx.Not(nnx.RngState)))
  key_data = lambda state: jax.tree.map(
      lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a, state)
  for a, b in ((converted, built), (given, built_from)):
    jax.tree.map(np.testing.assert_array_equal, key_data(nnx.state(a, nnx.RngState)),
                 key_data(nnx.state(b, nnx.RngState)))
  x = _x((3, 11, 2))
  np.testing.assert_array_equal(converted(x), built(x))  # the same units dropped
  np.testing.assert_array_equal(converted(x), built(x))  # and the same again, streams advanced


def test_model_rejects_bad_configuration():
  with pytest.raises(ValueError, match="in_features"):
    snx.SequenceModel(2, 3, vocab_size=5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="in_features"):
    snx.SequenceModel(None, 3, rngs=nnx.Rngs(0))
  for option, match in [({"pooling": "max"}, "pooling"), ({"norm": "group"}, "norm"),
                        ({"activation": "relu"}, "activation"), ({"mlp": "relu"}, "mlp"),
                        ({"mlp": "gelu"}, "mlp"), ({"block": "mixer", "prenorm": False}, "prenorm"),
                        ({"tie_embeddings": True}, "tie_embeddings"), ({"layer": []}, "layer"),
                        ({"layer": [SMALL["LRU"][0]] * 3, "scan_blocks": True}, "num_blocks")]:
    with pytest.raises(ValueError, match=match):
      snx.SequenceModel(2, 3, **option, rngs=nnx.Rngs(0))
  model = snx.SequenceModel(2, 3, features=4, layer=SMALL["LRU"][0], rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="pooling"):
    model.step(model.initialize_state((2, 2)), jnp.ones((2, 2)))


def test_generate_equals_linen_and_leaves_the_model_as_it_was():
  model, module, variables = _models(**_model_options("S5-scanned-tokens"))
  prompt = jax.random.randint(jax.random.key(3), (3, 4), 0, 7)
  state = nnx.clone(nnx.state(model))
  kwargs = dict(rng=jax.random.key(1), temperature=0.7, top_p=0.9, eos_token=2)
  np.testing.assert_array_equal(snx.generate(model, prompt, 6, **kwargs),
                                layers.generate(module, variables, prompt, 6, **kwargs))
  _assert_states_equal(nnx.state(model), state)
  assert not model.blocks.dropout.deterministic  # still in training mode
  with pytest.raises(ValueError, match="`rng`"):
    snx.generate(model, prompt, 3)


def _batches(seed):
  """A toy task: is the mean of a noisy sequence's first feature positive?"""
  x = _x((16, 12, 2), seed)
  return x, (jnp.mean(x[..., 0], axis=-1) > 0).astype(jnp.int32)


def _cross_entropy(logits, labels):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def test_adam_steps_lower_the_loss_as_the_linen_models_do():
  model, module, variables = _models(num_outputs=2)
  x, labels = _batches(7)
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: _cross_entropy(m(x), labels))(model)
    optimizer.update(model, grads)
    return loss

  tx = optax.adam(1e-2)

  @jax.jit
  def linen_step(variables, opt_state):
    def loss_fn(params):
      y, updates = module.apply({**variables, "params": params}, x, train=True, mutable=["batch_stats"])
      return _cross_entropy(y, labels), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
    changes, opt_state = tx.update(grads, opt_state)
    return loss, {**updates, "params": optax.apply_updates(variables["params"], changes)}, opt_state

  opt_state = tx.init(variables["params"])
  nnx_losses, linen_losses = [], []
  for _ in range(30):
    nnx_losses.append(float(nnx_step(model, optimizer)))
    loss, variables, opt_state = linen_step(variables, opt_state)
    linen_losses.append(float(loss))
  assert nnx_losses[-1] <= 0.8 * nnx_losses[0] and linen_losses[-1] <= 0.8 * linen_losses[0]
  # Same start, same maths: the same losses all the way, up to float rounding.
  np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-3)


def test_the_trainers_optimizer_groups_label_nnx_parameters_as_linen_ones():
  model, _, variables = _models()
  labels = parameter_labels(nnx.state(model, nnx.Param), "lru")
  assert sorted(jax.tree.leaves(labels)) == sorted(jax.tree.leaves(parameter_labels(variables["params"],
                                                                                     "lru")))
  block = labels["blocks"][0]
  assert (block["ssm"]["nu_log"].get_value(), block["norm"]["scale"].get_value(),
          block["glu_gate"]["kernel"].get_value(), labels["encoder"]["bias"].get_value()
          ) == ("ssm", "no_decay", "decay", "no_decay")
  # A scanned pattern with a tail: each block by its own layer's groups.
  pattern = ("lru", "attention")
  model, _, variables = _models(layer=(SMALL["LRU"][0], SMALL["Attention"][0]), num_blocks=3,
                                scan_blocks=True, block="mixer")
  labels = parameter_labels(nnx.state(model, nnx.Param), pattern)
  assert sorted(jax.tree.leaves(labels)) == sorted(jax.tree.leaves(
      parameter_labels(variables["params"], pattern)))
  assert labels["tail"][0]["mixer"]["nu_log"].get_value() == "ssm"
  assert labels["blocks"][1]["mixer"]["q_proj"].get_value() == "decay"
  # With a head of one (attention): one repeat of two LRU blocks and a tail of one after it,
  # where block 3 unrolled is place 1 (3 mod 3 would be the attention's place).
  pattern = ("attention", "lru", "lru")
  for scan in (True, False):
    model, _, variables = _models(layer=tuple(SMALL[n][0] for n in ("Attention", "LRU", "LRU")),
                                  num_blocks=4, scan_blocks=scan, head_blocks=1, block="mixer")
    labels = parameter_labels(nnx.state(model, nnx.Param), pattern, head_blocks=1)
    assert sorted(jax.tree.leaves(labels)) == sorted(jax.tree.leaves(
        parameter_labels(variables["params"], pattern, head_blocks=1)))
    blocks = ([labels["head"][0], labels["blocks"][0], labels["blocks"][1], labels["tail"][0]]
              if scan else [labels["blocks"][i] for i in range(4)])
    assert [b["mixer"]["nu_log" if i else "q_proj"].get_value() for i, b in enumerate(blocks)] == [
        "decay", "ssm", "ssm", "ssm"]


def test_split_and_merge_round_trip():
  model = _model(dropout_rate=0.1)
  x = _x((3, 11, 2))
  model.eval()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  copy = nnx.merge(graphdef, params, rest)
  assert copy.blocks[0].dropout.deterministic  # the mode travels in the graph
  np.testing.assert_array_equal(copy(x), model(x))
  _assert_close(jax.jit(lambda p, r: nnx.merge(graphdef, p, r)(x))(params, rest), model(x))


def test_orbax_restores_a_saved_model(tmp_path):
  model = _model(dropout_rate=0.1)
  x = _x((3, 11, 2))
  model(x)  # move the BatchNorm averages and the dropout stream off their start
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "model", nnx.state(model))
  abstract = nnx.eval_shape(lambda: _model(dropout_rate=0.1))
  graphdef, template = nnx.split(abstract)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "model", template))
  _assert_states_equal(nnx.state(restored), nnx.state(model))
  np.testing.assert_array_equal(restored(x), model(x))  # dropout included
