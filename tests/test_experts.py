"""The mixture of experts against a float64 NumPy loop over tokens, and against a dense JAX form
(every expert on every token, weighted by the chosen weights) for gradients."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ssmkit.nnx as snx
from ssmkit import layers, train
from ssmkit._src.layers import experts as moe
from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.core.model import TrainState, build_model, parameter_labels
from ssmkit._src.train.supervised import steps

CONFIGS = {
    # Qwen3-Next's: softmax, renormalised top-k, a shared expert behind a sigmoid gate.
    "softmax-shared-gate": layers.Experts(num_experts=4, top_k=2, width=6, shared_width=5,
                                          shared_gate=True),
    # Nemotron-H's (DeepSeek-V3's with SwiGLU experts): sigmoid scores, a score bias for the
    # choice, grouped choice, routed scaling; squared-ReLU experts and shared expert.
    "sigmoid-grouped-bias-relu2": layers.Experts(
        num_experts=8, top_k=3, width=4, scoring="sigmoid", score_bias=True, groups=4,
        top_groups=2, routed_scale=2.5, shared_width=3, activation="relu2"),
    # Jamba's: softmax top-k without renormalisation, no shared expert.
    "softmax-plain": layers.Experts(num_experts=5, top_k=1, width=3, normalize=False),
}


def _params(config, features, seed=0):
  rng = np.random.default_rng(seed)
  specs = moe.param_specs(config, features)
  return {name: rng.normal(size=spec.shape) for name, spec in specs.items()}


def _mlp(config, x, p, prefix=""):
  if config.activation == "relu2":
    return np.maximum(x @ p[f"{prefix}up"], 0) ** 2 @ p[f"{prefix}down"]
  g = x @ p[f"{prefix}gate"]
  return (g / (1 + np.exp(-g)) * (x @ p[f"{prefix}up"])) @ p[f"{prefix}down"]


def _reference(config, p, x):
  """Token by token: scores, the choice, the weights, the chosen experts and the shared one."""
  y = np.zeros_like(x)
  counts, mean = np.zeros(config.num_experts), np.zeros(config.num_experts)
  for n, token in enumerate(x):
    logits = token @ p["router"]
    if config.scoring == "softmax":
      scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    else:
      scores = 1 / (1 + np.exp(-logits))
    choice = scores + p["score_bias"] if config.score_bias else scores.copy()
    if config.groups > 1:
      grouped = choice.reshape(config.groups, -1)
      group_scores = np.sort(grouped, axis=1)[:, -2:].sum(1)
      kept = np.argsort(-group_scores)[:config.top_groups]
      choice = np.where(np.isin(np.arange(config.groups), kept)[:, None], grouped, -np.inf).ravel()
    chosen = np.argsort(-choice)[:config.top_k]
    weights = scores[chosen]
    if config.normalize:
      weights = weights / weights.sum()
    weights = weights * config.routed_scale
    for e, w in zip(chosen, weights, strict=True):
      y[n] += w * _mlp(config, token, {name: p[name][e] for name in ("gate", "up", "down")
                                       if name in p})
      counts[e] += 1
    mean += scores
    if config.shared_width:
      shared = _mlp(config, token, p, "shared_")
      if config.shared_gate:
        shared = shared / (1 + np.exp(-(token @ p["shared_router"])))
      y[n] += shared
  balance = config.num_experts * np.sum(counts / len(x) * mean / len(x)) / config.top_k
  return y, balance


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tokens", [1, 37])
def test_the_mixture_is_the_token_by_token_loop(name, tokens):
  config, features = CONFIGS[name], 7
  params = _params(config, features)
  x = np.random.default_rng(1).normal(size=(tokens, features))
  want, balance = _reference(config, params, x)
  got, got_balance = jax.jit(functools.partial(moe.mixture, config, dtype=jnp.float64))(params, x)
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(got_balance, balance, rtol=1e-12)


def _dense(config, params, x):
  """Every expert on every token, weighted by the chosen weights (zero elsewhere)."""
  weights, chosen, _ = moe.route(config, params, x)
  dense = jnp.zeros((x.shape[0], config.num_experts), x.dtype).at[
      jnp.arange(x.shape[0])[:, None], chosen].set(weights.astype(x.dtype))
  up = jnp.einsum("nh,ehi->nei", x, params["up"])
  if config.activation == "relu2":
    hidden = jnp.square(jax.nn.relu(up))
  else:
    hidden = jax.nn.silu(jnp.einsum("nh,ehi->nei", x, params["gate"])) * up
  y = jnp.einsum("ne,neh->nh", dense, jnp.einsum("nei,eih->neh", hidden, params["down"]))
  if config.shared_width:
    up = x @ params["shared_up"]
    hidden = (jnp.square(jax.nn.relu(up)) if config.activation == "relu2"
              else jax.nn.silu(x @ params["shared_gate"]) * up)
    shared = hidden @ params["shared_down"]
    if config.shared_gate:
      shared = shared * jax.nn.sigmoid(x @ params["shared_router"])
    y = y + shared
  return y


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_and_jvp_are_those_of_the_dense_form(name):
  config = CONFIGS[name]
  params = jax.tree.map(jnp.asarray, _params(config, 7))
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 11, 7)))
  cotangent = jnp.asarray(np.random.default_rng(3).normal(size=x.shape))
  sparse = lambda p, x: jnp.sum(moe.mixture(config, p, x, jnp.float64)[0] * cotangent)
  dense = lambda p, x: jnp.sum(_dense(config, p, x.reshape(-1, 7)).reshape(x.shape) * cotangent)
  tangents = jax.tree.map(jnp.ones_like, (params, x))
  both = jax.jit(lambda f: (jax.grad(f, (0, 1))(params, x), jax.jvp(f, (params, x), tangents)[1]),
                 static_argnums=0)
  (got, got_tangent), (want, want_tangent) = both(sparse), both(dense)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-10, atol=1e-12), got, want)
  np.testing.assert_allclose(got_tangent, want_tangent, rtol=1e-10)


def test_vmap_over_an_ensemble_and_no_tokens():
  config = CONFIGS["softmax-shared-gate"]
  ensemble = [jax.tree.map(jnp.asarray, _params(config, 7, seed)) for seed in range(3)]
  x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 5, 7)))
  run = jax.jit(lambda params, x: moe.mixture(config, params, x, jnp.float64)[0])
  got = jax.vmap(run)(jax.tree.map(lambda *a: jnp.stack(a), *ensemble), x)
  for i, params in enumerate(ensemble):
    np.testing.assert_allclose(got[i], run(params, x[i]), rtol=1e-12, atol=1e-12)
  # Over tokens with shared parameters, jax's ragged_dot has no batching rule: named, with the
  # way around it, where the mixture is traced under `vmap`. A function jitted before `vmap`
  # meets it already traced, and keeps jax's own error.
  shared = lambda x: moe.mixture(config, ensemble[0], x, jnp.float64)[0]
  with pytest.raises(NotImplementedError, match=r"`jax.vmap` over its tokens.*leading axis"):
    jax.vmap(shared)(x)
  for config in CONFIGS.values():  # the grouped choice too
    y, balance = moe.mixture(config, _params(config, 7), jnp.zeros((2, 0, 7)), jnp.float64)
    assert y.shape == (2, 0, 7) and balance == 0


def _model(**options):
  return layers.SequenceModel(
      num_outputs=12, vocab_size=12, features=8, num_blocks=2, block="mixer", norm="rms",
      mlp="experts", layer=functools.partial(layers.Attention, num_heads=2), pooling="none",
      experts=layers.Experts(num_experts=4, top_k=2, width=6, shared_width=4, shared_gate=True,
                             balance_weight=0.01), **options)


def test_a_model_of_experts_in_both_front_ends_scanned_or_not():
  """linen unrolled == linen scanned == NNX, with the load-balancing losses sown per block and
  none left from `init`."""
  model, scanned = _model(), _model(scan_blocks=True)
  x = jnp.asarray(np.random.default_rng(5).integers(0, 12, (2, 9)))
  variables = model.init(jax.random.key(0), x)
  assert set(variables) == {"params"}
  sowing = lambda model: jax.jit(lambda v, x: model.apply(v, x, mutable=["aux_loss"]))
  y, sown = sowing(model)(variables, x)
  losses = [block["mlp_experts"]["load_balancing"][0] for block in sown["aux_loss"].values()]
  assert len(losses) == 2 and all(0.01 <= float(loss) <= 0.01 * 4 for loss in losses)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *(variables["params"][f"block_{i}"]
                                                    for i in range(2)))
  rest = {k: v for k, v in variables["params"].items() if not k.startswith("block_")}
  y_scanned, sown_scanned = sowing(scanned)({"params": {**rest, "blocks": {"block": stacked}}}, x)
  np.testing.assert_allclose(y_scanned, y, rtol=1e-12)
  np.testing.assert_allclose(jax.tree.leaves(sown_scanned)[0], losses, rtol=1e-12)
  twin = snx.from_linen(model, variables)
  np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(twin, x), y)
  again, values = snx.to_linen(twin)
  np.testing.assert_array_equal(jax.jit(again.apply)(values, x), y)


def test_bfloat16_tracks_float32():
  model = _model()
  x = jnp.asarray(np.random.default_rng(6).integers(0, 12, (2, 9)))
  with jax.enable_x64(False):
    variables = model.init(jax.random.key(0), x)
    want = jax.jit(model.apply)(variables, x)
    got = jax.jit(model.clone(dtype=jnp.bfloat16).apply)(variables, x)
  assert got.dtype == jnp.bfloat16
  assert float(jnp.abs(got.astype(jnp.float32) - want).max() / jnp.abs(want).max()) < 0.05


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(top_k=5, num_experts=4), r"`top_k`=5 must be at most `num_experts`=4"),
        (dict(groups=3), r"`groups`=3 must divide `num_experts`=8"),
        (dict(groups=4, top_groups=1, top_k=3), r"`top_k`=3 must be at most the experts"),
        (dict(scoring="relu"), r"`scoring` must be one of \('softmax', 'sigmoid'\)"),
        (dict(activation="gelu"), r"`activation` must be one of \('swiglu', 'relu2'\)"),
        (dict(shared_gate=True), r"`shared_gate` gates the shared experts: it needs"),
        (dict(shared_width=-1), r"`shared_width` must be an int >= 0"),
        (dict(width=0), r"`width` must be a positive int"),
        (dict(routed_scale=0.0), r"`routed_scale` must be > 0"),
    ],
)
def test_bad_experts_are_named(options, message):
  with pytest.raises(ValueError, match=message):
    layers.Experts(**options)


def test_experts_and_their_mlp_kind_go_together():
  x = jnp.zeros((1, 3), jnp.int32)
  for model, message in [
      (_model().clone(experts=None), r"`experts` is the mixture of `mlp='experts'`"),
      (_model().clone(mlp="swiglu"), r"`experts` is the mixture of `mlp='experts'`"),
      (_model().clone(experts="four"), r"`experts` must be an ssmkit.layers.Experts"),
  ]:
    with pytest.raises(ValueError, match=message):
      model.init(jax.random.key(0), x)


def test_a_train_step_descends_the_cross_entropy_plus_the_load_balancing_losses():
  """With plain SGD at rate 1 the step's update is minus the gradient: that of the mean
  cross-entropy plus every block's sown, weighted load-balancing loss."""
  model = _model()
  x = jnp.asarray(np.random.default_rng(7).integers(0, 12, (2, 9)))
  batch = {"x": x, "y": jnp.roll(x, -1, axis=1)}
  params = model.init(jax.random.key(0), x)["params"]
  state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(1.0), batch_stats={})

  def losses(params):
    logits, sown = model.apply({"params": params}, x, mutable=["aux_loss"])
    cross = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return cross, sum(jnp.sum(leaf) for leaf in jax.tree.leaves(sown))

  stepped, _ = jax.jit(steps.train_step)(state, batch, jax.random.key(1))
  moved = jax.tree.map(lambda a, b: a - b, params, stepped.params)
  both, cross = jax.jit(lambda p: (jax.grad(lambda p: sum(losses(p)))(p),
                                   jax.grad(lambda p: losses(p)[0])(p)))(params)
  # float32 parameters: the update is read back to their rounding.
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6), moved, both)
  router = lambda p: p["block_0"]["mlp_experts"]["router"]
  assert np.abs(router(moved) - router(cross)).max() > 1e-4  # the balance term moved it


def test_an_lm_config_with_experts_builds_and_names_bad_fields():
  overrides = ["model.block=mixer", "model.mlp=experts", "model.features=8", "model.num_blocks=1",
               "model.experts={num_experts: 4, top_k: 2, width: 8, balance_weight: 0.01, "
               "score_bias: true}"]
  config = train.load_config("lm_hybrid", overrides)
  model = build_model(config.model, 16, 16)
  assert model.experts == layers.Experts(num_experts=4, top_k=2, width=8, balance_weight=0.01,
                                         score_bias=True)
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 3), jnp.int32))["params"]
  labels = parameter_labels(params, list(config.model.layer))
  experts = labels["block_0"]["mlp_experts"]
  assert (experts["router"], experts["score_bias"]) == ("decay", "no_decay")
  for bad, message in [("model.experts={top_k: 9}", r"`model.experts.top_k`=9 must be at most"),
                       ("model.experts={many: 3}", r"`model.experts` must map fields of ssmkit"),
                       ("model.experts=null", r"`model.experts` is the mixture of")]:
    with pytest.raises(ConfigError, match=message):
      build_model(train.load_config("lm_hybrid", [*overrides, bad]).model, 16, 16)


def _gelu_tanh(u):
  return 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))


@pytest.mark.parametrize("kind", ["gelu", "geglu", "swiglu", "relu2"])
def test_a_feed_forward_layer_is_its_formula_on_every_step(kind):
  layer = layers.FeedForward(kind=kind, width=5, use_bias=True)
  x = np.random.default_rng(8).normal(size=(2, 7, 4))
  params = jax.jit(layer.init)(jax.random.key(0), x)["params"]
  p = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
  dense = lambda u, name: u @ p[f"{name}_proj"] + p[f"{name}_bias"]
  act = {"gelu": _gelu_tanh, "geglu": _gelu_tanh, "swiglu": lambda u: u / (1 + np.exp(-u)),
         "relu2": lambda u: np.maximum(u, 0) ** 2}[kind]
  hidden = act(dense(x, "gate")) * dense(x, "up") if "gate_proj" in p else act(dense(x, "up"))
  np.testing.assert_allclose(jax.jit(layer.apply)({"params": params}, x), dense(hidden, "down"),
                             rtol=1e-10, atol=1e-12)


def test_a_feed_forward_layer_of_experts_is_the_mixture_and_sows_its_loss():
  """linen and NNX; NNX keeps the last call's loss, in one shape whatever the number of calls."""
  config = CONFIGS["sigmoid-grouped-bias-relu2"]
  config = dataclasses.replace(config, balance_weight=0.5)
  layer = layers.FeedForward(kind="experts", experts=config)
  x = jnp.asarray(np.random.default_rng(9).normal(size=(2, 7, 6)))
  variables = jax.jit(layer.init)(jax.random.key(0), x)
  y, sown = jax.jit(lambda v, x: layer.apply(v, x, mutable=["aux_loss"]))(variables, x)
  want, balance = moe.mixture(config, variables["params"], x, jnp.float64)
  np.testing.assert_array_equal(y, want)
  np.testing.assert_allclose(sown["aux_loss"]["load_balancing"][0], 0.5 * balance, rtol=1e-12)
  twin = snx.from_linen(layer, variables)
  run = nnx.jit(lambda m, x: m(x))
  for _ in range(2):
    np.testing.assert_array_equal(run(twin, x), y)
  kept = nnx.state(twin, nnx.Intermediate)["load_balancing"]
  np.testing.assert_allclose(kept[...], 0.5 * balance, rtol=1e-12)
  with pytest.raises(ValueError, match=r"`experts` is the mixture of kind='experts'"):
    layers.FeedForward(kind="swiglu", experts=config).init(jax.random.key(0), x)
