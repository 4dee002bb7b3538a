"""`SSMBlock`, `SequenceModel` and `generate`: blocks against a hand-written reference, models
against themselves run another way (step by step, unpadded, unrolled)."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compiled
import registered
import ssmkit.nnx as snx
from ssmkit import layers
from ssmkit._src.layers import model as model_module
from ssmkit._src.layers.block import NORMS
from ssmkit._src.layers.model import _filter_logits

# Each registered layer in its own test configuration, and a bidirectional S4D.
SMALL_LAYERS = {
    **registered.linen_cases(variants=False),
    "s4d-bidirectional": functools.partial(layers.S4D, d_state=4, bidirectional=True),
}


def _x(shape, seed=0):
  """Inputs in NumPy: jax.numpy outside the model would compile a program per shape."""
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _assert_close(actual, expected, rtol=1e-5):
  scale = float(np.max(np.abs(np.asarray(expected, np.float64))))
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=rtol * scale)


def _stepped(module, variables, x, reset=None):
  """`module.step` over time (axis 1 of `x`) from the zero state."""
  step = compiled.run(module, method="step")
  state = module.initialize_state(x[:, 0].shape)
  ys = []
  for t in range(x.shape[1]):
    state, y_t = step(variables, state, x[:, t], None if reset is None else reset[:, t])
    ys.append(y_t)
  return jnp.stack(ys, axis=1)



def _gelu(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _sigmoid(x):
  return 1 / (1 + np.exp(-x))


def _dense(p, x):
  return x @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64)


@pytest.mark.parametrize("activation", ["gelu", "glu", "half_glu"])
@pytest.mark.parametrize("prenorm", [True, False])
def test_block_matches_its_formula(activation, prenorm):
  block = layers.SSMBlock(layer=SMALL_LAYERS["lru"], activation=activation, prenorm=prenorm)
  x = _x((2, 9, 5))
  params = compiled.init(block, x.shape)["params"]
  ssm = lambda u: np.asarray(SMALL_LAYERS["lru"]().apply({"params": params["ssm"]}, jnp.asarray(u)),
                             np.float64)

  def layer_norm(u):
    p = params["norm"]["LayerNorm_0"]
    u = np.asarray(u, np.float64)
    normed = (u - u.mean(-1, keepdims=True)) / np.sqrt(u.var(-1, keepdims=True) + 1e-6)
    return normed * np.asarray(p["scale"]) + np.asarray(p["bias"])

  x64 = np.asarray(x, np.float64)
  y = _gelu(ssm(layer_norm(x64).astype(np.float32) if prenorm else x))
  if activation == "glu":
    y = _dense(params["glu_value"], y) * _sigmoid(_dense(params["glu_gate"], y))
  elif activation == "half_glu":
    y = y * _sigmoid(_dense(params["glu_gate"], y))
  expected = x64 + y if prenorm else layer_norm(x64 + y)
  _assert_close(block.apply({"params": params}, x), expected, rtol=1e-4)


@pytest.mark.parametrize(("name", "norm"), [
    *((name, "layer") for name in registered.ONE_OF_EACH_STATE),
    *((name, norm) for name in ("lru", "mamba", "rwkv7") for norm in NORMS if norm != "layer")])
def test_block_sequence_equals_step_by_step(name, norm):
  block = layers.SSMBlock(layer=SMALL_LAYERS[name], norm=norm)
  x, reset = _x((2, 11, 4)), jax.random.bernoulli(jax.random.key(1), 0.2, (2, 11))
  variables = compiled.init(block, x.shape)
  _assert_close(compiled.run(block)(variables, x, None, reset), _stepped(block, variables, x, reset))


def _model(**kwargs):
  config = dict(num_outputs=3, layer=SMALL_LAYERS["lru"], features=8, num_blocks=2)
  return layers.SequenceModel(**{**config, **kwargs})


@pytest.mark.parametrize(("scan_blocks", "tokens"), [(False, False), (True, True)])
def test_model_continues_a_rollout_from_its_state(scan_blocks, tokens):
  """A rollout stepped from a mid-episode state equals it re-run as one sequence from that state."""
  model = _model(pooling="none", scan_blocks=scan_blocks, vocab_size=11 if tokens else None,
                 layer=SMALL_LAYERS["mamba"], norm="batch")
  draw = lambda shape, seed: (jax.random.randint(jax.random.key(seed), shape[:2], 0, 11) if tokens
                              else _x(shape, seed))
  x, reset = draw((3, 12, 2), 0), jax.random.bernoulli(jax.random.key(1), 0.2, (3, 12))
  variables = compiled.init(model, x.shape, 0, str(x.dtype))
  run = compiled.run(model, return_state=True)
  _, start = run(variables, draw((3, 5, 2), 4))
  step = compiled.run(model, method="step")
  state, stepped = start, []
  for t in range(12):
    state, y_t = step(variables, state, x[:, t], reset[:, t])
    stepped.append(y_t)
  y, last = run(variables, x, reset=reset, initial_state=start)
  _assert_close(y, jnp.stack(stepped, axis=1))
  for got, want in zip(jax.tree.leaves(last), jax.tree.leaves(state), strict=True):
    _assert_close(got, want)


def test_scanned_blocks_equal_unrolled_blocks():
  unrolled, scanned = _model(num_blocks=3), _model(num_blocks=3, scan_blocks=True)
  x = _x((2, 12, 2))
  params = compiled.init(unrolled, x.shape)["params"]
  stacked = dict(params)
  blocks = [stacked.pop(f"block_{i}") for i in range(3)]
  stacked["blocks"] = {"block": jax.tree.map(lambda *b: jnp.stack(b), *blocks)}
  structure = jax.tree.structure(compiled.init(scanned, x.shape)["params"])
  assert jax.tree.structure(stacked) == structure
  _assert_close(compiled.run(scanned)({"params": stacked}, x),
                compiled.run(unrolled)({"params": params}, x))


@pytest.mark.parametrize(("name", "pooling"), [
    *((name, "mean") for name in ("lru", "mamba2", "rwkv7", "attention", "s4d-bidirectional")),
    ("lru", "last")])
def test_padding_changes_nothing(name, pooling):
  """Each padded sequence classifies as it does alone and unpadded, whatever the padding holds.
  The padding is at the end, so a causal layer never reads it: the bidirectional S4D does, and
  the pooling."""
  model = _model(layer=SMALL_LAYERS[name], pooling=pooling)
  lengths = [5, 13, 1]
  x = _x((3, 13, 2))
  mask = jnp.arange(13)[None, :] < jnp.asarray(lengths)[:, None]
  variables = compiled.init(model, x.shape)
  run = compiled.run(model)
  padded = run(variables, jnp.where(mask[..., None], x, 1e3), mask)
  for i, n in enumerate(lengths[::2]):  # the middle row has no padding
    _assert_close(padded[2 * i], run(variables, x[2 * i : 2 * i + 1, :n])[0])


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_left_padding_pools_the_real_steps(pooling):
  model = _model(pooling=pooling)
  lengths = [5, 13, 1]
  x = _x((3, 13, 2))
  mask = jnp.arange(13)[None, :] >= 13 - jnp.asarray(lengths)[:, None]  # padding first
  variables = compiled.init(model, x.shape)
  run = compiled.run(model)
  padded = run(variables, np.where(mask[..., None], x, 0.0), mask)
  for i, n in enumerate(lengths):
    _assert_close(padded[i], run(variables, x[i : i + 1, 13 - n :])[0])


def test_mask_broadcasts_over_batch_axes_of_size_one():
  model = _model()
  x = _x((3, 6, 2))
  steps = jnp.arange(6)[None, :] < 4
  variables = compiled.init(model, x.shape)
  np.testing.assert_array_equal(compiled.run(model)(variables, x, steps),
                                compiled.run(model)(variables, x, jnp.broadcast_to(steps, (3, 6))))


def test_batchnorm_statistics_skip_padding():
  model = _model(norm="batch")
  x = _x((2, 7, 2))
  mask = jnp.arange(7)[None, :] < jnp.asarray([[3], [7]])
  variables = compiled.init(model, x.shape)
  run = lambda inputs, m, r: model.apply(variables, inputs, m, r, train=True, mutable=["batch_stats"])[1]
  with_padding = run(jnp.where(mask[..., None], x, 50.0), mask, None)
  # The real steps of both sequences as one, a reset keeping them apart.
  real_steps = jnp.concatenate([x[0, :3], x[1]])[None]
  reset = jnp.zeros((1, 10), bool).at[0, 3].set(True)
  without_padding = run(real_steps, None, reset)
  for actual, expected in zip(jax.tree.leaves(with_padding), jax.tree.leaves(without_padding),
                              strict=True):
    _assert_close(actual, expected)


def test_last_pooling_reads_the_last_real_step():
  model = _model(pooling="last")
  per_step = _model(pooling="none")
  x = _x((2, 6, 2))
  variables = compiled.init(model, x.shape)
  mask = jnp.arange(6)[None, :] < jnp.asarray([[4], [6]])
  logits = compiled.run(per_step)(variables, x)
  _assert_close(compiled.run(model)(variables, x, mask), np.stack([logits[0, 3], logits[1, 5]]))


def test_dropout_acts_only_in_training():
  model = _model(dropout_rate=0.5)
  x = _x((2, 6, 2))
  variables = compiled.init(model, x.shape)
  train = lambda seed: model.apply(variables, x, train=True, rngs={"dropout": jax.random.key(seed)})
  assert not np.allclose(train(0), train(1))
  np.testing.assert_array_equal(compiled.run(model)(variables, x), compiled.run(model)(variables, x))


def test_model_trains_under_jit_with_finite_gradients():
  model = _model(norm="batch", dropout_rate=0.1, scan_blocks=True, layer=SMALL_LAYERS["s5"])
  x, labels = _x((4, 9, 2)), jnp.asarray([0, 1, 2, 0])
  variables = compiled.init(model, x.shape)

  @jax.jit
  def loss(params):
    logits, _ = model.apply({**variables, "params": params}, x, train=True,
                            rngs={"dropout": jax.random.key(1)}, mutable=["batch_stats"])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

  grads = jax.grad(loss)(variables["params"])
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert any(np.any(g != 0) for g in jax.tree.leaves(grads["blocks"]))


@pytest.mark.parametrize("name", registered.ONE_OF_EACH_STATE)
def test_greedy_generation_equals_rerunning_the_whole_sequence(name):
  model = _model(vocab_size=7, num_outputs=7, pooling="none", scan_blocks=True, layer=SMALL_LAYERS[name])
  prompt = jax.random.randint(jax.random.key(3), (2, 4), 0, 7)
  variables = compiled.init(model, prompt.shape, 0, "int32")
  generated = jax.jit(lambda p: layers.generate(model, variables, p, 3, temperature=0.0))(prompt)
  # The whole sequence re-run at once: the model is causal, so the logits at step t see only
  # tokens up to t, and each generated token is the argmax after the tokens before it.
  tokens = jnp.concatenate([prompt, generated.astype(prompt.dtype)], axis=1)
  rerun = jnp.argmax(compiled.run(model)(variables, tokens)[:, 3:-1], axis=-1)
  np.testing.assert_array_equal(generated, rerun)


def test_sampling_is_reproducible_and_in_vocabulary():
  model = _model(vocab_size=7, num_outputs=7, pooling="none")
  prompt = jnp.zeros((3, 1), jnp.int32)
  variables = compiled.init(model, prompt.shape, 0, "int32")
  sample = jax.jit(lambda key: layers.generate(model, variables, prompt, 20, rng=key))
  tokens = sample(jax.random.key(0))
  np.testing.assert_array_equal(tokens, sample(jax.random.key(0)))
  assert not np.array_equal(tokens, sample(jax.random.key(1)))
  assert tokens.shape == (3, 20) and np.all((tokens >= 0) & (tokens < 7))


def _np_filter(logits, top_k, top_p):
  """Top-k then nucleus filtering of one row of logits, in float64 NumPy."""
  logits = np.array(logits, np.float64)
  if top_k is not None:
    logits[logits < np.sort(logits)[::-1][top_k - 1]] = -np.inf
  if top_p is not None:
    order = np.argsort(-logits, kind="stable")
    probs = np.exp(logits[order] - logits[order[0]])
    probs /= probs.sum()
    mass, keep = 0.0, []
    for i, p in zip(order, probs, strict=True):
      if mass >= top_p:
        break
      keep.append(i)
      mass += p
    logits[[i for i in range(len(logits)) if logits[i] < min(logits[keep])]] = -np.inf
  return logits


@pytest.mark.parametrize(("top_k", "top_p"), [(None, None), (1, None), (3, None), (None, 0.5),
                                               (None, 1.0), (4, 0.7), (10, 0.05)])
def test_sampling_filters_match_numpy(top_k, top_p):
  logits = jax.random.normal(jax.random.key(0), (5, 10), jnp.float64) * 2
  got = _filter_logits(logits, top_k, top_p)
  for row, want in zip(np.asarray(got), map(lambda r: _np_filter(r, top_k, top_p), np.asarray(logits)),
                       strict=True):
    np.testing.assert_array_equal(np.isfinite(row), np.isfinite(want))
    np.testing.assert_allclose(row[np.isfinite(row)], want[np.isfinite(want)], rtol=1e-12)


def _token_model(**kwargs):
  model = _model(vocab_size=7, num_outputs=7, pooling="none", **kwargs)
  prompt = jax.random.randint(jax.random.key(3), (3, 4), 0, 7)
  return model, compiled.init(model, prompt.shape, 0, "int32"), prompt


def test_top_k_one_and_temperature_zero_are_greedy_without_a_key():
  model, variables, prompt = _token_model()
  greedy = layers.generate(model, variables, prompt, 6, temperature=0.0)
  np.testing.assert_array_equal(
      layers.generate(model, variables, prompt, 6, rng=jax.random.key(1), top_k=1), greedy)
  np.testing.assert_array_equal(
      layers.generate(model, variables, prompt, 6, rng=jax.random.key(1), top_p=1e-9), greedy)
  with pytest.raises(ValueError, match="`rng`"):
    layers.generate(model, variables, prompt, 6, temperature=0.5)
  for token in (7, -1):  # above the vocabulary, and negative: neither may wrap round
    with pytest.raises(ValueError, match=r"`prompt` tokens must lie in \[0, 7\)"):
      layers.generate(model, variables, prompt.at[1, 2].set(token), 6, temperature=0.0)


def test_tokens_outside_the_vocabulary_are_refused_or_nan_never_another_token():
  """Known ids outside [0, 7) are refused by name in `__call__` and `step` (linen and NNX);
  traced ones embed as NaN: that step's logits and the later ones are NaN, the earlier ones
  the same as for an id in range."""
  model, variables, prompt = _token_model()
  twin = snx.from_linen(model, variables)
  apply, step = compiled.run(model), compiled.run(model, method="step")
  for token in (7, -1):
    bad = np.asarray(prompt).copy()
    bad[1, 2] = token
    with pytest.raises(ValueError, match=r"`x` tokens must lie in \[0, 7\) \(`vocab_size`\)"):
      model.apply(variables, bad)
    with pytest.raises(ValueError, match=r"`x` tokens must lie in \[0, 7\)"):
      twin(bad)
    with pytest.raises(ValueError, match=r"`x_t` tokens must lie in \[0, 7\)"):
      model.apply(variables, model.initialize_state((3,)), bad[:, 2], method="step")
    with pytest.raises(ValueError, match=r"`x_t` tokens must lie in \[0, 7\)"):
      twin.step(twin.initialize_state((3,)), bad[:, 2])
    logits, clean = np.asarray(apply(variables, bad)), np.asarray(apply(variables, prompt))
    assert np.isnan(logits[1, 2:]).all() and np.isfinite(logits[[0, 2]]).all()
    np.testing.assert_array_equal(logits[1, :2], clean[1, :2])
    _, logits_t = step(variables, model.initialize_state((3,)), bad[:, 2])
    logits_t = np.asarray(logits_t)
    assert np.isnan(logits_t[1]).all() and np.isfinite(logits_t[[0, 2]]).all()


def test_init_is_one_compiled_program_per_model_and_shapes():
  """`model.init` compiles the model's initialisation once (eagerly, each operation compiled on
  its own took twice as long for a Griffin) and gives `jax.jit(flax's init)`'s values."""
  model = _model(vocab_size=7, num_outputs=7, pooling="none", num_blocks=1)
  x = np.zeros((2, 5), np.int32)
  before = model_module._compiled_init._cache_size()
  first = model.init(jax.random.key(4), x)
  again = model.init(jax.random.key(4), x, train=False)  # a keyword option: one more program
  model.init(jax.random.key(5), x)  # another key: the same program
  assert model_module._compiled_init._cache_size() == before + 2
  expected = jax.jit(lambda key, x: nn.Module.init(model, key, x))(jax.random.key(4), x)
  jax.tree.map(np.testing.assert_array_equal, first, expected)
  jax.tree.map(np.testing.assert_array_equal, again, expected)


def test_a_step_of_the_wrong_shape_names_x_t_and_the_shape_a_step_takes():
  model, variables, prompt = _token_model()
  twin = snx.from_linen(model, variables)
  for step, state in ((functools.partial(model.apply, variables, method="step"),
                       model.initialize_state((3,))), (twin.step, twin.initialize_state((3,)))):
    with pytest.raises(ValueError, match=r"`x_t` of shape \(3, 1\) does not fit `state`: a step "
                       r"takes \(\*batch,\) tokens"):
      step(state, prompt[:, :1])
    with pytest.raises(ValueError, match=r"`state` is not a state of this model"):
      step(state[:1], prompt[:, 0])


def test_sampled_tokens_stay_in_the_top_k_of_the_model():
  model, variables, prompt = _token_model()
  tokens = layers.generate(model, variables, prompt, 8, rng=jax.random.key(2), temperature=5.0,
                           top_k=2)
  logits = model.apply(variables, jnp.concatenate([prompt, tokens], axis=1))[:, 3:-1]
  top2 = np.argsort(-np.asarray(logits), axis=-1)[..., :2]
  assert np.all((top2 == np.asarray(tokens)[..., None]).any(-1))


def test_each_sequence_stops_at_its_own_end_token():
  model, variables, prompt = _token_model()
  key = jax.random.key(4)
  free = np.asarray(layers.generate(model, variables, prompt, 12, rng=key))
  eos = int(free[0, 2])  # a token the first sequence reaches
  stopped = np.asarray(layers.generate(model, variables, prompt, 12, rng=key, eos_token=eos))
  for row, free_row in zip(stopped, free, strict=True):
    ends = np.flatnonzero(free_row == eos)
    end = ends[0] if ends.size else len(row)
    np.testing.assert_array_equal(row[: end + 1], free_row[: end + 1])
    assert np.all(row[end:] == eos)


class _TraceCountedLRU(layers.LRU):
  """LRU whose step counts how often it is traced (`chex.assert_max_traces`)."""

  def step(self, state, x_t, reset=None):
    _count_step_trace()
    return super().step(state, x_t, reset)


@chex.assert_max_traces(n=1)
def _count_step_trace():
  pass


def test_generate_compiles_once_per_model_and_shape_with_traced_temperature():
  model = _model(vocab_size=7, num_outputs=7, pooling="none", num_blocks=1,
                 layer=functools.partial(_TraceCountedLRU, d_state=4))
  prompt = jax.random.randint(jax.random.key(3), (2, 4), 0, 7)
  variables = compiled.init(model, prompt.shape, 0, "int32")
  chex.clear_trace_counter()
  for i, temperature in enumerate([0.5, 1.5, jnp.float32(0.0)]):
    layers.generate(model, variables, (prompt + i % 2) % 7, 5, rng=jax.random.key(i),
                    temperature=temperature, top_p=0.9, eos_token=i)
  # Inside a user's jit, a traced temperature of 0 is greedy as well.
  chex.clear_trace_counter()
  greedy = layers.generate(model, variables, prompt, 5, temperature=0.0)
  traced = jax.jit(lambda t: layers.generate(model, variables, prompt, 5, rng=jax.random.key(0),
                                             temperature=t))
  chex.clear_trace_counter()
  np.testing.assert_array_equal(traced(0.0), greedy)


@pytest.mark.parametrize(
    ("kwargs", "call", "match"),
    [
        ({"pooling": "max"}, {}, "pooling"),
        ({"norm": "group"}, {}, "norm"),
        ({"activation": "relu"}, {}, "activation"),
        ({}, {"mask": jnp.ones((2, 5), bool)}, "mask"),
        ({}, {"mask": jnp.ones((2, 6), jnp.int32)}, "mask"),
        ({}, {"mask": jnp.ones((6,), bool)}, "mask"),
        ({}, {"mask": jnp.ones((2, 6, 1), bool)}, "mask"),
        ({"vocab_size": 4}, {"x": jnp.ones((2, 6))}, "x"),
    ],
)
def test_bad_configuration_or_input_names_the_argument(kwargs, call, match):
  model = _model(**kwargs)
  x = call.pop("x", _x((2, 6, 2)))
  with pytest.raises(ValueError, match=match):
    model.init(jax.random.key(0), x, **call)


def test_step_and_generate_need_a_per_step_model():
  model = _model(pooling="mean")
  with pytest.raises(ValueError, match="pooling"):
    model.apply({}, model.initialize_state((2, 2)), jnp.ones((2, 2)), method="step")
  with pytest.raises(ValueError, match="vocab_size"):
    layers.generate(model, {}, jnp.zeros((1, 2), jnp.int32), 3, temperature=0.0)
