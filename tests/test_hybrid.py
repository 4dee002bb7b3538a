"""`MixerBlock`, layer patterns, language-model heads and mixed precision: the block against its
formula in float64, hybrid models against themselves run another way (step by step, scanned,
each document alone, in float32)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import compiled
import ssmkit.nnx as snx
from ssmkit import layers
from ssmkit._src.layers.block import MLPS, Norm

ATTENTION = functools.partial(layers.Attention, num_heads=2, num_kv_heads=1, head_dim=4, window=5,
                              rope_fraction=0.5)
GLOBAL_ATTENTION = functools.partial(layers.Attention, num_heads=2, head_dim=4, cache_size=32)
RGLRU = functools.partial(layers.RGLRU, num_heads=2, d_conv=3)
DELTANET = functools.partial(layers.GatedDeltaNet, num_heads=2, d_conv=3)
# Griffin's pattern, and Qwen3-Next's (gated delta rule, then global attention).
PATTERNS = {"griffin": (RGLRU, RGLRU, ATTENTION), "deltanet-attention": (DELTANET, GLOBAL_ATTENTION)}
VOCAB = 11


def _x(shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _tokens(shape, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, shape).astype(np.int32)


def _assert_close(actual, expected, rtol=1e-5):
  scale = float(np.max(np.abs(np.asarray(expected, np.float64))))
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=rtol * scale)


def _rms_norm(p, u, eps=1e-6):
  u = np.asarray(u, np.float64)
  return u / np.sqrt(np.mean(u**2, -1, keepdims=True) + eps) * np.asarray(p["RMSNorm_0"]["scale"])


def _layer_norm(p, u, eps=1e-6):
  u = np.asarray(u, np.float64)
  normed = (u - u.mean(-1, keepdims=True)) / np.sqrt(u.var(-1, keepdims=True) + eps)
  return normed * np.asarray(p["LayerNorm_0"]["scale"]) + np.asarray(p["LayerNorm_0"]["bias"])


def _linear(p, u):
  y = np.asarray(u, np.float64) @ np.asarray(p["kernel"], np.float64)
  return y + np.asarray(p["bias"], np.float64) if "bias" in p else y


def _gelu_tanh(u):
  return 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))


def _silu(u):
  return u / (1 + np.exp(-u))


# The dense MLPs; the mixture of experts is tests/test_experts.py's.
@pytest.mark.parametrize("mlp", [mlp for mlp in MLPS if mlp != "experts"])
@pytest.mark.parametrize(("norm", "mlp_bias", "position"),
                         [("rms", False, "input"), ("layer", True, "input"), ("rms", True, "output")])
def test_mixer_block_matches_its_formula(mlp, norm, mlp_bias, position):
  """Pre-norm, or each norm on its branch's output (OLMo 2's)."""
  block = layers.MixerBlock(layer=ATTENTION, norm=norm, mlp=mlp, mlp_expansion=1.5,
                            mlp_bias=mlp_bias, norm_position=position)
  x = _x((2, 9, 8))
  params = compiled.init(block, x.shape)["params"]
  normalize = _rms_norm if norm == "rms" else _layer_norm
  mixer = lambda u: np.asarray(
      ATTENTION().apply({"params": params["mixer"]}, jnp.asarray(u, jnp.float32)), np.float64)
  x64 = np.asarray(x, np.float64)
  before, after = ((normalize, lambda p, u: u) if position == "input"
                   else (lambda p, u: u, normalize))
  h = x64 + after(params["norm"], mixer(before(params["norm"], x64)))
  expected = h
  if mlp != "none":
    u = before(params["mlp_norm"], h)
    if mlp == "gelu":
      hidden = _gelu_tanh(_linear(params["mlp_up"], u))
      assert "mlp_gate" not in params
    else:
      activation = _gelu_tanh if mlp == "geglu" else _silu
      hidden = activation(_linear(params["mlp_gate"], u)) * _linear(params["mlp_up"], u)
    assert hidden.shape[-1] == 12  # 1.5 x 8
    expected = h + after(params["mlp_norm"], _linear(params["mlp_down"], hidden))
  else:
    assert set(params) == {"norm", "mixer"}
  assert all(("bias" in p) == mlp_bias for name, p in params.items() if name.startswith("mlp_") and
             name != "mlp_norm")
  _assert_close(compiled.run(block)({"params": params}, x), expected, rtol=1e-4)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_a_norms_epsilon_is_the_one_given(kind):
  x = _x((3, 8)) * 0.1  # small, so that the epsilon matters
  norm = Norm(kind, eps=0.5)
  params = norm.init(jax.random.key(0), x)["params"]
  formula = _rms_norm if kind == "rms" else _layer_norm
  _assert_close(norm.apply({"params": params}, x), formula(params, x, eps=0.5), rtol=1e-5)


def test_norm_eps_reaches_every_norm_of_both_front_ends():
  """`norm_eps` sets the blocks' norms before the mixer and the MLP and the final norm, in
  linen and in the NNX twin that `from_linen` makes (whose outputs are linen's)."""
  model = _model(num_blocks=2, norm_eps=0.5)
  x = _tokens((2, 7))
  variables = compiled.init(model, x.shape, 0, "int32")
  seen = []

  def record(call, args, kwargs, context):
    if isinstance(context.module, nn.RMSNorm) and context.method_name == "__call__":
      seen.append(context.module.epsilon)
    return call(*args, **kwargs)

  with nn.intercept_methods(record):
    y = model.apply(variables, x)
  assert seen == [0.5] * 5
  twin = snx.from_linen(model, variables)
  assert [n.epsilon for _, n in nnx.iter_graph(twin) if isinstance(n, nnx.RMSNorm)] == [0.5] * 5
  _assert_close(twin(x), y, rtol=1e-5)
  assert snx.to_linen(twin)[0].norm_eps == 0.5
  with pytest.raises(ValueError, match=r"`norm_eps` must be > 0 or None, got 0.0"):
    compiled.init(_model(num_blocks=2, norm_eps=0.0), x.shape, 0, "int32")
  for value in (3, -1, 1.0, True):  # at least one place of the pattern of 3 must cycle
    with pytest.raises(ValueError, match=rf"`head_blocks` must be an int .* \(2\), got {value}"):
      compiled.init(_model(num_blocks=2, head_blocks=value), x.shape, 0, "int32")
    with pytest.raises(ValueError, match=r"`head_blocks` must be an int"):
      snx.SequenceModel(None, VOCAB, vocab_size=VOCAB, layer=PATTERNS["griffin"], head_blocks=value,
                        rngs=nnx.Rngs(0))
  for name, value in (("dtype", "bfloat17"), ("dtype", "int32"), ("param_dtype", None)):
    with pytest.raises(ValueError, match=rf"`{name}` must be a floating dtype .* got {value!r}"):
      compiled.init(_model(num_blocks=2, **{name: value}), x.shape, 0, "int32")
    with pytest.raises(ValueError, match=rf"`{name}` must be a floating dtype"):
      snx.SequenceModel(None, VOCAB, vocab_size=VOCAB, **{name: value}, rngs=nnx.Rngs(0))


def _model(pattern="griffin", **kwargs):
  config = dict(num_outputs=VOCAB, layer=PATTERNS[pattern], features=8, num_blocks=4,
                vocab_size=VOCAB, pooling="none", block="mixer", norm="rms", mlp="swiglu",
                mlp_expansion=2.0)
  return layers.SequenceModel(**{**config, **kwargs})


# (pattern, scan_blocks, num_blocks, head_blocks): unrolled; scanned with a tail (4 = 3 + 1);
# scanned whole; scanned with a head, repeats and a tail (6 = 1 + 2 x 2 + 1).
HYBRIDS = [("griffin", False, 4, 0), ("griffin", True, 4, 0), ("deltanet-attention", True, 4, 0),
           ("griffin", True, 6, 1)]


@pytest.mark.parametrize(("pattern", "scan_blocks", "num_blocks", "head_blocks"), HYBRIDS)
def test_hybrid_sequence_equals_stepping_from_a_prefill_with_resets(pattern, scan_blocks, num_blocks,
                                                                    head_blocks):
  """A prompt's final state, then a continuation stepped from it (attention caches and recurrent
  states in one pytree), equals the continuation run as one sequence from that state."""
  model = _model(pattern, scan_blocks=scan_blocks, num_blocks=num_blocks, head_blocks=head_blocks)
  prompt, x = _tokens((3, 6), 1), _tokens((3, 13), 2)
  reset = np.random.default_rng(3).random((3, 13)) < 0.2
  variables = compiled.init(model, x.shape, 0, "int32")
  run = compiled.run(model, return_state=True)
  _, start = run(variables, prompt)
  assert jax.tree.structure(start) == jax.tree.structure(model.initialize_state((3,)))
  step = compiled.run(model, method="step")
  state, stepped = start, []
  for t in range(x.shape[1]):
    state, y_t = step(variables, state, x[:, t], reset[:, t])
    stepped.append(y_t)
  y, last = run(variables, x, reset=reset, initial_state=start)
  _assert_close(y, jnp.stack(stepped, axis=1), rtol=1e-4)
  for got, want in zip(jax.tree.leaves(last), jax.tree.leaves(state), strict=True):
    _assert_close(got, want, rtol=1e-4)
  # And from the zero state, the whole of prompt and continuation as one sequence.
  whole = np.concatenate([prompt, x], axis=1)
  joined_reset = np.concatenate([np.zeros((3, 6), bool), reset], axis=1)
  _assert_close(compiled.run(model)(variables, whole, None, joined_reset)[:, 6:], y, rtol=1e-4)


def _restacked(unrolled, pattern_length, num_blocks, head=0):
  """The parameters of an unrolled model laid out as the scanned model holds them."""
  params = dict(unrolled)
  blocks = [params.pop(f"block_{i}") for i in range(num_blocks)]
  stack = lambda trees: jax.tree.map(lambda *b: jnp.stack(b), *trees)
  if head:
    params["head"] = {f"block_{j}": stack([blocks[j]]) for j in range(head)}
  blocks, size = blocks[head:], pattern_length - head
  repeats, rest = divmod(len(blocks), size)
  params["blocks"] = {f"block_{j}": stack(blocks[j:repeats * size:size]) for j in range(size)}
  if rest:
    params["tail"] = {f"block_{j}": stack([blocks[repeats * size + j]]) for j in range(rest)}
  return params


@pytest.mark.parametrize(("num_blocks", "head_blocks"), [(3, 0), (5, 0), (6, 1)])
def test_scanned_pattern_equals_the_unrolled_blocks(num_blocks, head_blocks):
  """Block i of the unrolled model is repeat i // 3 of pattern position i % 3 in the scan; with
  a head of one, block 0 is the head's and blocks 1, 2, ... cycle over positions 1 and 2, as in
  the unrolled model given those places one per block."""
  unrolled = _model(num_blocks=num_blocks, head_blocks=head_blocks)
  scanned = _model(num_blocks=num_blocks, head_blocks=head_blocks, scan_blocks=True)
  x = _tokens((2, 12))
  params = compiled.init(unrolled, x.shape, 0, "int32")["params"]
  stacked = _restacked(params, 3, num_blocks, head_blocks)
  assert (jax.tree.structure(stacked)
          == jax.tree.structure(compiled.init(scanned, x.shape, 0, "int32")["params"]))
  want = compiled.run(unrolled)({"params": params}, x)
  _assert_close(compiled.run(scanned)({"params": stacked}, x), want, rtol=1e-4)
  if head_blocks:
    rglru, _, attention = PATTERNS["griffin"]
    places = _model(num_blocks=num_blocks, layer=(rglru, rglru, attention, rglru, attention, rglru))
    _assert_close(compiled.run(places)({"params": params}, x), want, rtol=1e-6)


def test_packed_documents_equal_each_document_alone():
  """A reset starts a document for every block: attention, its rotary positions, the recurrences."""
  model = _model("griffin", scan_blocks=True)
  lengths = [4, 1, 7, 5]
  tokens = _tokens((1, sum(lengths)), 5)
  starts = np.cumsum([0, *lengths[:-1]])
  reset = np.zeros((1, sum(lengths)), bool)
  reset[0, starts] = True
  variables = compiled.init(model, tokens.shape, 0, "int32")
  run = compiled.run(model)
  packed = run(variables, tokens, None, reset)
  for start, n in zip(starts, lengths, strict=True):
    # Each document alone at the start of a row (what follows it, a causal model never reads),
    # through the one compiled program.
    alone = np.zeros_like(tokens)
    alone[:, :n] = tokens[:, start:start + n]
    _assert_close(packed[:, start:start + n], run(variables, alone, None, np.zeros_like(reset))[:, :n],
                  rtol=1e-4)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_greedy_generation_equals_rerunning_the_whole_sequence(pattern):
  model = _model(pattern, num_blocks=3 if pattern == "deltanet-attention" else 4, scan_blocks=True)
  prompt = _tokens((2, 4), 6)
  variables = compiled.init(model, prompt.shape, 0, "int32")
  generated = layers.generate(model, variables, prompt, 9, temperature=0.0)
  tokens = np.concatenate([prompt, np.asarray(generated)], axis=1)
  rerun = np.argmax(compiled.run(model)(variables, tokens)[:, 3:-1], axis=-1)
  np.testing.assert_array_equal(generated, rerun)


def test_generation_past_a_global_attention_cache_is_refused():
  """The last token reads P + N - 1 keys: up to `cache_size`, never a silently shortened cache."""
  model = _model("deltanet-attention", num_blocks=2)  # global attention, cache_size=32
  prompt = _tokens((1, 30))
  variables = compiled.init(model, prompt.shape, 0, "int32")
  assert layers.generate(model, variables, prompt, 3, temperature=0.0).shape == (1, 3)
  message = r"`prompt` \(30 tokens\) and `num_steps` \(4\) reach past .* \(32 entries"
  with pytest.raises(ValueError, match=message):
    layers.generate(model, variables, prompt, 4, temperature=0.0)
  twin = snx.SequenceModel(None, VOCAB, vocab_size=VOCAB, pooling="none", features=8,
                           layer=functools.partial(snx.Attention, num_heads=2, cache_size=16),
                           rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"\(16 entries: `cache_size`\)"):
    snx.generate(twin, prompt[:, :10], 8, temperature=0.0)


def test_lm_head_ties_scales_and_caps():
  """Each head option against the plain head with the parameters it stands for."""
  plain = _model(num_blocks=3)
  x = _tokens((2, 7))
  params = compiled.init(plain, x.shape, 0, "int32")["params"]
  table = params["encoder"]["embedding"]
  logits = compiled.run(plain)({"params": params}, x)
  # Tied: the decoder is the embedding's transpose, without a bias.
  tied = _model(num_blocks=3, tie_embeddings=True)
  tied_params = {name: p for name, p in params.items() if name != "decoder"}
  assert (jax.tree.structure(tied_params)
          == jax.tree.structure(compiled.init(tied, x.shape, 0, "int32")["params"]))
  untied = {**params, "decoder": {"kernel": table.T, "bias": jnp.zeros(VOCAB)}}
  _assert_close(compiled.run(tied)({"params": tied_params}, x),
                compiled.run(plain)({"params": untied}, x))
  # Scaled: as the plain model with the embedding table times sqrt(8).
  scaled = _model(num_blocks=3, scale_embeddings=True)
  bigger = {**params, "encoder": {"embedding": table * np.sqrt(8)}}
  _assert_close(compiled.run(scaled)({"params": params}, x),
                compiled.run(plain)({"params": bigger}, x))
  # Capped: cap * tanh(logits / cap).
  capped = _model(num_blocks=3, logit_cap=0.5)
  got = compiled.run(capped)({"params": params}, x)
  _assert_close(got, 0.5 * np.tanh(np.asarray(logits, np.float64) / 0.5))
  assert np.max(np.abs(got)) < 0.5


def test_hybrid_gradients_are_finite_and_reach_every_block():
  model = _model(scan_blocks=True, dropout_rate=0.1)
  x = _tokens((2, 9))
  variables = compiled.init(model, x.shape, 0, "int32")

  @jax.jit
  def loss(params):
    logits = model.apply({"params": params}, x[:, :-1], train=True, rngs={"dropout": jax.random.key(1)})
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), x[:, 1:, None], -1))

  grads = jax.grad(loss)(variables["params"])
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  for part in ("blocks", "tail"):
    for name, tree in grads[part].items():
      assert any(np.any(g != 0) for g in jax.tree.leaves(tree)), (part, name)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_bfloat16_computation_tracks_float32_with_float32_parameters(pattern):
  """`dtype=bfloat16`: the same parameters (float32, unchanged), activations in bfloat16, and
  outputs, steps and gradients within bfloat16's rounding of the float32 model's."""
  full = _model(pattern, num_blocks=3, scan_blocks=True)
  mixed = _model(pattern, num_blocks=3, scan_blocks=True, dtype=jnp.bfloat16)
  x, reset = _tokens((2, 12), 7), np.random.default_rng(8).random((2, 12)) < 0.2
  variables = compiled.init(mixed, x.shape, 0, "int32")
  assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
  assert (jax.tree.structure(variables)
          == jax.tree.structure(compiled.init(full, x.shape, 0, "int32")))
  y_full = np.asarray(compiled.run(full)(variables, x, None, reset), np.float32)
  y_mixed = compiled.run(mixed)(variables, x, None, reset)
  assert y_mixed.dtype == jnp.bfloat16
  scale = np.abs(y_full).max()
  assert np.abs(np.asarray(y_mixed, np.float32) - y_full).max() < 0.05 * scale
  # Step by step in bfloat16, as the sequence in bfloat16.
  step = compiled.run(mixed, method="step")
  state, stepped = mixed.initialize_state((2,)), []
  for t in range(x.shape[1]):
    state, y_t = step(variables, state, x[:, t], reset[:, t])
    stepped.append(np.asarray(y_t, np.float32))
  assert np.abs(np.stack(stepped, 1) - np.asarray(y_mixed, np.float32)).max() < 0.05 * scale

  def gradient(model):
    loss = lambda p: jnp.mean(jnp.square(model.apply({"params": p}, x, None, reset).astype(jnp.float32)))
    return jax.jit(jax.grad(loss))(variables["params"])

  g_full, g_mixed = (np.concatenate([np.ravel(g) for g in jax.tree.leaves(gradient(m))])
                     for m in (full, mixed))
  assert g_mixed.dtype == np.float32 and np.all(np.isfinite(g_mixed))
  cosine = g_full @ g_mixed / np.linalg.norm(g_full) / np.linalg.norm(g_mixed)
  assert cosine > 0.99


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block": "transformer"}, "`block`"),
        ({"mlp": "relu"}, "`mlp`"),
        ({"block": "ssm", "mlp": "geglu"}, "`mlp` needs block='mixer'"),
        ({"prenorm": False}, "`prenorm`"),
        ({"tie_embeddings": True, "num_outputs": 3}, "`tie_embeddings`"),
        ({"tie_embeddings": True, "vocab_size": None}, "`tie_embeddings`"),
        ({"scale_embeddings": True, "vocab_size": None, "num_outputs": 3}, "`scale_embeddings`"),
        ({"logit_cap": 0.0}, "`logit_cap`"),
        ({"layer": ()}, "`layer`"),
        ({"layer": (RGLRU, "attention")}, "`layer`"),
        ({"scan_blocks": True, "num_blocks": 2}, "`num_blocks` >= the length of the layer pattern"),
        ({"norm_position": "middle"}, "`norm_position` must be one of"),
        ({"norm_position": ("input", "output")}, r"one per layer of the pattern \(3\)"),
        ({"norm_position": "output", "block": "ssm", "mlp": "none"},
         "`norm_position` is an option of mixer blocks"),
    ],
)
def test_bad_options_name_the_option(kwargs, match):
  model = _model(**kwargs)
  x = _x((2, 5, 3)) if "vocab_size" in kwargs else _tokens((2, 5))
  with pytest.raises(ValueError, match=match):
    model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=match):
    model.initialize_state((2,))
