"""The Pallas kernels of `linear_attention` and `delta_rule` (`impl="pallas"`), run by Pallas'
interpreter on this machine: values, final state and every gradient against the float64 loop,
resets inside chunks, an initial state, lengths around the chunk of 64, bfloat16, very strong
decays, `vmap`, and the calls they leave to the XLA form (non-finite inputs, `exclusive`,
float64, empty sequences, `jvp`).
"""

import functools
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import references
from ssmkit._src.layers.registry import LAYERS
from ssmkit._src.matrix_state.kernels import routed
from ssmkit.scan import delta_rule, linear_attention

# name: (function, decay per "head", per "key" or None, write strengths beta)
KINDS = {"linear": ("linear", None, False), "ssd": ("linear", "head", False),
         "gla": ("linear", "key", False), "ssd-written": ("linear", "head", True),
         "deltanet": ("delta", None, True), "gated-deltanet": ("delta", "head", True),
         "kda": ("delta", "key", True)}
NAMES = ("q", "k", "v", "log_decay", "beta", "initial_state")
LENGTHS = [1, 63, 64, 65, 1000]  # one step, around the kernels' chunk of 64, many chunks


def _inputs(kind, length, batch=2, heads=2, dim_k=8, dim_v=4, decay=(0.0, 1.0), seed=0):
  """float32 inputs with resets at step 1, in the middle of the sequence and at random."""
  function, decay_kind, written = KINDS[kind]
  rng = np.random.default_rng(seed)
  shape = (batch, length, heads)
  f32 = lambda a: np.asarray(a, np.float32)
  reset = rng.uniform(size=(batch, length)) < 0.05
  reset[:, [min(1, length - 1), length // 2]] = True
  k = rng.normal(size=(*shape, dim_k))
  if function == "delta":  # unit keys, as the layers normalise them
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  return dict(
      function=function, q=f32(rng.normal(size=(*shape, dim_k))), k=f32(k),
      v=f32(rng.normal(size=(*shape, dim_v))),
      log_decay=None if decay_kind is None else f32(-rng.uniform(
          *decay, shape if decay_kind == "head" else (*shape, dim_k))),
      beta=f32(rng.uniform(size=shape)) if written else None,
      initial_state=f32(rng.normal(size=(batch, heads, dim_k, dim_v))), reset=reset)


def _call(x, impl, **kwargs):
  kwargs.update(initial_state=x["initial_state"], reset=x["reset"], return_final_state=True,
                impl=impl)
  if x["function"] == "delta":
    return delta_rule(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], **kwargs)
  return linear_attention(x["q"], x["k"], x["v"], x["log_decay"], beta=x["beta"], **kwargs)


def _split(x):
  names = tuple(n for n in NAMES if x[n] is not None)
  return names, tuple(x[n] for n in names)


@functools.cache
def _vjp(impl, function, names):
  """`(values, reset, cotangents) -> (outputs, final state, gradients)`, compiled once per
  (impl, function, inputs given): one program computes what each test compares."""

  def run(values, reset, cotangents):
    f = lambda *values: _call(dict(dict.fromkeys(NAMES), **dict(zip(names, values, strict=True)),
                                   function=function, reset=reset), impl)
    (out, final), pullback = jax.vjp(f, *values)
    return out, final, pullback(cotangents)

  return jax.jit(run)


def _reference(x, cotangents):
  """The float64 loop's outputs, final state and gradients (autodiff of its `lax.scan`)."""
  x64 = {n: None if x[n] is None else np.asarray(x[n], np.float64) for n in NAMES}
  names, values = _split(x64)

  def arguments(values):
    y = dict(x64, **dict(zip(names, values, strict=True)))
    k, beta = y["k"], y["beta"]
    if x["function"] == "linear" and beta is not None:  # linear attention writes beta k^T v
      k, beta = k * beta[..., None], None
    return y["q"], k, y["v"], y["log_decay"], beta, y["initial_state"], x["reset"]

  out, final = references.matrix_state(*arguments(values))
  scan = lambda *values: references.matrix_state_scan(*arguments(values))
  grads = jax.vjp(scan, *values)[1](tuple(np.asarray(c, np.float64) for c in cotangents))
  return out, final, grads


def _cotangents(x, seed=1):
  rng = np.random.default_rng(seed)
  out_shape = (*x["v"].shape[:-1], x["v"].shape[-1])
  return (np.asarray(rng.normal(size=out_shape), np.float32),
          np.asarray(rng.normal(size=x["initial_state"].shape), np.float32))


def _assert_close(actual, expected, tol):
  expected = np.asarray(expected)
  scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol * scale)


CASES = [(kind, t) for kind in ("ssd", "gla", "gated-deltanet", "kda") for t in LENGTHS] + [
    ("linear", 65), ("ssd-written", 65), ("deltanet", 65)]


@pytest.mark.parametrize(("kind", "length"), CASES, ids=[f"{k}-{t}" for k, t in CASES])
def test_kernels_match_the_float64_loop_in_values_final_state_and_every_gradient(kind, length):
  x = _inputs(kind, length)
  names, values = _split(x)
  cotangents = _cotangents(x)
  out, final, grads = _vjp("pallas", x["function"], names)(values, x["reset"], cotangents)
  want_out, want_final, want_grads = _reference(x, cotangents)
  _assert_close(out, want_out, 1e-5)
  _assert_close(final, want_final, 1e-5)
  for name, got, want in zip(names, grads, want_grads, strict=True):
    assert got.dtype == np.float32, name
    _assert_close(got, want, 1e-5)


@pytest.mark.parametrize("kind", ["ssd", "gla", "kda"])
def test_very_strong_decays_stay_finite_and_exact(kind):
  """Decays of 40-60 nats a step: a chunk decays by thousands, far past float32's range, so
  the per-key kernels must score inside blocks pair by pair and select before `exp`."""
  x = _inputs(kind, 65, decay=(40.0, 60.0))
  names, values = _split(x)
  cotangents = _cotangents(x)
  out, final, grads = _vjp("pallas", x["function"], names)(values, x["reset"], cotangents)
  want_out, want_final, want_grads = _reference(x, cotangents)
  for got, want in zip((out, final, *grads), (want_out, want_final, *want_grads), strict=True):
    assert np.all(np.isfinite(got))
    _assert_close(got, want, 1e-5)


@pytest.mark.parametrize("kind", ["ssd", "gla", "gated-deltanet", "kda"])
def test_bfloat16_inputs_are_as_close_to_the_float64_loop_as_the_xla_form(kind):
  x = _inputs(kind, 65)
  x16 = {n: jnp.asarray(x[n], jnp.bfloat16) if n in NAMES and x[n] is not None else x[n]
         for n in x}
  rounded = {n: np.asarray(a, np.float32) if n in NAMES and a is not None else a
             for n, a in x16.items()}
  want, want_final, _ = _reference(rounded, _cotangents(x))
  arrays = {n: a for n, a in x16.items() if n != "function"}
  run = lambda impl: jax.jit(lambda y: _call(dict(y, function=x["function"]), impl))(arrays)
  (out, final), (xla_out, _) = run("pallas"), run("xla")
  assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
  scale = np.max(np.abs(want))
  xla_error = np.max(np.abs(np.asarray(xla_out, np.float64) - want)) / scale
  assert np.max(np.abs(np.asarray(out, np.float64) - want)) / scale <= 1.5 * xla_error + 1e-3
  _assert_close(final, want_final, 1e-5)  # the state accumulates in float32 from the same inputs


def test_vmap_of_the_gradient_is_the_gradient_of_each_row():
  x = _inputs("gla", 20)
  names, values = _split(x)
  per_row = lambda row: _vjp("pallas", "linear", names)(
      tuple(v[row:row + 1] for v in values), x["reset"][row:row + 1],
      tuple(c[row:row + 1] for c in _cotangents(x)))
  batched = jax.vmap(lambda values, reset, cots: _vjp("pallas", "linear", names)(
      values, reset, cots))(
      tuple(v[:, None] for v in values), x["reset"][:, None],
      tuple(c[:, None] for c in _cotangents(x)))
  for row in range(2):
    for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(per_row(row)), strict=True):
      _assert_close(got[row], want, 1e-6)


def test_a_nan_before_a_reset_reaches_nothing_after_it_through_the_xla_form():
  """A non-finite input, or cotangent, sends the call to the XLA form, which keeps a NaN before
  a reset out of every output and gradient after it: they equal the XLA form's on clean
  inputs to the last bit."""
  x = _inputs("ssd", 40)
  x["reset"][:] = False
  x["reset"][:, 20] = True
  names, values = _split(x)
  cotangents = _cotangents(x)
  run = _vjp("pallas", "linear", names)
  clean = _vjp("xla", "linear", names)(values, x["reset"], cotangents)
  poisoned = dict(x, v=x["v"].copy())
  poisoned["v"][:, 7] = np.nan
  out, final, grads = run(_split(poisoned)[1], x["reset"], cotangents)
  np.testing.assert_array_equal(out[:, 20:], clean[0][:, 20:])
  np.testing.assert_array_equal(final, clean[1])
  for got, want in zip(grads, clean[2], strict=True):
    if got.ndim >= 3 and got.shape[1] == 40:  # per-step inputs: from the reset on
      np.testing.assert_array_equal(got[:, 20:], want[:, 20:])
  d_out = cotangents[0].copy()
  d_out[:, 5] = np.inf
  grads = run(values, x["reset"], (d_out, cotangents[1]))[2]
  for got, want in zip(grads, clean[2], strict=True):
    if got.ndim >= 3 and got.shape[1] == 40:
      np.testing.assert_array_equal(got[:, 20:], want[:, 20:])


def _runs_kernels(f, *args) -> bool:
  return "pallas_call" in str(jax.make_jaxpr(f)(*args))


def test_the_xla_form_takes_what_the_kernels_do_not():
  x = _inputs("ssd", 8)
  q, k, v, g = x["q"], x["k"], x["v"], x["log_decay"]
  assert _runs_kernels(lambda q: linear_attention(q, k, v, g, impl="pallas"), q)
  beta = np.full(g.shape, 0.5, np.float32)
  assert _runs_kernels(lambda q: delta_rule(q, k, v, beta, g, impl="pallas"), q)
  assert not _runs_kernels(lambda q: delta_rule(q, k, v, beta, g), q)
  # "auto" has not been timed faster with the kernels on any backend yet
  assert not _runs_kernels(lambda q: linear_attention(q, k, v, g), q)
  assert not _runs_kernels(lambda q: linear_attention(q, k, v, g, impl="pallas",
                                                      exclusive=True), q)
  as64 = lambda a: np.asarray(a, np.float64)
  assert not _runs_kernels(lambda q: linear_attention(q, as64(k), as64(v), as64(g),
                                                      impl="pallas"), as64(q))
  empty = linear_attention(q[:, :0], k[:, :0], v[:, :0], g[:, :0], impl="pallas")
  assert empty.shape == (2, 0, 2, 4)
  with pytest.raises(ValueError, match="`impl` must be one of 'xla', 'pallas', 'auto'"):
    linear_attention(q, k, v, g, impl="triton")
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda q: linear_attention(q, k, v, g, impl="pallas"), (q,), (q,))


def test_the_kernels_take_every_finite_call_and_one_answer_serves_a_vmapped_batch():
  finite = np.ones((3, 4), np.float32)
  bad = finite.copy()
  bad[1, 2] = np.nan
  assert bool(routed.all_finite([finite, finite]))
  assert not bool(routed.all_finite([finite, bad]))
  # One row with a NaN sends the whole batch to the XLA form: one branch runs, not both.
  np.testing.assert_array_equal(jax.vmap(lambda a: routed.all_finite([a]))(bad), [False] * 3)


def test_the_kernels_lower_to_triton_for_nvidia_gpus():
  """What runs interpreted here compiles on a GPU: every kernel, forward and backward, one decay
  per head and per key, lowers through Pallas' Triton lowering (exported for CUDA, in a process
  of its own: `lower_for_cuda.py`)."""
  run = subprocess.run([sys.executable, str(pathlib.Path(__file__).parent / "lower_for_cuda.py")],
                       capture_output=True, text=True, timeout=240)
  assert run.returncode == 0, run.stderr[-3000:]
  lines = run.stdout.splitlines()
  assert len(lines) == 8 and all(line.endswith(" triton") for line in lines), run.stdout


@pytest.mark.parametrize("name", ["mamba2", "gated_deltanet", "kimi_delta_attention"])
def test_a_layer_with_impl_pallas_runs_the_kernels_to_the_xla_forms_outputs_and_gradients(name):
  entry = LAYERS[name]
  x = np.random.default_rng(0).normal(size=(2, 70, 8)).astype(np.float32)
  reset = np.zeros((2, 70), bool)
  reset[:, 33] = True
  layers = {impl: entry.layer(**entry.test_configs[0], impl=impl) for impl in ("xla", "pallas")}
  params = layers["xla"].init(jax.random.key(0), x)
  results = {}
  for impl, layer in layers.items():
    loss = lambda params, x, layer=layer: jnp.sum(jnp.sin(layer.apply(params, x, reset)))
    program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    assert ("pallas_call" in str(jax.make_jaxpr(program)(params, x))) == (impl == "pallas")
    results[impl] = program(params, x)
  for got, want in zip(jax.tree.leaves(results["pallas"]), jax.tree.leaves(results["xla"]),
                       strict=True):
    _assert_close(got, want, 1e-5)


@pytest.mark.parametrize("per_key", [False, True], ids=["per-head", "per-key"])
@pytest.mark.parametrize("function", ["linear", "delta"])
def test_grouped_heads_equal_their_repeated_heads_by_either_implementation(function, per_key):
  """q and k with H / G heads, value head h reading head h // G (Mamba-2's groups, Qwen3-Next's
  value heads): the same outputs, state and gradients as q and k repeated G times, the
  gradients of q and k summed over each group."""
  groups, heads = 3, 2
  x = _inputs({("linear", False): "ssd-written", ("linear", True): "gla",
               ("delta", False): "gated-deltanet", ("delta", True): "kda"}[function, per_key],
              40, heads=heads * groups)
  x["q"], x["k"] = x["q"][:, :, :heads], x["k"][:, :, :heads]
  names, values = _split(x)
  cotangents = _cotangents(x)
  repeat = lambda a: np.repeat(a, groups, axis=2)
  want = _vjp("xla", function, names)(
      tuple(repeat(v) if n in ("q", "k") else v for n, v in zip(names, values, strict=True)),
      x["reset"], cotangents)
  # The gradient of a shared head is the sum over the heads that read it.
  want = (*want[:2], tuple(g.reshape((*g.shape[:2], heads, groups, -1)).sum(axis=3)
                           if n in ("q", "k") else g for n, g in zip(names, want[2], strict=True)))
  for impl in ("xla", "pallas"):
    got = _vjp(impl, function, names)(values, x["reset"], cotangents)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      _assert_close(a, b, 1e-5)
