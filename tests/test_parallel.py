"""`ssmkit.layers.Parallel` (Falcon-H1's hybrid mixer) against its branches run as layers of
their own, each tested against its reference elsewhere; and a mixer block's `mlp_scales`
against the same block with the factors folded into its weights. The shared contract (modes,
steps, resets, streaming, gradients, NNX) runs on the registry's entry in test_layers.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compiled
from ssmkit import layers

BRANCHES = (functools.partial(layers.Mamba2, d_state=4, head_dim=3, n_groups=2, d_conv=3,
                              num_heads=4, gate_norm="gate"),
            functools.partial(layers.Attention, num_heads=2, num_kv_heads=1, head_dim=4,
                              window=6))
SCALES = {"input_scales": (1.1, 0.9), "output_scales": (0.6, 1.2)}


def _x(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _branch_params(params):
  """Each branch's own parameters, by the names its layer gives them."""
  own = {}
  for name, prefix in (("mamba", "mamba2_"), ("attention", "attention_")):
    own[name] = {"params": {key[len(prefix):]: value for key, value in params["params"].items()
                            if key.startswith(prefix)}}
  return own


def test_parallel_is_the_scaled_sum_of_its_branches_over_sequences_and_steps():
  layer = layers.Parallel(layers=BRANCHES, **SCALES)
  x = _x((2, 11, 6))
  reset = np.zeros((2, 11), bool)
  reset[0, 4] = reset[1, 8] = True
  params = compiled.init(layer, x.shape, 3)
  own = _branch_params(params)
  assert sum(map(len, (own["mamba"]["params"], own["attention"]["params"]))) == len(params["params"])
  mamba, attention = (make() for make in BRANCHES)
  y_m, s_m = compiled.run(mamba, return_state=True)(own["mamba"], 1.1 * x, reset)
  y_a, s_a = compiled.run(attention, return_state=True)(own["attention"], 0.9 * x, reset)
  y, state = compiled.run(layer, return_state=True)(params, x, reset)
  np.testing.assert_allclose(y, 0.6 * y_m + 1.2 * y_a, rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves((s_m, s_a)), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # One step from that state, against each branch's step.
  x_t = _x((2, 6), seed=5)
  state, y_t = compiled.run(layer, method="step")(params, state, x_t)
  _, y_m = compiled.run(mamba, method="step")(own["mamba"], s_m, 1.1 * x_t)
  _, y_a = compiled.run(attention, method="step")(own["attention"], s_a, 0.9 * x_t)
  np.testing.assert_allclose(y_t, 0.6 * y_m + 1.2 * y_a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("options", "message"), [
    ({"layers": ()}, "`layers` must be a non-empty tuple"),
    ({"layers": ("mamba2", "rwkv7")}, r"`layers`: \['rwkv7'\] name no branch"),
    ({"layers": (layers.RWKV7,)}, "RWKV7 cannot be a branch"),
    ({"layers": ("mamba2", layers.Mamba2)}, "must be of different kinds"),
    ({"input_scales": (1.0,)}, "`input_scales` must be 2 non-zero numbers"),
    ({"output_scales": (1.0, 0.0)}, "`output_scales` must be 2 non-zero numbers"),
    ({"layers": (functools.partial(layers.Mamba2, d_state=0), layers.Attention)},
     "`d_state` must be a positive int"),
])
def test_parallel_configurations_that_do_not_fit_are_named(options, message):
  with pytest.raises(ValueError, match=message):
    layers.Parallel(**options).init(jax.random.key(0), _x((1, 3, 8)))


def test_parallel_branches_by_name_take_their_default_options():
  named = layers.Parallel(layers=("short_conv", "lru"))
  made = layers.Parallel(layers=(layers.ShortConv, layers.LRU))
  x = _x((1, 5, 4))
  params = named.init(jax.random.key(1), x)
  np.testing.assert_array_equal(named.apply(params, x), made.apply(params, x))


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_mlp_scales_are_the_factors_folded_into_the_mlp_weights(mlp):
  """down(act(a gate(x)) up(x)) b is the MLP whose gate (or, ungated, up) kernel and bias are
  a times theirs and whose down kernel and bias are b times theirs."""
  a, b = 0.7, 1.9
  model = functools.partial(layers.SequenceModel, num_outputs=5, vocab_size=11, features=8,
                            num_blocks=2, layer=functools.partial(layers.ShortConv, d_conv=2),
                            block="mixer", mlp=mlp, mlp_expansion=1.5, mlp_bias=True,
                            pooling="none")
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 11, (2, 7)))
  params = model().init(jax.random.key(2), ids)
  inner = "mlp_gate" if mlp == "swiglu" else "mlp_up"
  folded = jax.tree_util.tree_map_with_path(
      lambda path, v: v * (a if inner in str(path) else b if "mlp_down" in str(path) else 1.0),
      params)
  np.testing.assert_allclose(model(mlp_scales=(a, b)).apply(params, ids),
                             model().apply(folded, ids), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="`mlp_scales` must be two numbers"):
    model(mlp_scales=(a,)).init(jax.random.key(0), ids)
  with pytest.raises(ValueError, match="`mlp_scales` is an option of mixer blocks"):
    model(mlp_scales=(a, b), block="ssm", mlp="none").init(jax.random.key(0), ids)
