"""Mamba2, GatedDeltaNet, KDA, Gated DeltaProduct, RWKV-7, RGLRU and MinGRU against float64
NumPy loops written from their papers and reference modules (state-spaces/mamba
`mamba2_simple.py` and `ssd_minimal.py`, flash-linear-attention `fla/layers/gated_deltanet.py`,
`kda.py` with `fla/ops/kda/naive.py`, `gated_deltaproduct.py` with
`fla/ops/gated_delta_product/naive.py`, `rwkv7.py` with
`fla/ops/generalized_delta_rule/dplr/naive.py`, recurrentgemma `jax/layers.py` and
`jax/modules.py`, the minGRU paper's listings), and their initial parameters against the
distributions those modules draw from. The shared contract
(modes, steps, resets, streaming, gradients) is in test_layers.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compiled
import references
from ssmkit import layers


def _x(shape, seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _resets(length, seed=1):
  return np.asarray(jax.random.bernoulli(jax.random.key(seed), 0.2, (length,)))



def _assert_close(actual, expected, rtol=1e-5):
  scale = float(np.max(np.abs(expected)))
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=rtol * scale)


def _params64(params):
  return {name: np.asarray(value, np.float64) for name, value in params["params"].items()}


def _sigmoid(v):
  return 1 / (1 + np.exp(-v))


def _silu(v):
  return v * _sigmoid(v)


def _softplus(v):
  return np.log1p(np.exp(v))


def _rms_norm(v, eps):
  return v / np.sqrt(np.mean(v**2, axis=-1, keepdims=True) + eps)


class _Conv:
  """A depthwise causal convolution kept as PyTorch's conv1d state: the last `width` inputs."""

  def __init__(self, kernel, bias=None):
    self.kernel, self.bias = kernel, bias
    self.window = np.zeros_like(kernel)

  def __call__(self, v, reset):
    if reset:
      self.window = np.zeros_like(self.window)
    self.window = np.concatenate([self.window[1:], v[None]])
    out = np.sum(self.window * self.kernel, axis=0)
    return out if self.bias is None else out + self.bias


def _stepped(layer, params, x, reset):
  """The layer's `step` over the rows of `x` `(T, H)`, from the zero state."""
  state, ys = layer.initialize_state(x.shape[1:]), []
  step = compiled.run(layer, method="step")
  for t in range(x.shape[0]):
    state, y = step(params, state, x[t], reset[t])
    ys.append(y)
  return np.stack(ys)


def _mamba2_reference(p, x, reset, *, d_state, head_dim, n_groups, dt_limit=(0, np.inf), eps=1e-5,
                      norm_groups=1, gate_norm="norm_gated", scales=(1, 1, 1, 1, 1)):
  """Mamba2Simple's forward pass one step at a time (the recurrent form of ssd_minimal), with
  `transformers`' step clip and its gated norm over `norm_groups` groups of channels; Falcon-H1's
  norm before the gate or none, and its factors on the projection's parts (`mup_vector`)."""
  inner = p["out_proj"].shape[0]
  heads = inner // head_dim
  conv = _Conv(p["conv_kernel"], p["conv_bias"])
  state = np.zeros((heads, head_dim, d_state))  # ssd_minimal's (h, p, n)
  a = -np.exp(p["A_log"])
  ys = []
  for t in range(x.shape[0]):
    if reset[t]:
      state = np.zeros_like(state)
    widths = (inner, inner, n_groups * d_state, n_groups * d_state, heads)
    zxbcdt = x[t] @ p["in_proj"] * np.repeat(scales, widths)
    z, xbc, dt = np.split(zxbcdt, [inner, zxbcdt.shape[0] - heads])
    xbc = _silu(conv(xbc, reset[t]))
    u, b, c = np.split(xbc, [inner, inner + n_groups * d_state])
    u = u.reshape(heads, head_dim)
    b, c = b.reshape(n_groups, d_state), c.reshape(n_groups, d_state)
    dt = np.clip(_softplus(dt + p["dt_bias"]), *dt_limit)
    y = np.zeros((heads, head_dim))
    for h in range(heads):
      g = h // (heads // n_groups)
      state[h] = np.exp(dt[h] * a[h]) * state[h] + np.outer(u[h] * dt[h], b[g])
      y[h] = state[h] @ c[g] + p["D"][h] * u[h]
    y = y.reshape(inner)
    if gate_norm == "gate":
      y = y * _silu(z)
    elif gate_norm == "gate_normed":
      y = _rms_norm(y.reshape(norm_groups, -1), eps).reshape(inner) * p["norm_scale"] * _silu(z)
    else:
      gated = (y * _silu(z)).reshape(norm_groups, inner // norm_groups)
      y = _rms_norm(gated, eps).reshape(inner) * p["norm_scale"]
    ys.append(y @ p["out_proj"])
  return np.stack(ys)


def test_mamba2_matches_the_reference_module():
  # Four heads in two groups; the other modes equal this one (test_layers.py).
  layer = layers.Mamba2(d_state=5, head_dim=3, n_groups=2, d_conv=4)
  x, reset = _x((23, 6)), _resets(23)
  params = compiled.init(layer, x.shape, 11)
  expected = _mamba2_reference(_params64(params), np.asarray(x, np.float64), reset, d_state=5,
                               head_dim=3, n_groups=2)
  _assert_close(compiled.run(layer, mode="chunked")(params, x, reset), expected)


def test_mamba2_clips_its_step_and_normalises_per_group_as_transformers():
  """`dt_limit` that bites (steps here lie around 0.7), a per-group norm over 2 groups, and
  another epsilon, in the sequence and step by step."""
  layer = layers.Mamba2(d_state=5, head_dim=3, n_groups=2, d_conv=4, dt_limit=(0.05, 0.4),
                        norm_per_group=True, norm_eps=0.3)
  x, reset = _x((23, 6)), _resets(23)
  params = compiled.init(layer, x.shape, 11)
  expected = _mamba2_reference(_params64(params), np.asarray(x, np.float64), reset, d_state=5,
                               head_dim=3, n_groups=2, dt_limit=(0.05, 0.4), eps=0.3, norm_groups=2)
  _assert_close(compiled.run(layer, mode="chunked")(params, x, reset), expected)
  _assert_close(_stepped(layer, params, x, reset), expected)
  with pytest.raises(ValueError, match=r"`dt_limit` must be \(low, high\)"):
    layers.Mamba2(head_dim=8, dt_limit=(0.5, 0.1)).init(jax.random.key(0), _x((4, 16)))


@pytest.mark.parametrize("gate_norm", ["gate_normed", "gate"])
def test_mamba2_gates_and_scales_its_parts_as_falcon_h1(gate_norm):
  """Falcon-H1's Mamba-2: the norm before the gate, or no norm; factors on z, x, B, C and dt."""
  scales = (0.5, 1.7, 0.8, 1.3, 0.6)
  layer = layers.Mamba2(d_state=5, head_dim=3, n_groups=2, d_conv=4, num_heads=2,
                        norm_per_group=True, gate_norm=gate_norm, in_proj_scales=scales)
  x, reset = _x((23, 6)), _resets(23)
  params = compiled.init(layer, x.shape, 11)
  assert ("norm_scale" in params["params"]) == (gate_norm != "gate")
  expected = _mamba2_reference(_params64(params), np.asarray(x, np.float64), reset, d_state=5,
                               head_dim=3, n_groups=2, norm_groups=2, gate_norm=gate_norm,
                               scales=scales)
  _assert_close(compiled.run(layer, mode="chunked")(params, x, reset), expected)
  _assert_close(_stepped(layer, params, x, reset), expected)
  for options, message in [({"gate_norm": "after"}, "`gate_norm` must be one of"),
                           ({"in_proj_scales": (1.0, 2.0)}, "`in_proj_scales` must be five")]:
    with pytest.raises(ValueError, match=message):
      layers.Mamba2(head_dim=8, **options).init(jax.random.key(0), _x((4, 16)))


def test_mamba2_initialisation_follows_the_reference():
  layer = layers.Mamba2(d_state=16, head_dim=4, dt_min=0.002, dt_max=0.05)
  params = compiled.init(layer, _x((4, 256)).shape, 12)["params"]
  heads = 2 * 256 // 4
  a = np.exp(np.asarray(params["A_log"], np.float64))
  assert a.shape == (heads,) and a.min() >= 1 and a.max() <= 16
  # A ~ U[1, 16]: mean 8.5, standard deviation 15 / sqrt(12) = 4.33; 128 draws.
  assert np.mean(a) == pytest.approx(8.5, abs=1.2)
  dt = np.asarray(jax.nn.softplus(params["dt_bias"]), np.float64)
  assert dt.min() >= 0.002 * (1 - 1e-4) and dt.max() <= 0.05 * (1 + 1e-4)
  # log dt ~ U[log dt_min, log dt_max]: its mean is the midpoint (standard error 0.08).
  assert np.mean(np.log(dt)) == pytest.approx(np.log(np.sqrt(0.002 * 0.05)), abs=0.35)
  np.testing.assert_array_equal(params["D"], np.ones(heads))
  np.testing.assert_array_equal(params["norm_scale"], np.ones(512))
  # nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), standard deviation bound / sqrt(3).
  assert params["in_proj"].shape == (256, 2 * 512 + 2 * 16 + heads)
  assert np.abs(params["in_proj"]).max() <= 1 / 16
  assert np.std(params["in_proj"]) == pytest.approx(1 / 16 / np.sqrt(3), rel=0.02)


def test_mamba2_rejects_heads_that_do_not_fit():
  x = _x((4, 16))
  with pytest.raises(ValueError, match="`head_dim`"):
    layers.Mamba2(head_dim=24).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="`n_groups`"):
    layers.Mamba2(head_dim=8, n_groups=3).init(jax.random.key(0), x)


def _gated_deltanet_reference(p, x, reset, *, num_heads, num_v_heads=None, eps=1e-5,
                              allow_neg_eigval=False):
  """fla's GatedDeltaNet.forward with the recurrent kernel (fused_recurrent), one step at a time;
  with `num_v_heads`, q and k repeated over the value heads as fla's einops
  `repeat('... h d -> ... (h g) d')` does; with `allow_neg_eigval`, beta doubled (fla's
  option of the name)."""
  v_heads = num_v_heads or num_heads
  head_k = p["q_proj"].shape[1] // num_heads
  head_v = p["v_proj"].shape[1] // v_heads
  convs = [_Conv(p[name]) for name in ("q_conv", "k_conv", "v_conv")]
  state = np.zeros((v_heads, head_k, head_v))
  l2norm = lambda v: v / np.sqrt(np.sum(v**2, axis=-1, keepdims=True) + 1e-6)
  ys = []
  for t in range(x.shape[0]):
    if reset[t]:
      state = np.zeros_like(state)
    q, k, v = (_silu(conv(x[t] @ p[name], reset[t]))
               for conv, name in zip(convs, ("q_proj", "k_proj", "v_proj"), strict=True))
    q = l2norm(q.reshape(num_heads, head_k)) * head_k**-0.5
    k = l2norm(k.reshape(num_heads, head_k))
    q, k = (np.stack([m[h // (v_heads // num_heads)] for h in range(v_heads)]) for m in (q, k))
    v = v.reshape(v_heads, head_v)
    beta = _sigmoid(x[t] @ p["b_proj"]) * (2 if allow_neg_eigval else 1)
    g = -np.exp(p["A_log"]) * _softplus(x[t] @ p["a_proj"] + p["dt_bias"])
    gate = (x[t] @ p["g_proj"]).reshape(v_heads, head_v)
    o = np.zeros((v_heads, head_v))
    for h in range(v_heads):
      state[h] = state[h] * np.exp(g[h])
      v_new = (v[h] - k[h] @ state[h]) * beta[h]
      state[h] = state[h] + np.outer(k[h], v_new)
      o[h] = q[h] @ state[h]
    o = _rms_norm(o, eps) * p["norm_scale"] * _silu(gate)
    ys.append(o.reshape(-1) @ p["o_proj"])
  return np.stack(ys)


def test_gated_deltanet_matches_the_reference_layer():
  layer = layers.GatedDeltaNet(num_heads=2, d_state=3, d_conv=4)
  x, reset = _x((29, 6)), _resets(29)
  params = compiled.init(layer, x.shape, 13)
  expected = _gated_deltanet_reference(_params64(params), np.asarray(x, np.float64), reset, num_heads=2)
  _assert_close(compiled.run(layer, mode="chunked")(params, x, reset), expected)


def test_gated_deltanet_groups_value_heads_over_shared_keys():
  """`num_v_heads`: 6 value heads over 2 query/key heads, another norm epsilon, beta in (0, 2)
  (OLMo Hybrid's); the sequence and each step equal fla's forward pass."""
  layer = layers.GatedDeltaNet(num_heads=2, num_v_heads=6, d_state=3, d_conv=4, norm_eps=0.2,
                               allow_neg_eigval=True)
  x, reset = _x((29, 6)), _resets(29)
  params = compiled.init(layer, x.shape, 13)
  assert params["params"]["q_proj"].shape == (6, 6) and params["params"]["v_proj"].shape == (6, 36)
  expected = _gated_deltanet_reference(_params64(params), np.asarray(x, np.float64), reset,
                                       num_heads=2, num_v_heads=6, eps=0.2, allow_neg_eigval=True)
  _assert_close(compiled.run(layer, mode="chunked")(params, x, reset), expected)
  _assert_close(_stepped(layer, params, x, reset), expected)
  with pytest.raises(ValueError, match=r"`num_v_heads`=3 must be a multiple of `num_heads`=2"):
    layers.GatedDeltaNet(num_heads=2, num_v_heads=3).init(jax.random.key(0), x)


def test_gated_deltanet_initialisation_follows_the_reference():
  params = compiled.init(layers.GatedDeltaNet(num_heads=256), _x((4, 512)).shape, 14)["params"]
  a = np.exp(np.asarray(params["A_log"], np.float64))
  # A ~ U(0, 16]: mean 8, standard error 0.29 over 256 heads.
  assert a.min() > 0 and a.max() <= 16 and np.mean(a) == pytest.approx(8, abs=1.2)
  dt = np.asarray(jax.nn.softplus(params["dt_bias"]), np.float64)
  assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)
  assert np.mean(np.log(dt)) == pytest.approx(np.log(1e-2), abs=0.35)
  # The default key width is H / num_heads: q and k have H channels, v 2H.
  assert params["q_proj"].shape == (512, 512) and params["v_proj"].shape == (512, 1024)
  assert np.abs(params["o_proj"]).max() <= 1 / np.sqrt(1024)


def _gelu(v):
  return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))


def _rglru_reference(p, x, reset):
  """recurrentgemma's RecurrentBlock (linear branches, Conv1D, RGLRU) one step at a time."""
  heads, block = p["input_gate_bias"].shape
  conv = _Conv(p["conv_kernel"], p["conv_bias"])
  h = np.zeros(heads * block)
  block_diagonal = lambda v, w, b: (np.einsum("hi,hij->hj", v.reshape(heads, block), w) + b).reshape(-1)
  ys = []
  for t in range(x.shape[0]):
    y_branch = _gelu(x[t] @ p["y_proj"] + p["y_bias"])
    u = conv(x[t] @ p["x_proj"] + p["x_bias"], reset[t])
    gate_x = _sigmoid(block_diagonal(u, p["input_gate"], p["input_gate_bias"]))
    gate_a = _sigmoid(block_diagonal(u, p["a_gate"], p["a_gate_bias"]))
    log_a = -8.0 * gate_a * _softplus(p["a_param"])
    a = np.exp(log_a)
    first = reset[t] or t == 0  # recurrentgemma: position 0 of a sequence is a reset
    multiplier = 1.0 if first else np.sqrt(1 - a**2)
    h = (0.0 if first else a) * h + u * gate_x * multiplier
    ys.append((h * y_branch) @ p["out_proj"] + p["out_bias"])
  return np.stack(ys)


def test_rglru_matches_the_reference_block():
  layer = layers.RGLRU(d_state=8, num_heads=2, d_conv=4)
  x, reset = _x((31, 6)), _resets(31)
  params = compiled.init(layer, x.shape, 15)
  # Larger gates than at initialisation, so that a_t spreads over (0, 1).
  params = jax.tree.map(lambda v: 3 * v, params)
  expected = _rglru_reference(_params64(params), np.asarray(x, np.float64), reset)
  _assert_close(compiled.run(layer)(params, x, reset), expected)


def test_rglru_left_padding_with_a_reset_at_the_first_real_step_changes_nothing():
  """A sequence from no state starts with a reset, so padding in front of it, cut off by a
  reset, leaves its outputs as they were; the first step from `initialize_state` too."""
  layer = layers.RGLRU(d_state=8, num_heads=2)
  x = _x((2, 9, 6))
  padded = np.concatenate([_x((2, 4, 6), seed=3), x], axis=1)
  reset = np.zeros((2, 13), bool)
  reset[:, 4] = True
  params = compiled.init(layer, padded.shape)
  run = compiled.run(layer)
  _assert_close(run(params, padded, reset)[:, 4:], run(params, x, None))
  state, y_0 = compiled.run(layer, method="step")(params, layer.initialize_state((2, 6)), x[:, 0])
  _assert_close(y_0, run(params, x, None)[:, 0])
  assert state.started.all()


def test_rglru_initialisation_follows_the_reference():
  layer = layers.RGLRU(d_state=1024, num_heads=4, r_min=0.5, r_max=0.95)
  params = compiled.init(layer, _x((4, 256)).shape, 16)["params"]
  a = np.exp(-np.asarray(jax.nn.softplus(np.asarray(params["a_param"], np.float64))))
  assert a.min() >= 0.5 - 1e-6 and a.max() <= 0.95 + 1e-6
  # Uniform on the ring: a^2 ~ U[r_min^2, r_max^2] (standard error 0.006).
  assert np.mean(a**2) == pytest.approx((0.5**2 + 0.95**2) / 2, abs=0.03)
  # LeCun normal for the dense and gate weights (fan-in: the whole width for the
  # block-diagonal gates, as recurrentgemma's variance scaling counts it), N(0, 0.01 / 4)
  # for the convolution, zero biases.
  assert np.std(params["x_proj"]) == pytest.approx(1 / 16, rel=0.02)
  assert params["a_gate"].shape == (4, 256, 256)
  assert np.std(params["a_gate"]) == pytest.approx(1 / np.sqrt(1024), rel=0.02)
  assert np.std(params["conv_kernel"]) == pytest.approx(0.05, rel=0.05)
  np.testing.assert_array_equal(params["input_gate_bias"], np.zeros((4, 256)))


def test_rglru_gradient_stays_finite_where_a_reaches_one():
  """With the recurrence gate closed, a_t = 1 and d sqrt(1 - a_t^2) is capped, not infinite."""
  layer = layers.RGLRU(num_heads=1, d_conv=2)
  x = _x((2, 9, 4))
  params = compiled.init(layer, x.shape, 0)
  params = {"params": {**params["params"], "a_gate_bias": jnp.full((1, 4), -200.0)}}
  grads = jax.grad(lambda p: jnp.sum(layer.apply(p, x) ** 2))(params)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def _mingru_reference(p, x, reset):
  """The minGRU paper's sequential listing: h_t = (1 - z_t) h_{t-1} + z_t h~_t."""
  h = np.zeros(p["z_bias"].shape)
  ys = []
  for t in range(x.shape[0]):
    if reset is not None and reset[t]:
      h = np.zeros_like(h)
    z = _sigmoid(x[t] @ p["z_proj"] + p["z_bias"])
    h_tilde = x[t] @ p["h_proj"] + p["h_bias"]
    h = (1 - z) * h + z * h_tilde
    ys.append(h @ p["out_proj"] if "out_proj" in p else h)
  return np.stack(ys)


@pytest.mark.parametrize("d_state", [None, 7])
def test_mingru_matches_the_paper(d_state):
  layer = layers.MinGRU(d_state=d_state)
  x, reset = _x((27, 5)), _resets(27)
  params = compiled.init(layer, x.shape, 17)
  expected = _mingru_reference(_params64(params), np.asarray(x, np.float64), reset)
  _assert_close(compiled.run(layer)(params, x, reset), expected)


def test_mingru_linear_recurrence_is_accurate_over_long_sequences():
  """The reason for the paper's log-space form, gates near 0 and 1 over thousands of steps,
  costs the linear recurrence no accuracy: float32 matches the float64 loop."""
  layer = layers.MinGRU()
  x = _x((8192, 4), seed=3)
  params = compiled.init(layer, x.shape, 18)
  params = {"params": {**params["params"], "z_proj": 8 * params["params"]["z_proj"]}}
  z = jax.nn.sigmoid(x @ params["params"]["z_proj"] + params["params"]["z_bias"][None])
  assert float(jnp.min(z)) < 1e-6 and float(jnp.max(z)) > 1 - 1e-6
  expected = _mingru_reference(_params64(params), np.asarray(x, np.float64), None)
  for mode in ["sequential", "parallel"]:
    _assert_close(compiled.run(layer, mode=mode)(params, x), expected, rtol=1e-5)


def test_mingru_initialisation_is_pytorch_linear():
  params = compiled.init(layers.MinGRU(d_state=300), _x((4, 100)).shape, 19)["params"]
  for name in ("z_proj", "h_proj", "z_bias", "h_bias"):
    assert np.abs(params[name]).max() <= 0.1
  assert np.std(params["z_proj"]) == pytest.approx(0.1 / np.sqrt(3), rel=0.03)
  assert np.abs(params["out_proj"]).max() <= 1 / np.sqrt(300)
  assert "out_proj" not in compiled.init(layers.MinGRU(), _x((4, 100)).shape, 19)["params"]


def _l2norm(v):
  return v / np.sqrt(np.sum(v**2, axis=-1, keepdims=True) + 1e-6)


def _kda_reference(p, x, reset, *, num_heads, num_v_heads=None, allow_neg_eigval=False,
                   lower_bound=None, eps=1e-5, gate_bias=True):
  """fla's KimiDeltaAttention.forward with `naive_recurrent_kda`, one step at a time (without a
  gate bias: transformers' `KimiLinearDeltaAttention`)."""
  assert ("g_bias" in p) == gate_bias
  v_heads = num_v_heads or num_heads
  head_k = p["q_proj"].shape[1] // num_heads
  head_v = p["v_proj"].shape[1] // v_heads
  convs = [_Conv(p[name]) for name in ("q_conv", "k_conv", "v_conv")]
  state = np.zeros((v_heads, head_k, head_v))
  ys = []
  for t in range(x.shape[0]):
    if reset[t]:
      state = np.zeros_like(state)
    q, k, v = (_silu(conv(x[t] @ p[name], reset[t]))
               for conv, name in zip(convs, ("q_proj", "k_proj", "v_proj"), strict=True))
    q = _l2norm(q.reshape(num_heads, head_k)) * head_k**-0.5
    k = _l2norm(k.reshape(num_heads, head_k))
    q, k = (np.stack([m[h // (v_heads // num_heads)] for h in range(v_heads)]) for m in (q, k))
    v = v.reshape(v_heads, head_v)
    beta = _sigmoid(x[t] @ p["b_proj"]) * (2 if allow_neg_eigval else 1)
    f = (x[t] @ p["f_down"] @ p["f_up"] + p["dt_bias"]).reshape(v_heads, head_k)
    a = np.exp(p["A_log"])[:, None]
    g = -a * _softplus(f) if lower_bound is None else lower_bound * _sigmoid(a * f)
    o = np.zeros((v_heads, head_v))
    for h in range(v_heads):
      state[h] = state[h] * np.exp(g[h])[:, None]
      state[h] = state[h] + np.outer(beta[h] * k[h], v[h] - k[h] @ state[h])
      o[h] = q[h] @ state[h]
    gate = (x[t] @ p["g_down"] @ p["g_up"] + p.get("g_bias", 0.0)).reshape(v_heads, head_v)
    o = _rms_norm(o, eps) * p["norm_scale"] * _sigmoid(gate)
    ys.append(o.reshape(-1) @ p["o_proj"])
  return np.stack(ys)


@pytest.mark.parametrize("options", [dict(num_heads=2), dict(
    num_heads=2, num_v_heads=4, allow_neg_eigval=True, lower_bound=-5.0, gate_bias=False)],
                         ids=["default", "grouped-bounded-unbiased"])
def test_kimi_delta_attention_matches_the_reference_layer(options):
  layer = layers.KimiDeltaAttention(d_state=3, d_conv=4, **options)
  x, reset = _x((29, 6)), _resets(29)
  params = compiled.init(layer, x.shape, 13)
  expected = _kda_reference(_params64(params), np.asarray(x, np.float64), reset, **options)
  _assert_close(compiled.run(layer, mode="chunked")(params, x, reset), expected)
  _assert_close(_stepped(layer, params, x, reset), expected)


def test_kimi_delta_attention_initialisation_follows_the_reference():
  params = compiled.init(layers.KimiDeltaAttention(num_heads=64), _x((4, 256)).shape, 14)["params"]
  a = np.exp(np.asarray(params["A_log"], np.float64))
  assert a.min() >= 1 and a.max() <= 16 and np.mean(a) == pytest.approx(8.5, abs=1.5)
  dt = np.asarray(jax.nn.softplus(params["dt_bias"]), np.float64)
  assert params["dt_bias"].shape == (256,)  # one per key channel of each head
  assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)
  # The decay and the gate go through a bottleneck of V = H / num_heads channels.
  assert params["f_down"].shape == (256, 4) and params["g_up"].shape == (4, 256)
  bounded = compiled.init(layers.KimiDeltaAttention(num_heads=4, lower_bound=-5.0), (4, 8), 14)
  assert np.all(np.asarray(bounded["params"]["A_log"]) == 0)
  with pytest.raises(ValueError, match="`lower_bound` must be None or < 0"):
    layers.KimiDeltaAttention(lower_bound=1.0).init(jax.random.key(0), _x((4, 8)))


def _gated_deltaproduct_reference(p, x, reset, *, num_heads, num_householder, eps=1e-5):
  """fla's GatedDeltaProduct.forward with `naive_recurrent_gated_delta_product`, one token at a
  time (allow_neg_eigval: beta in (0, 2))."""
  n = num_householder
  head_k = p["q_proj"].shape[1] // num_heads
  head_v = p["v_proj"].shape[1] // (n * num_heads)
  convs = [_Conv(p[name]) for name in ("q_conv", "k_conv", "v_conv")]
  state = np.zeros((num_heads, head_k, head_v))
  ys = []
  for t in range(x.shape[0]):
    if reset[t]:
      state = np.zeros_like(state)
    q, k, v = (_silu(conv(x[t] @ p[name], reset[t]))
               for conv, name in zip(convs, ("q_proj", "k_proj", "v_proj"), strict=True))
    q = _l2norm(q.reshape(num_heads, head_k)) * head_k**-0.5
    k = _l2norm(k.reshape(n, num_heads, head_k))
    v = v.reshape(n, num_heads, head_v)
    beta = 2 * _sigmoid(x[t] @ p["b_proj"]).reshape(n, num_heads)
    g = -np.exp(p["A_log"]) * _softplus(x[t] @ p["a_proj"] + p["dt_bias"])
    o = np.zeros((num_heads, head_v))
    for h in range(num_heads):
      state[h] = state[h] * np.exp(g[h])
      for j in range(n):
        state[h] = state[h] + np.outer(k[j, h], (v[j, h] - k[j, h] @ state[h]) * beta[j, h])
      o[h] = q[h] @ state[h]
    gate = (x[t] @ p["g_proj"]).reshape(num_heads, head_v)
    o = _rms_norm(o, eps) * p["norm_scale"] * _silu(gate)
    ys.append(o.reshape(-1) @ p["o_proj"])
  return np.stack(ys)


def test_gated_deltaproduct_matches_the_reference_layer():
  layer = layers.GatedDeltaProduct(num_heads=2, num_householder=3, d_state=3, d_conv=4)
  x, reset = _x((29, 6)), _resets(29)
  params = compiled.init(layer, x.shape, 13)
  assert params["params"]["k_proj"].shape == (6, 18) and params["params"]["b_proj"].shape == (6, 6)
  expected = _gated_deltaproduct_reference(_params64(params), np.asarray(x, np.float64), reset,
                                           num_heads=2, num_householder=3)
  _assert_close(compiled.run(layer, mode="chunked")(params, x, reset), expected)
  _assert_close(_stepped(layer, params, x, reset), expected)


def _rwkv7_reference(p, x, reset, *, head_dim, eps=1e-5, v_first=None):
  """fla's RWKV7Attention.forward with `dplr_recurrence` (a = -kk, b = kk * a), one step at a
  time: at layer 0 without `v_first` `(T, value_dim)`, at a later layer with it. Returns the
  outputs and the first layer's values (the layer's own at layer 0)."""
  heads = x.shape[1] // head_dim
  head_v = p["v_proj"].shape[1] // heads
  state, previous = np.zeros((heads, head_dim, head_v)), np.zeros(x.shape[1])
  ys, firsts = [], []
  for t in range(x.shape[0]):
    if reset[t]:
      state, previous = np.zeros_like(state), np.zeros_like(previous)
    delta, previous = previous - x[t], x[t]
    xr, xw, xk, xv, xa, xg = (x[t] + delta * p[f"x_{m}"] for m in "rwkvag")
    r, k, v = xr @ p["r_proj"], xk @ p["k_proj"], xv @ p["v_proj"]
    if v_first is None:
      firsts.append(v)
    else:  # torch.lerp(v, v_first, sigmoid(v_lora(xv)))
      firsts.append(v_first[t])
      v = v + (v_first[t] - v) * _sigmoid(xv @ p["v_down"] @ p["v_up"] + p["v_bias"])
    w = -np.exp(-0.5) * _sigmoid(np.tanh(xw @ p["w_down"]) @ p["w_up"] + p["w_bias"])
    a = _sigmoid(xa @ p["a_down"] @ p["a_up"] + p["a_bias"])
    g = _sigmoid(xg @ p["g_down"]) @ p["g_up"]
    kk = (k * p["k_k"]).reshape(heads, head_dim)
    kk = kk / np.maximum(np.linalg.norm(kk, axis=-1, keepdims=True), 1e-12)
    k = k + k * (a - 1) * p["k_a"]
    r, k, a, w = (m.reshape(heads, head_dim) for m in (r, k, a, w))
    v = v.reshape(heads, head_v)
    o = np.zeros((heads, head_v))
    for h in range(heads):
      read = -kk[h] @ state[h]
      state[h] = state[h] * np.exp(w[h])[:, None] + np.outer(kk[h] * a[h], read) + np.outer(k[h], v[h])
      o[h] = r[h] @ state[h]
    o = (o - o.mean(-1, keepdims=True)) / np.sqrt(o.var(-1, keepdims=True) + head_dim * eps)
    o = o.reshape(-1) * p["norm_scale"] + p["norm_bias"]
    o = o + (np.sum(r * k * p["r_k"], -1, keepdims=True) * v).reshape(-1)
    ys.append((o * g) @ p["o_proj"])
  return np.stack(ys), np.stack(firsts)


def _perturbed(params, seed):
  """The parameters plus noise: the reference starts o_proj and the LoRAs' bottlenecks at zero,
  which would hide most of the layer from a comparison."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [v + 0.3 * jax.random.normal(key, v.shape, v.dtype)
                                   for v, key in zip(leaves, keys, strict=True)])


@pytest.mark.parametrize("options", [dict(head_dim=3), dict(head_dim=2, value_dim=12)],
                         ids=["default", "wider-values"])
def test_rwkv7_matches_the_reference_layer(options):
  layer = layers.RWKV7(decay_low_rank_dim=4, a_low_rank_dim=3, gate_low_rank_dim=5, **options)
  x, reset = _x((29, 6)), _resets(29)
  params = _perturbed(compiled.init(layer, x.shape, 13), 3)
  expected, _ = _rwkv7_reference(_params64(params), np.asarray(x, np.float64), reset,
                                 head_dim=options["head_dim"])
  _assert_close(compiled.run(layer, mode="chunked")(params, x, reset), expected)
  _assert_close(_stepped(layer, params, x, reset), expected)


@pytest.mark.parametrize("options", [dict(head_dim=3), dict(head_dim=2, value_dim=12)],
                         ids=["default", "wider-values"])
def test_rwkv7_mixes_in_the_first_layers_values_as_the_reference_layer(options):
  layer = layers.RWKV7(decay_low_rank_dim=4, a_low_rank_dim=3, value_low_rank_dim=2,
                       gate_low_rank_dim=5, **options)
  x, reset = _x((29, 6)), _resets(29)
  params = _perturbed(compiled.init(layer, x.shape, 13), 4)
  p, x64 = _params64(params), np.asarray(x, np.float64)
  own, own_values = _rwkv7_reference(p, x64, reset, head_dim=options["head_dim"])
  width = own_values.shape[-1]
  fresh = layers.ValueResidual.start(x, width)
  y, passed = compiled.run(layer, mode="chunked")(params, x, reset, value_residual=fresh)
  _assert_close(y, own)  # the first layer keeps its values and passes them on
  _assert_close(passed.values, own_values)
  assert passed.written
  first = layers.ValueResidual(_x((29, width), seed=5), jnp.asarray(True))
  expected, _ = _rwkv7_reference(p, x64, reset, head_dim=options["head_dim"],
                                 v_first=np.asarray(first.values, np.float64))
  y, passed = compiled.run(layer, mode="chunked")(params, x, reset, value_residual=first)
  _assert_close(y, expected)
  np.testing.assert_array_equal(passed.values, first.values)
  state, ys = layer.initialize_state(x.shape[1:]), []
  step = compiled.run(layer, method="step")
  for t in range(x.shape[0]):
    state, y_t, shared = step(params, state, x[t], reset[t], first._replace(values=first.values[t]))
    np.testing.assert_array_equal(shared.values, first.values[t])
    ys.append(y_t)
  _assert_close(np.stack(ys), expected)
  with pytest.raises(ValueError, match="`value_residual` must be a state like"):
    layer.apply(params, x, value_residual=layers.ValueResidual.start(x, width + 1))
  with pytest.raises(ValueError, match="`value_residual`: LRU shares no values"):
    layers.LRU(d_state=2).init(jax.random.key(0), x, value_residual=first)


def _rms_norm_scaled(v, scale, eps=1e-6):
  return _rms_norm(v, eps) * scale


def _rwkv7_model_reference(p, blocks, x, reset, *, head_dim):
  """A SequenceModel of RWKV7 mixer blocks (RMSNorm, no MLP, pooling "none") over one sequence
  `x` `(T, F)`: the encoder, h <- h + RWKV7_i(rms(h)) for each block's parameters in `blocks`,
  the first block's values passed to the later ones as fla's RWKV7Model passes `v_first`,
  the final norm and the decoder."""
  h = x @ p["encoder"]["kernel"] + p["encoder"]["bias"]
  first = None
  for block in blocks:
    y, first = _rwkv7_reference(block["mixer"], _rms_norm_scaled(h, block["norm"]["RMSNorm_0"]["scale"]),
                                reset, head_dim=head_dim, v_first=first)
    h = h + y
  h = _rms_norm_scaled(h, p["final_norm"]["RMSNorm_0"]["scale"])
  return h @ p["decoder"]["kernel"] + p["decoder"]["bias"]


@pytest.mark.parametrize("scan_blocks", [False, True], ids=["unrolled", "scanned"])
def test_rwkv7_model_passes_the_first_layers_values_to_every_later_layer(scan_blocks):
  from flax import nnx

  from ssmkit import nnx as snx

  make = functools.partial(layers.RWKV7, head_dim=2, decay_low_rank_dim=3, a_low_rank_dim=2,
                           value_low_rank_dim=2, gate_low_rank_dim=3)
  model = layers.SequenceModel(5, layer=make, features=6, num_blocks=3, pooling="none",
                               block="mixer", norm="rms", scan_blocks=scan_blocks)
  x, reset = _x((2, 17, 3)), np.stack([_resets(17, seed=6), _resets(17, seed=7)])
  variables = _perturbed(compiled.init(model, x.shape, 15), 5)
  p = jax.tree.map(lambda v: np.asarray(v, np.float64), variables["params"])
  if scan_blocks:
    blocks = [jax.tree.map(lambda v, i=i: v[i], p["blocks"]["block"]) for i in range(3)]
  else:
    blocks = [p[f"block_{i}"] for i in range(3)]
  expected = np.stack([_rwkv7_model_reference(p, blocks, np.asarray(x[b], np.float64), reset[b],
                                              head_dim=2) for b in range(2)])
  _assert_close(compiled.run(model)(variables, x, reset=reset), expected, rtol=1e-4)
  state, ys = model.initialize_state(x[:, 0].shape), []
  step = compiled.run(model, method="step")
  for t in range(x.shape[1]):
    state, y_t = step(variables, state, x[:, t], reset[:, t])
    ys.append(y_t)
  _assert_close(np.stack(ys, 1), expected, rtol=1e-4)
  nnx_model = snx.from_linen(model, variables)
  y = nnx.jit(lambda m, x, reset: m(x, reset=reset))(nnx_model, x, reset)
  _assert_close(y, expected, rtol=1e-4)


def _assert_rwkv7_depth(p, features, head_dim, index, count):
  """The reference's depth-dependent starting values (fla's RWKV7Attention._initialize_weights)."""
  p = {name: np.asarray(v, np.float64) for name, v in p.items()}
  n = np.arange(features)
  linear = n / (features - 1) - 0.5
  zigzag = ((n % head_dim) - (head_dim - 1) / 2) / ((head_dim - 1) / 2)
  zigzag = zigzag * np.abs(zigzag)
  late = 1 - index / count
  np.testing.assert_allclose(p["x_w"], 1 - (n / features)**(0.9 * late), atol=1e-6)
  np.testing.assert_allclose(p["x_g"], 1 - (n / features)**(0.2 * late), atol=1e-6)
  np.testing.assert_allclose(p["k_k"], 0.71 - 0.1 * linear, atol=1e-6)
  www = -6 + 6 * (n / (features - 1))**(1 + (index / max(count - 1, 1))**0.3)
  np.testing.assert_allclose(p["w_bias"], www + 0.5 + 2.5 * zigzag, atol=1e-5)
  np.testing.assert_allclose(p["a_bias"], -0.19 + 0.3 * zigzag + 0.4 * linear, atol=1e-6)
  np.testing.assert_allclose(p["norm_scale"], ((index + 1) / count)**0.7, atol=1e-6)


def test_rwkv7_initialisation_follows_the_reference():
  features, head_dim = 256, 64
  for index, count in ((0, 12), (5, 12), (11, 12)):
    layer = layers.RWKV7(head_dim=head_dim, layer_index=index, num_layers=count)
    p = compiled.init(layer, _x((4, features)).shape, 14)["params"]
    _assert_rwkv7_depth(p, features, head_dim, index, count)
    p = {name: np.asarray(v, np.float64) for name, v in p.items()}
  assert np.all(p["k_a"] == np.float32(1.02)) and np.all(p["r_k"] == np.float32(-0.04))
  assert not np.any(p["o_proj"]) and not np.any(p["w_down"]) and not np.any(p["g_down"])
  # Orthogonal projections: r and v of gain 1, k of gain 0.1; the LoRAs' ways up of gain 0.1.
  np.testing.assert_allclose(p["r_proj"].T @ p["r_proj"], np.eye(features), atol=1e-4)
  np.testing.assert_allclose(p["k_proj"].T @ p["k_proj"], 0.01 * np.eye(features), atol=1e-5)
  rank = p["w_up"].shape[0]
  assert rank == 32  # the reference's default for 256 channels of heads of 64
  np.testing.assert_allclose(p["w_up"] @ p["w_up"].T, 0.01 * np.eye(rank), atol=1e-5)
  with pytest.raises(ValueError, match="`head_dim`=5 must divide"):
    layers.RWKV7(head_dim=5).init(jax.random.key(0), _x((4, 8)))
  with pytest.raises(ValueError, match="`layer_index` must be in"):
    layers.RWKV7(head_dim=4, layer_index=2, num_layers=2).init(jax.random.key(0), _x((4, 8)))


def test_sequence_model_starts_rwkv7_blocks_at_their_depth():
  from flax import nnx

  from ssmkit import nnx as snx
  features, head_dim, count = 16, 4, 3
  x = _x((2, 5, features))
  make = functools.partial(layers.RWKV7, head_dim=head_dim)
  model = lambda **options: layers.SequenceModel(2, layer=make, features=features, num_blocks=count,
                                                 **options)
  p = model().init(jax.random.key(0), x)["params"]
  for i in range(count):
    _assert_rwkv7_depth(p[f"block_{i}"]["ssm"], features, head_dim, i, count)
  # A factory that sets the depth keeps it; scanned blocks all start as the first.
  fixed = layers.SequenceModel(2, layer=functools.partial(make, layer_index=0), features=features,
                               num_blocks=count).init(jax.random.key(0), x)["params"]
  _assert_rwkv7_depth(fixed["block_2"]["ssm"], features, head_dim, 0, count)
  scanned = model(scan_blocks=True).init(jax.random.key(0), x)["params"]["blocks"]["block"]["ssm"]
  for i in range(count):
    _assert_rwkv7_depth({name: v[i] for name, v in scanned.items()}, features, head_dim, 0, count)
  nnx_model = snx.SequenceModel(features, 2, layer=functools.partial(snx.RWKV7, head_dim=head_dim),
                                features=features, num_blocks=count, rngs=nnx.Rngs(0))
  for i in range(count):
    params = nnx.state(nnx_model.blocks[i].ssm, nnx.Param)
    _assert_rwkv7_depth({name: v.value for name, v in params.items()}, features, head_dim, i, count)


def _mamba3_reference(p, x, reset, *, d_state, head_dim, mimo_rank=None, outproj_norm=False,
                      eps=1e-5):
  """state-spaces/mamba's Mamba3.forward (n_groups 1, rope_fraction 0.5) with the step loop of
  `mamba3_siso_step_ref` / `mamba3_MIMO_step_ref`, in float64."""
  ranks = mimo_rank or 1
  inner = p["out_proj"].shape[0]
  heads, angles = inner // head_dim, d_state // 4
  widths = np.cumsum([inner, inner, ranks * d_state, ranks * d_state, heads, heads, heads])
  z, u, b, c, dd_dt, dd_a, trap, ang = np.split(x @ p["in_proj"], widths, axis=-1)
  length = x.shape[0]
  norm = lambda m, w: _rms_norm(m.reshape(length, ranks, 1, d_state), eps)[:, :, 0] * w
  k = norm(b, p["B_norm"])[:, :, None] + p["B_bias"].transpose(1, 0, 2)  # (T, R, H, N)
  q = norm(c, p["C_norm"])[:, :, None] + p["C_bias"].transpose(1, 0, 2)
  dt = _softplus(dd_dt + p["dt_bias"])
  a = -np.where(dd_a >= 0, 1 + dd_a, 1 / (1 - np.minimum(dd_a, 0)))
  a = np.minimum(a, -1e-4)
  rate = np.tanh(ang)[:, None, :] * np.pi * dt[..., None]
  u = u.reshape(length, heads, head_dim)
  v = u[:, None] * (p["mimo_x"].transpose(1, 0, 2) if mimo_rank else 1)
  start = (np.zeros((heads, d_state, head_dim)), np.zeros((heads, angles)),
           np.zeros((ranks, heads, d_state)), np.zeros((ranks, heads, head_dim)))
  y, _ = references.mamba3(q, k, v, a * dt, dt, _sigmoid(trap), rate, start, reset,
                           "halves" if mimo_rank else "interleaved")
  y = y + p["D"][:, None] * v
  z = z.reshape(length, heads, head_dim)[:, None] * (p["mimo_z"].transpose(1, 0, 2)
                                                      if mimo_rank else 1)
  if outproj_norm:
    y = _rms_norm(y, eps) * p["norm_scale"].reshape(heads, head_dim)
  y = y * _silu(z)
  y = np.sum(y * p["mimo_o"].transpose(1, 0, 2), axis=1) if mimo_rank else y[:, 0]
  return y.reshape(length, inner) @ p["out_proj"]


@pytest.mark.parametrize("options", [dict(), dict(mimo_rank=3, outproj_norm=True)],
                         ids=["siso", "mimo-norm"])
def test_mamba3_matches_the_reference_module(options):
  layer = layers.Mamba3(d_state=8, head_dim=4, **options)
  x, reset = _x((29, 6)), _resets(29)
  params = _perturbed(compiled.init(layer, x.shape, 13), 4)
  expected = _mamba3_reference(_params64(params), np.asarray(x, np.float64), reset, d_state=8,
                               head_dim=4, **options)
  _assert_close(compiled.run(layer, mode="chunked")(params, x, reset), expected)
  _assert_close(_stepped(layer, params, x, reset), expected)


def test_mamba3_initialisation_follows_the_reference():
  layer = layers.Mamba3(d_state=16, head_dim=8, mimo_rank=4)
  p = compiled.init(layer, _x((4, 32)).shape, 14)["params"]
  heads = 64 // 8
  # [z, x, B, C, dt, A, lambda, angles]: angles are d_state / 4 (rope_fraction 0.5).
  assert p["in_proj"].shape == (32, 2 * 64 + 2 * 4 * 16 + 3 * heads + 4)
  dt = np.asarray(jax.nn.softplus(p["dt_bias"]), np.float64)
  assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)
  for name, value in (("B_bias", 1), ("C_bias", 1), ("D", 1), ("mimo_x", 0.25), ("mimo_z", 1),
                      ("mimo_o", 0.25)):
    assert np.all(np.asarray(p[name]) == np.float32(value)), name
  assert p["mimo_x"].shape == (heads, 4, 8) and p["B_bias"].shape == (heads, 4, 16)
  bound = 32**-0.5
  assert np.abs(p["in_proj"]).max() <= bound and np.abs(p["in_proj"]).max() > 0.9 * bound
  with pytest.raises(ValueError, match=r"`rope_fraction` must be 0\.5 or 1\.0"):
    layers.Mamba3(rope_fraction=0.25).init(jax.random.key(0), _x((4, 16)))
