"""`Attention` against a float64 NumPy loop written from the definitions: grouped heads,
windows, partial rotary positions, soft-capping, document resets, and the key/value cache."""

import functools

import jax
import numpy as np
import pytest

import compiled
from ssmkit import layers
from ssmkit._src.layers import attention


def _rms(x, scale, eps=1e-5):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rotate(x, position, width, base):
  """The first `width` channels of `x` `(heads, D)` turned: channel i with i + width / 2."""
  half = width // 2
  out = x.copy()
  for i in range(half):
    angle = position * base ** (-2.0 * i / width)
    a, b = x[:, i], x[:, i + half]
    out[:, i] = a * np.cos(angle) - b * np.sin(angle)
    out[:, i + half] = b * np.cos(angle) + a * np.sin(angle)
  return out


def _reference(layer, params, x, reset):
  """Causal attention over `(T, F)` inputs, one query at a time, in float64."""
  p = {name: np.asarray(value, np.float64) for name, value in params["params"].items()}
  length, features = x.shape
  heads = layer.num_heads
  kv = layer.num_kv_heads or heads
  head_dim = layer.head_dim or features // heads
  width = int(head_dim * layer.rope_fraction) // 2 * 2

  def project(name, count):
    y = x @ p[f"{name}_proj"] + p.get(f"{name}_bias", 0.0)
    return y.reshape(length, count, head_dim)

  q, k, v = project("q", heads), project("k", kv), project("v", kv)
  if layer.qk_norm:
    offset = 1.0 if layer.qk_norm == "rms_plus_one" else 0.0
    if layer.qk_norm_scope == "all":  # every head's channels together
      q = _rms(q.reshape(length, -1), offset + p["q_norm"], layer.qk_norm_eps).reshape(q.shape)
      k = _rms(k.reshape(length, -1), offset + p["k_norm"], layer.qk_norm_eps).reshape(k.shape)
    else:
      q = _rms(q, offset + p["q_norm"], layer.qk_norm_eps)
      k = _rms(k, offset + p["k_norm"], layer.qk_norm_eps)
  starts = [max([s for s in range(t + 1) if reset[s]], default=0) for t in range(length)]
  for t in range(length):
    q[t] = _rotate(q[t], t - starts[t], width, layer.rope_base)
    k[t] = _rotate(k[t], t - starts[t], width, layer.rope_base)
  out = np.zeros((length, heads, head_dim))
  for t in range(length):
    first = starts[t] if layer.window is None else max(starts[t], t - layer.window + 1)
    for n in range(heads):
      group = n // (heads // kv)
      logits = k[first:t + 1, group] @ q[t, n] * (layer.scale or head_dim**-0.5)
      if layer.logit_cap is not None:
        logits = layer.logit_cap * np.tanh(logits / layer.logit_cap)
      weights = np.exp(logits - logits.max())
      out[t, n] = weights / weights.sum() @ v[first:t + 1, group]
  if layer.output_gate:
    out = out / (1 + np.exp(-project("gate", heads)))
  return out.reshape(length, heads * head_dim) @ p["o_proj"] + p.get("o_bias", 0.0)


CONFIGS = {
    "gqa-window-partial-rotary": dict(num_heads=4, num_kv_heads=2, head_dim=6, window=7,
                                      rope_fraction=0.5, rope_base=100.0),
    "mha-global-qk-norm-cap-bias": dict(num_heads=2, head_dim=4, qk_norm=True, logit_cap=2.0,
                                        use_bias=True),
    # OLMo 2's and OLMo Hybrid's: one norm over all heads' queries, one over the keys.
    "gqa-qk-norm-over-all-heads": dict(num_heads=4, num_kv_heads=2, head_dim=4, qk_norm=True,
                                       qk_norm_scope="all", qk_norm_eps=1e-2),
    "mqa-no-rotary-window-one": dict(num_heads=3, num_kv_heads=1, head_dim=2, window=1,
                                     rope_fraction=0.0),
    # Qwen3-Next's and Qwen3.5's: an output gate, (1 + w) query and key norms, a quarter
    # rotary; and a logit scale of its own (Granite's attention multiplier).
    "gqa-gated-plus-one-qk-norm-scaled": dict(
        num_heads=4, num_kv_heads=2, head_dim=8, output_gate=True, qk_norm="rms_plus_one",
        qk_norm_eps=1e-6, rope_fraction=0.25, use_bias=True, scale=0.2),
}


def _x(shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _assert_close(actual, expected, rtol=1e-5):
  scale = float(np.max(np.abs(expected)))
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_the_float64_loop_with_resets(name):
  layer = layers.Attention(**CONFIGS[name])
  x = _x((2, 23, 6))
  reset = np.random.default_rng(1).uniform(size=(2, 23)) < 0.15
  params = compiled.init(layer, x.shape, 2)
  params = jax.tree.map(lambda v: 2 * v, params)  # sharper attention than at initialisation
  y = compiled.run(layer)(params, x, reset)
  for row in range(2):
    _assert_close(y[row], _reference(layer, params, np.asarray(x[row], np.float64), reset[row]))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_documents_equal_each_document_alone(name):
  layer = layers.Attention(**CONFIGS[name])
  lengths = (5, 1, 11, 6)
  x = _x((sum(lengths), 6), seed=3)
  reset = np.zeros(sum(lengths), bool)
  reset[np.cumsum((0, *lengths[:-1]))] = True
  params = compiled.init(layer, x.shape, 4)
  run = compiled.run(layer)
  packed = run(params, x, reset)
  start = 0
  for length in lengths:
    # Each document alone at the start of the sequence (a causal layer never reads what follows
    # it), through the one compiled program.
    alone = np.zeros_like(x)
    alone[:length] = x[start:start + length]
    _assert_close(packed[start:start + length],
                  np.asarray(run(params, alone, np.zeros_like(reset))[:length], np.float64))
    start += length


def test_long_sequences_attend_block_by_block(monkeypatch):
  """Blocks of 8 queries (the layer's are 512) over 29 steps, local and global, with resets."""
  monkeypatch.setattr(attention, "BLOCK", 8)
  x = _x((29, 6), seed=5)
  reset = np.zeros(29, bool)
  reset[[0, 12, 13]] = True
  for name in ("gqa-window-partial-rotary", "mha-global-qk-norm-cap-bias"):
    layer = layers.Attention(**CONFIGS[name])
    params = compiled.init(layer, x.shape, 6)
    y = jax.jit(functools.partial(layer.apply, reset=reset))(params, x)
    _assert_close(y, _reference(layer, params, np.asarray(x, np.float64), reset))
  # Latent attention's values are narrower than its queries and keys.
  layer = layers.LatentAttention(**LATENT["nope-lora-bias-scaled"])
  params = compiled.init(layer, x.shape, 6)
  y = jax.jit(functools.partial(layer.apply, reset=reset))(params, x)
  _assert_close(y, _latent_reference(layer, params, np.asarray(x, np.float64), reset))


def test_decoding_past_the_window_and_from_a_prefill_equals_one_pass():
  layer = layers.Attention(**CONFIGS["gqa-window-partial-rotary"])
  x = _x((2, 20, 6), seed=7)
  reset = np.zeros((2, 20), bool)
  reset[1, 9] = True
  params = compiled.init(layer, x.shape, 8)
  whole = compiled.run(layer)(params, x, reset)
  y, state = compiled.run(layer, return_state=True)(params, x[:, :12], reset[:, :12])
  assert state.k.shape == (2, 7, 2, 6)  # the window's capacity, whatever the length
  step = compiled.run(layer, method="step")
  for t in range(12, 20):
    state, y_t = step(params, state, x[:, t], reset[:, t])
    _assert_close(y_t, np.asarray(whole[:, t], np.float64))
  _assert_close(y, np.asarray(whole[:, :12], np.float64))


def test_bad_options_are_named():
  x = _x((2, 5, 6))
  for options, match in [
      (dict(num_heads=4, num_kv_heads=3, head_dim=2), "`num_kv_heads`=3 must divide"),
      (dict(num_heads=4), "`num_heads`=4 must divide the width 6"),
      (dict(num_heads=2, window=0), "`window` must be a positive int"),
      (dict(num_heads=2, rope_fraction=1.5), "`rope_fraction`"),
      (dict(num_heads=2, logit_cap=0.0), "`logit_cap`"),
      (dict(num_heads=2, cache_size=0), "`cache_size` must be a positive int"),
      (dict(num_heads=2, qk_norm="layer"), "`qk_norm` must be False, True, 'rms' or"),
      (dict(num_heads=2, qk_norm=True, qk_norm_eps=0.0), "`qk_norm_eps` must be > 0"),
      (dict(num_heads=2, scale=-1.0), "`scale` must be > 0 or None"),
  ]:
    with pytest.raises(ValueError, match=match):
      layers.Attention(**options).init(jax.random.key(0), x)


def _latent_reference(layer, params, x, reset):
  """Multi-head latent attention in its expanded form (every head's keys and values up from
  the latent, as transformers' `KimiLinearAttention` and DeepSeek-V2 write it), one query at a
  time in float64; the rotary channels last in each head, turned as `_rotate` turns them."""
  p = {name: np.asarray(value, np.float64) for name, value in params["params"].items()}
  length = x.shape[0]
  heads, rank = layer.num_heads, layer.kv_lora_rank
  nope, rope, v_dim = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
  bias = lambda name: p.get(f"{name}_bias", 0.0)
  if layer.q_lora_rank is None:
    q = x @ p["q_proj"]
  else:
    q = _rms(x @ p["q_down"] + bias("q_down"), p["q_norm"], layer.norm_eps) @ p["q_up"]
  q = q.reshape(length, heads, nope + rope)
  compressed = x @ p["kv_down"] + bias("kv_down")
  latent, k_rot = _rms(compressed[:, :rank], p["kv_norm"], layer.norm_eps), compressed[:, rank:]
  kv = (latent @ p["kv_up"]).reshape(length, heads, nope + v_dim)
  k = np.concatenate([kv[..., :nope], np.repeat(k_rot[:, None], heads, axis=1)], axis=-1)
  v = kv[..., nope:]
  starts = [max([s for s in range(t + 1) if reset[s]], default=0) for t in range(length)]
  if layer.rope_base is not None:  # rotate the last `rope` channels of each query and key head
    for t in range(length):
      for m in (q, k):
        m[t, :, nope:] = _rotate(m[t, :, nope:], t - starts[t], rope, layer.rope_base)
  out = np.zeros((length, heads, v_dim))
  for t in range(length):
    first = starts[t] if layer.window is None else max(starts[t], t - layer.window + 1)
    for n in range(heads):
      logits = k[first:t + 1, n] @ q[t, n] * (layer.scale or (nope + rope) ** -0.5)
      weights = np.exp(logits - logits.max())
      out[t, n] = weights / weights.sum() @ v[first:t + 1, n]
  return out.reshape(length, heads * v_dim) @ p["o_proj"] + bias("o")


LATENT = {
    "rotary-window": dict(num_heads=3, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=5,
                          kv_lora_rank=6, window=6, rope_base=50.0),
    # Kimi Linear's: no positions; with a query bottleneck, biases and a scale of its own.
    "nope-lora-bias-scaled": dict(num_heads=2, qk_nope_head_dim=5, qk_rope_head_dim=2,
                                  v_head_dim=3, kv_lora_rank=4, q_lora_rank=3, rope_base=None,
                                  use_bias=True, scale=0.3, norm_eps=1e-3),
}


@pytest.mark.parametrize("name", list(LATENT))
def test_latent_attention_is_the_expanded_form_and_decodes_from_its_latent_cache(name):
  layer = layers.LatentAttention(**LATENT[name])
  x = _x((2, 17, 6), seed=9)
  reset = np.random.default_rng(2).uniform(size=(2, 17)) < 0.15
  params = jax.tree.map(lambda v: 2 * v, compiled.init(layer, x.shape, 3))
  whole = compiled.run(layer)(params, x, reset)
  for row in range(2):
    _assert_close(whole[row], _latent_reference(layer, params, np.asarray(x[row], np.float64),
                                                reset[row]))
  # The cache holds per step the rotary key and the latent, whatever the number of heads.
  _, state = compiled.run(layer, return_state=True)(params, x[:, :9], reset[:, :9])
  spec = LATENT[name]
  size = spec.get("window") or layer.cache_size
  assert state.k.shape == (2, size, 1, spec["qk_rope_head_dim"] + spec["kv_lora_rank"])
  step = compiled.run(layer, method="step")
  for t in range(9, 17):
    state, y_t = step(params, state, x[:, t], reset[:, t])
    _assert_close(y_t, np.asarray(whole[:, t], np.float64))
  with pytest.raises(ValueError, match="`qk_rope_head_dim` must be an int >= 0, even where"):
    layers.LatentAttention(qk_rope_head_dim=3).init(jax.random.key(0), x)
