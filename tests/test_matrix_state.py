"""`linear_attention`, `delta_rule`, `delta_product` and `generalized_delta_rule`: every mode
against a float64 loop, gradients, resets, streaming, dtypes, memory and errors.

The reference (`references.matrix_state`) runs the recurrence one step at a time in float64
NumPy; `references.matrix_state_scan` is the same loop as a `lax.scan`, to differentiate.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import references
from ssmkit._src import modes
from ssmkit._src.matrix_state import chunks
from ssmkit.scan import delta_product, delta_rule, generalized_delta_rule, linear_attention

# (name, function, decay kind): every decay each function takes.
KINDS = [
    ("linear", "linear", None),
    ("ssd", "linear", "head"),
    ("gla", "linear", "key"),
    ("deltanet", "delta", None),
    ("gated-deltanet", "delta", "head"),
    ("kda", "delta", "key"),
    ("rwkv7", "dplr", "key"),
    ("gated-deltaproduct", "product", "head"),
    # linear attention with write strengths beta ("written"), and reading the state before
    # each step's write ("exclusive", with write strengths)
    ("ssd-written", "written", "head"),
    ("linear-exclusive", "exclusive", None),
    ("ssd-exclusive", "exclusive", "head"),
    ("gla-exclusive", "exclusive", "key"),
]
KIND_IDS = [k[0] for k in KINDS]
MODES = ["sequential", "chunked", "parallel", "auto"]
LENGTHS = [0, 1, 7, 64, 257]  # none, one step, part of a chunk, whole chunks, a prime
CHUNK = 16  # chunk edges at 16, 32, ...; "auto" keeps the default chunk of 64
TOL64 = 1e-8


PRODUCTS = 2  # delta-rule steps per token of the delta product
WRITE_STRENGTHS = ("delta", "product", "written", "exclusive")  # the functions given beta


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _inputs(rng, kind, batch, length, heads=2, dim_k=5, dim_v=3, reset_rate=0.1, decay=(0.0, 1.0)):
  """Random inputs of one kind, log-decays drawn from [-decay[1], -decay[0]]: unit-norm keys and
  beta in (0, 1) for the delta rule and its products, RWKV-7's a = -kappa and
  b = kappa * alpha (kappa unit, alpha in (0, 1)) for the generalized delta rule."""
  _, function, decay_kind = kind
  shape = (*batch, length, heads)
  steps = (*batch, length, PRODUCTS, heads) if function == "product" else shape
  q = rng.normal(size=(*shape, dim_k))
  k = rng.normal(size=(*steps, dim_k))
  if function in ("delta", "product"):
    k = _unit(k)
  v = rng.normal(size=(*steps, dim_v))
  g = {None: None, "head": -rng.uniform(*decay, shape),
       "key": -rng.uniform(*decay, (*shape, dim_k))}[decay_kind]
  kappa = _unit(rng.normal(size=(*shape, dim_k)))
  dplr = function == "dplr"
  return dict(
      q=q, k=k, v=v, log_decay=g,
      beta=rng.uniform(0.0, 1.0, steps) if function in WRITE_STRENGTHS else None,
      a=-kappa if dplr else None,
      b=kappa * rng.uniform(0.0, 1.0, kappa.shape) if dplr else None,
      initial_state=rng.normal(size=(*batch, heads, dim_k, dim_v)),
      reset=rng.uniform(size=(*batch, length)) < reset_rate,
  )


def _call(kind, x, **kwargs):
  """The function under test for `kind` on the inputs `x` (a dict of `_inputs`)."""
  kwargs.update(initial_state=x["initial_state"], reset=x["reset"])
  match kind[1]:
    case "linear" | "written" | "exclusive":
      return linear_attention(x["q"], x["k"], x["v"], x["log_decay"], beta=x["beta"],
                              exclusive=kind[1] == "exclusive", **kwargs)
    case "delta":
      return delta_rule(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], **kwargs)
    case "product":
      return delta_product(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], **kwargs)
    case "dplr":
      return generalized_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], x["log_decay"],
                                    **kwargs)


def _reference(kind, x, differentiable=False):
  loop = references.matrix_state_scan if differentiable else references.matrix_state
  k, beta = x["k"], x["beta"]
  if kind[1] in ("written", "exclusive"):  # linear attention writes beta_t k_t^T v_t
    k, beta = k * beta[..., None], None
  return loop(x["q"], k, x["v"], x["log_decay"], beta, x["initial_state"], x["reset"],
              x["a"], x["b"], exclusive=kind[1] == "exclusive")


def _assert_close(actual, expected, tol):
  expected = np.asarray(expected)
  scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=tol, atol=tol * scale)


@functools.cache
def _jitted(kind, mode, chunk_size):
  """One compiled function per case, shared by the tests that use it."""
  return jax.jit(functools.partial(_call, kind, mode=mode, chunk_size=chunk_size,
                                   return_final_state=True))


def _chunk(mode):
  return None if mode == "auto" else CHUNK


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_every_mode_matches_float64_loop(kind, mode):
  rng = np.random.default_rng(7)
  batches = [(), (2,), (2, 1), (3,)]
  for i, length in enumerate(LENGTHS):
    x = _inputs(rng, kind, batches[i % len(batches)], length)
    out, final = _jitted(kind, mode, _chunk(mode))(x)
    expected, expected_final = _reference(kind, x)
    assert out.dtype == jnp.float64 and final.dtype == jnp.float64
    chex.assert_shape(out, (*x["q"].shape[:-1], x["v"].shape[-1]))
    _assert_close(out, expected, TOL64)
    _assert_close(final, expected_final, TOL64)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_resets_at_chunk_edges_and_inside_chunks(kind):
  rng = np.random.default_rng(3)
  x = _inputs(rng, kind, (2,), 70, reset_rate=0.0)
  x["reset"][0, [0, 15, 16, 17, 32, 69]] = True  # first step, chunk edges, inside chunks
  x["reset"][1, [5, 6, 47]] = True
  expected, expected_final = _reference(kind, x)
  for mode in ("chunked", "parallel"):
    out, final = _jitted(kind, mode, CHUNK)(x)
    _assert_close(out, expected, TOL64)
    _assert_close(final, expected_final, TOL64)


# Decays whose chunk scores take each path of `chunks.per_key_scores` in the chunks of 16 steps:
# one product (float64), blocks of 8 steps, and step pair by step pair (float32).
CUT_DECAYS = [((0.0, 1.0), np.float64), ((4.0, 6.0), np.float32), ((47.0, 50.0), np.float32)]


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_reset_cuts_every_information_before_it_exactly(kind):
  """Outputs at and after a reset, the final state and the gradients of the inputs from the
  reset on are the same to the last bit whatever came before it, in every mode: each document
  of a packed row is computed as if alone. The resets fall inside chunks (of 4, 5, 8 and 16
  steps, and of "auto"'s 64 or 32), and every input before them changes, the initial state
  too."""
  first = [26, 21]  # each row's first reset; row 1 has a second one at 50
  for decay, dtype in CUT_DECAYS:
    x = _inputs(np.random.default_rng(4), kind, (2,), 70, reset_rate=0.0, decay=decay)
    x["reset"][0, first[0]] = x["reset"][1, first[1]] = x["reset"][1, 50] = True
    other = _inputs(np.random.default_rng(5), kind, (2,), 70, reset_rate=0.0, decay=decay)
    y = dict(x, initial_state=other["initial_state"])
    for name in ("q", "k", "v", "log_decay", "beta", "a", "b"):
      if y[name] is not None:
        y[name] = y[name].copy()
        for row, start in enumerate(first):
          y[name][row, :start] = other[name][row, :start]
    x, y = ({n: a if a is None or n == "reset" else a.astype(dtype) for n, a in d.items()}
            for d in (x, y))
    for mode in MODES:
      out_x, final_x = _jitted(kind, mode, _chunk(mode))(x)
      out_y, final_y = _jitted(kind, mode, _chunk(mode))(y)
      for row, start in enumerate(first):
        np.testing.assert_array_equal(out_x[row, start:], out_y[row, start:], err_msg=mode)
        assert not np.allclose(out_x[row, :start], out_y[row, :start], atol=0)
      np.testing.assert_array_equal(final_x, final_y, err_msg=mode)
    # The loss reads the outputs from the first reset on (the gradient tests' programs).
    read = np.arange(70)[None] >= np.array(first)[:, None]
    names = tuple(_differentiable(x))
    for mode, chunk in LAYOUTS if dtype == np.float64 else LAYOUTS[1:3]:
      grad = _derivatives(_jitted(kind, mode, chunk), names)[0]
      grads_x, grads_y = (grad(tuple(d[n] for n in names), dict(d, read=read)) for d in (x, y))
      for name, got_x, got_y in zip(names, grads_x, grads_y, strict=True):
        if name == "initial_state":  # before every reset
          continue
        for row, start in enumerate(first):
          np.testing.assert_array_equal(got_x[row, start:], got_y[row, start:],
                                        err_msg=f"{mode} {name}")


NON_FINITE_CASES = [
    (kind, name)
    for kind in KINDS
    for name in ("q", "k", "v", "log_decay", "beta", "a", "b", "initial_state")
    if (name != "log_decay" or kind[2]) and (name != "beta" or kind[1] in WRITE_STRENGTHS)
    and (name not in ("a", "b") or kind[1] == "dplr")
]
NON_FINITE_IDS = [f"{k[0]}-{n}" for k, n in NON_FINITE_CASES]
# Chunk layouts that put a non-finite step and the reset after it in one chunk and in two: the
# tests' steps 3 and 6 fall in two chunks of 5, their later pair (10 and 13, 50 and 53) in one,
# and chunks of 8 hold both pairs.
LAYOUTS = (("sequential", 4), ("chunked", 5), ("parallel", 8), ("auto", None))


def _poisoned(kind, name, length, bad, resets):
  """Two rows of inputs: the second with a NaN at step bad[0] and an Inf at bad[1] of `name`
  (for `initial_state`: an Inf entry) and resets at `resets`, the first clean and without
  resets (nothing may reach it from the other row)."""
  x = _inputs(np.random.default_rng(5), kind, (2,), length, reset_rate=0.0)
  x["reset"][1, list(resets)] = True
  if name == "initial_state":
    x[name][1, 1, 0, 0] = np.inf
  else:
    # A traced decay: concrete non-finite decays are refused at trace time.
    x[name][1, bad[0], 1] = np.nan
    x[name][1, bad[1], 0] = np.inf
  return x


@pytest.mark.parametrize("kind, name", NON_FINITE_CASES, ids=NON_FINITE_IDS)
def test_nan_or_inf_before_a_reset_never_leaks_past_it(kind, name):
  x = _poisoned(kind, name, 20, bad=(3, 10), resets=(6, 13))
  expected, expected_final = _reference(kind, x)
  for mode, chunk in LAYOUTS[:-1]:
    out, final = _jitted(kind, mode, chunk)(x)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(out), finite)
    np.testing.assert_array_equal(np.isfinite(final), np.isfinite(expected_final))
    _assert_close(np.asarray(out)[finite], expected[finite], TOL64)
    assert np.all(np.isfinite(np.asarray(out)[:, 14:]))


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_a_non_finite_state_spreads_as_the_steps_spread_it(kind):
  """An Inf in the entering state with `reset` given but never set: the outputs and the final
  state are non-finite exactly where the float64 loop's are (with resets, the chunks read the
  state with its non-finite entries zeroed and restore them after)."""
  x = _poisoned(kind, "initial_state", 20, bad=None, resets=())
  expected, expected_final = _reference(kind, x)
  for mode, chunk in LAYOUTS[:-1]:
    out, final = _jitted(kind, mode, chunk)(x)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(expected))
    np.testing.assert_array_equal(np.isfinite(final), np.isfinite(expected_final))


def test_delta_product_with_one_decay_per_key_reads_only_its_tokens_last_steps():
  """The chunked forms score only the steps that are read: each token's last; with one decay
  per key channel too (every query is scored there, the read rows kept), across resets and a
  NaN before one."""
  kind = ("kda-product", "product", "key")
  x = _inputs(np.random.default_rng(9), kind, (2,), 37)
  x["reset"][1, 20] = True
  x["k"][1, 18, 1, 0] = np.nan
  expected, expected_final = _reference(kind, x)
  for mode in ("chunked", "parallel"):
    out, final = _jitted(kind, mode, CHUNK)(x)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(expected))
    finite = np.isfinite(expected)
    _assert_close(np.asarray(out)[finite], expected[finite], TOL64)
    _assert_close(final, expected_final, TOL64)


@pytest.mark.parametrize("kind, name", NON_FINITE_CASES, ids=NON_FINITE_IDS)
def test_nan_or_inf_before_a_reset_never_reaches_gradients_after_it(kind, name):
  """The loss reads the outputs from the last reset on: every gradient the float64 loop keeps
  finite is finite and equal, so all of those after the reset (a poisoned state read back as
  0 * NaN, or a zero cotangent times a NaN query, would break it)."""
  start = 53
  x = _poisoned(kind, name, 70, bad=(3, 50), resets=(6, start))
  x["read"] = np.broadcast_to(np.arange(70) >= start, x["reset"].shape)
  names = tuple(_differentiable(x))
  values = tuple(x[n] for n in names)
  expected = _derivatives(_reference_scan(kind), names)[0](values, x)
  for mode, chunk in LAYOUTS:
    grads = _derivatives(_jitted(kind, mode, chunk), names)[0](values, x)
    for n, got, want in zip(names, grads, expected, strict=True):
      got, want = np.asarray(got), np.asarray(want)
      if n != "initial_state":
        assert np.all(np.isfinite(got[:, start:])), (mode, chunk, n)
      kept = np.isfinite(want)
      if kind[2] == "key" and kind[1] != "linear" and name == "initial_state" and n == "log_decay":
        # The loop's first step scales each key row of S apart, so its decays' gradients stay
        # finite for the finite rows; the chunked form sums every later step of the chunk
        # into them, and those read the whole poisoned state. Both are before the reset.
        kept[1, 0] = False
      assert np.all(np.isfinite(got[kept])), (mode, chunk, n)
      _assert_close(got[kept], want[kept], 1e-8)


def _loss(f, names):
  """sum(sin(o)) + sum(S_T^2) as a function `(values, x)` of the inputs `names` (their values
  in that order) and the other inputs `x`; where `x` has a `(..., T)` mask `read`, only the
  outputs it selects (the others get zero cotangents, not 0 * cos(NaN))."""

  def loss(values, x):
    out, final = f(dict(x, **dict(zip(names, values, strict=True))))
    terms = jnp.sin(out)
    if "read" in x:
      terms = jnp.where(x["read"][..., None, None], terms, 0.0)
    return jnp.sum(terms) + jnp.sum(final**2)

  return loss


@functools.cache
def _reference_scan(kind):
  """The differentiable float64 loop of `kind`, one function per kind (`_derivatives` caches by
  function)."""
  return functools.partial(_reference, kind, differentiable=True)


@functools.cache
def _derivatives(f, names):
  """`(values, x) -> gradients` and `(values, tangents, x) -> jvp` of `_loss(f, names)`, each
  compiled once and shared by the tests and dtypes that use them."""
  loss = _loss(f, names)
  return (jax.jit(jax.grad(loss)),
          jax.jit(lambda values, tangents, x: jax.jvp(lambda v: loss(v, x), (values,), (tangents,))[1]))


def _differentiable(x):
  return [n for n in ("q", "k", "v", "log_decay", "beta", "a", "b", "initial_state")
          if x[n] is not None]


def _check_gradients_and_jvp(kind, x, tol, modes=LAYOUTS, with_jvp=True):
  """The gradients (and JVPs) of `modes` (mode, chunk size) against autodiff of the float64
  loop on the same inputs, every output read (the programs the tests of non-finite inputs
  run)."""
  rng = np.random.default_rng(11)
  x = dict(x, read=np.ones(x["reset"].shape, bool))
  names = tuple(_differentiable(x))
  values = tuple(x[n] for n in names)
  tangents = tuple(rng.normal(size=np.shape(v)).astype(v.dtype) for v in values)
  as64 = lambda tree: jax.tree.map(
      lambda a: np.asarray(a, np.float64) if a.dtype.kind == "f" else a, tree)
  grad, jvp = _derivatives(_reference_scan(kind), names)
  expected = grad(as64(values), as64(x))
  expected_jvp = jvp(as64(values), as64(tangents), as64(x)) if with_jvp else None
  # On CPU, "auto" differentiates the chunked form (70 >= 64 steps); linear attention computes
  # its values chunked too, the delta rules step by step (far below 2^15 row-head-steps).
  for mode, chunk in modes:
    grad, jvp = _derivatives(_jitted(kind, mode, chunk), names)
    for g, e in zip(grad(values, x), expected, strict=True):
      _assert_close(g, e, tol)
    if with_jvp:
      _assert_close(jvp(values, tangents, x), expected_jvp, tol)


# The decaying kinds: without decays (linear attention, DeltaNet) the same code runs with zeros.
DECAYING = [kind for kind in KINDS if kind[2]]


@pytest.mark.parametrize("kind", DECAYING, ids=[kind[0] for kind in DECAYING])
def test_gradients_and_jvp_match_autodiff_of_float64_loop(kind):
  _check_gradients_and_jvp(kind, _inputs(np.random.default_rng(11), kind, (2,), 70), 1e-6)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", DECAYING, ids=[kind[0] for kind in DECAYING])
def test_strong_decays_stay_finite_in_values_and_derivatives(kind, dtype):
  """Log-decays of -47 to -50 a step: 16 steps span more than 709 nats, past exp's range in
  float64 as in float32, so only exponents that are differences <= 0 stay finite."""
  x = _inputs(np.random.default_rng(21), kind, (2,), 70, decay=(47.0, 50.0))
  x = {n: v if v is None or n == "reset" else v.astype(dtype) for n, v in x.items()}
  tol = 1e-8 if dtype == np.float64 else 1e-4
  expected, expected_final = _reference(kind, x)
  for mode in MODES:
    out, final = _jitted(kind, mode, _chunk(mode))(x)
    assert out.dtype == dtype
    _assert_close(out, expected, tol)
    _assert_close(final, expected_final, tol)
  # Step by step each decay is one factor exp(g) >= exp(-50), in range: the chunked forms are
  # the ones whose exponents must stay differences ("auto" differentiates the chunked one).
  _check_gradients_and_jvp(kind, x, 1e-6 if dtype == np.float64 else 1e-3, modes=LAYOUTS[1:3])


@pytest.mark.parametrize("kind", DECAYING, ids=[kind[0] for kind in DECAYING])
def test_mild_decays_after_a_vanishing_one_keep_float32_precision(kind):
  """A step of log-decay -1000 inside a chunk, mild decays around it: in float32, every
  mode's outputs and final state lie within float32's rounding of the float64 loop. The decays
  between the later steps are about 0.05 nats; as differences of sums from the chunk's start
  (near -1000, spaced 6e-5 apart) they came out up to 6e-3 off."""
  x = _inputs(np.random.default_rng(23), kind, (2,), 70, reset_rate=0.0, decay=(0.0, 0.1))
  x["log_decay"][:, [3, 21, 40]] = -1000.0
  x = {n: v if v is None or n == "reset" else v.astype(np.float32) for n, v in x.items()}
  expected, expected_final = _reference(kind, x)
  for mode in MODES:
    out, final = _jitted(kind, mode, _chunk(mode))(x)
    _assert_close(out, expected, 1e-5)
    _assert_close(final, expected_final, 1e-5)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_one_batch_row_takes_groups_of_heads_as_batch_rows(kind):
  """With one batch row the chunked forms move groups of heads to the batch axis: 6 heads as
  2 rows of 3, with resets and a starting state; values, final state and gradients against
  the float64 loop (the layout only moves axes, so JVPs follow from the values)."""
  assert chunks.head_groups(1, 6) == 2
  x = _inputs(np.random.default_rng(13), kind, (), 37, heads=6)
  expected, expected_final = _reference(kind, x)
  for mode in ("chunked", "parallel"):
    out, final = _jitted(kind, mode, 8)(x)
    _assert_close(out, expected, TOL64)
    _assert_close(final, expected_final, TOL64)
  _check_gradients_and_jvp(kind, x, 1e-6, modes=(("chunked", 8),), with_jvp=False)


PER_KEY = [kind for kind in KINDS if kind[2] == "key"]


@pytest.mark.parametrize("kind", PER_KEY, ids=[kind[0] for kind in PER_KEY])
def test_per_key_decays_take_each_path_of_the_chunk_scores(kind):
  """Chunks of 64 steps whose decays factor over the whole chunk (a span under 480 nats in
  float64), and chunks that go through blocks of 8 steps (8 to 12 and 61 to 64 nats a step:
  past the limit over a chunk, or over a block too)."""
  for decay in ((0.0, 1.0), (8.0, 12.0), (61.0, 64.0)):
    x = _inputs(np.random.default_rng(22), kind, (), 70, decay=decay)
    expected, expected_final = _reference(kind, x)
    out, final = _jitted(kind, "chunked", 64)(x)
    _assert_close(out, expected, TOL64)
    _assert_close(final, expected_final, TOL64)


@pytest.mark.parametrize("kind", PER_KEY, ids=[kind[0] for kind in PER_KEY])
def test_the_pairwise_form_over_groups_of_chunks_equals_the_loop(kind, monkeypatch):
  """Nine chunks of 8 steps at once ("parallel"), scored step pair by step pair in three groups
  of three: the loop a long sequence on a large batch takes to bound its memory."""
  x = _inputs(np.random.default_rng(23), kind, (), 70, decay=(61.0, 64.0))
  heads, dim_k = x["q"].shape[-2:]
  monkeypatch.setattr(chunks, "_PAIRWISE_NUMBERS", 3 * heads * 8 * 8 * dim_k)
  assert chunks._pairwise_group((1, heads, 9, 8, dim_k)) == 3
  out, final = jax.jit(functools.partial(_call, kind, mode="parallel", chunk_size=8,
                                         return_final_state=True))(x)
  expected, expected_final = _reference(kind, x)
  _assert_close(out, expected, TOL64)
  _assert_close(final, expected_final, TOL64)


def _primitives(jaxpr):
  """`(name, inner jaxprs)` of every equation of `jaxpr`, at any depth."""
  for eqn in jaxpr.eqns:
    inner = [j.jaxpr if hasattr(j, "jaxpr") else j for j in jax.core.jaxprs_in_params(eqn.params)]
    yield eqn.primitive.name, inner
    for j in inner:
      yield from _primitives(j)


def _conds(jaxpr, branches: int, loops: bool = False) -> int:
  """How many `cond`s in `jaxpr` choose between `branches` branches (that each hold a loop)."""
  has_loop = lambda j: any(name == "scan" for name, _ in _primitives(j))
  return sum(name == "cond" and len(inner) == branches and (not loops or all(map(has_loop, inner)))
             for name, inner in _primitives(jaxpr.jaxpr))


def test_vmap_keeps_one_choice_of_the_chunk_scores_for_the_whole_batch():
  """Under `vmap` the chunked loop is still chosen by one `lax.cond` for the whole batch (and
  the parallel form's scores by one `lax.switch`), not run in every form and selected row by
  row, for linear attention and the delta rule: a row with strong decays (47 to 50 nats a
  step) sends every row through the safe form, and both rows of KDA match the float64 loop in
  values and gradients."""
  rng = np.random.default_rng(24)

  def stacked(rows, dtype=None):  # the rows on a leading axis, for `vmap` to map
    return {n: None if rows[0][n] is None else np.asarray(np.stack([r[n] for r in rows]), dtype)
            for n in rows[0]}

  def batch(kind):  # a mildly decaying row and a strongly decaying one, and the chunked form
    rows = [_inputs(rng, kind, (), 37, decay=decay) for decay in ((0.0, 1.0), (47.0, 50.0))]
    return rows, stacked(rows), functools.partial(_call, kind, mode="chunked", chunk_size=8,
                                                  return_final_state=True)

  for kind in (KINDS[2], KINDS[5]):  # GLA, KDA
    _, x, f = batch(kind)
    assert _conds(jax.make_jaxpr(jax.vmap(f))(x), 2, loops=True) == 1
    assert _conds(jax.make_jaxpr(jax.vmap(functools.partial(f, mode="parallel")))(x), 3) >= 1
  kind = KINDS[5]
  rows, x, f = batch(kind)
  names = tuple(_differentiable(x))
  out, final = jax.jit(jax.vmap(f))(x)
  grads = jax.jit(jax.vmap(jax.grad(_loss(f, names))))(tuple(x[n] for n in names), x)
  expected_grad, _ = _derivatives(_reference_scan(kind), names)
  for i, row in enumerate(rows):
    expected, expected_final = _reference(kind, row)
    _assert_close(out[i], expected, TOL64)
    _assert_close(final[i], expected_final, TOL64)
    for g, e in zip(grads, expected_grad(tuple(row[n] for n in names), row), strict=True):
      _assert_close(g[i], e, 1e-6)
  # In float32, in chunks of 64 steps, rows without resets or an entering state, each its own
  # mapped element: the safe form's gradient once held a seven-axis sum that crashed jaxlib
  # 0.10.2's CPU runtime (jax-ml/jax#40412).
  rows = [dict(_inputs(rng, kind, (), 64, decay=(47.0, 50.0)), reset=None, initial_state=None)
          for _ in range(3)]
  x = stacked(rows, np.float32)
  names = tuple(_differentiable(x))
  f = functools.partial(f, chunk_size=64)
  grads = jax.jit(jax.vmap(jax.grad(_loss(f, names))))(tuple(x[n] for n in names), x)
  expected_grad, _ = _derivatives(_reference_scan(kind), names)
  for i, row in enumerate(rows):
    for g, e in zip(grads, expected_grad(tuple(row[n] for n in names), row), strict=True):
      _assert_close(g[i], e, 1e-4)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_gradients_match_finite_differences(kind):
  """Central differences of the loss along random directions of every input at once equal its
  JVP along them and the gradient's inner product with them (the chunked programs of the
  gradient tests, on their inputs)."""
  rng = np.random.default_rng(12)
  x = dict(_inputs(np.random.default_rng(11), kind, (2,), 70), read=np.ones((2, 70), bool))
  names = tuple(_differentiable(x))
  values = tuple(x[n] for n in names)
  f = _jitted(kind, *LAYOUTS[1])
  loss, (grad, jvp) = jax.jit(_loss(f, names)), _derivatives(f, names)
  gradients = grad(values, x)
  eps = 1e-5
  for _ in range(3):
    tangents = tuple(rng.normal(size=v.shape) for v in values)
    moved = [tuple(v + sign * eps * t for v, t in zip(values, tangents, strict=True))
             for sign in (1, -1)]
    numeric = (loss(moved[0], x) - loss(moved[1], x)) / (2 * eps)
    inner = sum(np.vdot(g, t) for g, t in zip(gradients, tangents, strict=True))
    np.testing.assert_allclose([jvp(values, tangents, x), inner], [numeric] * 2, rtol=1e-6)


def test_jacfwd_and_hessian_vector_products_work():
  rng = np.random.default_rng(13)
  x = _inputs(rng, KINDS[4], (), 9, heads=1, dim_k=2, dim_v=2)
  f = lambda v: _jitted(KINDS[4], "chunked", 4)(dict(x, v=v))[0]
  reference = lambda v: _reference(KINDS[4], dict(x, v=v), differentiable=True)[0]
  _assert_close(jax.jacfwd(f)(x["v"]), jax.jacfwd(reference)(x["v"]), 1e-9)
  loss = lambda v: jnp.sum(jnp.sin(f(v)))
  tangent = rng.normal(size=x["v"].shape)
  hvp = jax.jvp(jax.grad(loss), (x["v"],), (tangent,))[1]
  expected = jax.jvp(jax.grad(lambda v: jnp.sum(jnp.sin(reference(v)))), (x["v"],), (tangent,))[1]
  _assert_close(hvp, expected, 1e-8)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_streaming_in_pieces_equals_one_pass(kind):
  """Pieces of 23, 1, 1, 80 and 5 steps, each from the state the last one left."""
  rng = np.random.default_rng(14)
  x = _inputs(rng, kind, (2,), 110)
  expected, expected_final = _reference(kind, x)
  state, outs, start = x["initial_state"], [], 0
  for length in (23, 1, 1, 80, 5):
    piece = {n: None if x[n] is None or n == "initial_state" else x[n][:, start:start + length]
             for n in x}
    out, state = _jitted(kind, "auto", None)(dict(piece, initial_state=state))
    outs.append(out)
    start += length
  _assert_close(np.concatenate(outs, axis=1), expected, TOL64)
  _assert_close(state, expected_final, TOL64)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("kind", [KINDS[1], KINDS[4], KINDS[7]],
                         ids=["ssd", "gated-deltanet", "gated-deltaproduct"])
def test_a_decoding_step_runs_no_chunk_machinery(kind, backend, monkeypatch):
  """One step ("auto" on any backend), or one token of the delta product's steps."""
  monkeypatch.setattr(modes.jax, "default_backend", lambda: backend)
  x = _inputs(np.random.default_rng(15), kind, (2,), 1)
  jaxpr = str(jax.make_jaxpr(functools.partial(_call, kind, mode="auto"))(x))
  for primitive in ("scan", "while", "triangular_solve", "cumsum", "dot_general"):
    if primitive == "dot_general":  # the read-out and each write's prediction
      assert jaxpr.count(primitive) <= 1 + (PRODUCTS if kind[1] == "product" else 1), jaxpr
    else:
      assert primitive not in jaxpr, jaxpr


def _abstract(x):
  """Inputs `x` (a dict of `_inputs`) as shapes and dtypes only, to trace without computing."""
  return jax.tree.map(lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype), x)


@pytest.mark.parametrize("kind, rows, length, values", [
    (KINDS[2], 32, 64, "chunked"), (KINDS[2], 16, 4096, "steps"), (KINDS[5], 2, 1 << 14, "chunked"),
    (KINDS[5], 2, 1 << 13, "steps"), (KINDS[7], 2, 1 << 13, "chunked"),
    (KINDS[7], 2, 1 << 12, "steps"), (KINDS[4], 16, 64, "chunked"), (KINDS[4], 8, 1 << 11, "steps")],
    ids=["gla-from-32-rows", "gla-below", "kda-from-2^15", "kda-below", "deltaproduct-from-2^15",
         "deltaproduct-below", "gated-deltanet-from-16-rows", "gated-deltanet-below"])
def test_auto_computes_values_chunked_where_that_is_faster_on_cpu(kind, rows, length, values,
                                                                  monkeypatch):
  """On CPU, "auto" runs the chunked loop alone (values and derivatives) for linear attention
  from 32 (batch row, head) sequences of 64 steps and for the delta rules from 16 such sequences
  or 2^15 (batch row, head, step) triples, the delta product's interleaved steps counted;
  below, its values come from the step loop (traced only, not compiled, with the CPU's rule on
  any machine)."""
  monkeypatch.setattr(modes.jax, "default_backend", lambda: "cpu")
  x = _abstract(_inputs(np.random.default_rng(15), kind, (rows,), length, heads=1, dim_k=2,
                        dim_v=2))
  trace = lambda mode: str(jax.make_jaxpr(functools.partial(_call, kind, mode=mode))(x))
  assert (trace("auto") == trace("chunked")) == (values == "chunked")


@pytest.mark.parametrize("kind", [k for k in KINDS if k[1] != "written"], ids=lambda k: k[0])
def test_auto_on_accelerators_runs_the_tree_for_row_decays_and_the_loop_for_matrices(
    kind, monkeypatch):
  """On GPUs (and TPUs), "auto" combines linear attention's chunk maps (row decays) as a tree
  and runs the delta rules' `(K, K)` maps chunk after chunk, whose tree held 4-7x the memory
  for no speed on an H200 (traced only, not compiled)."""
  monkeypatch.setattr(modes.jax, "default_backend", lambda: "gpu")
  x = _abstract(_inputs(np.random.default_rng(15), kind, (2,), 128, heads=1, dim_k=2, dim_v=2))
  trace = lambda mode: str(jax.make_jaxpr(functools.partial(_call, kind, mode=mode))(x))
  expected = "parallel" if kind[1] in ("linear", "exclusive") else "chunked"
  assert trace("auto") == trace(expected)


def _gradient_trace(kind, x, **options):
  """The jaxpr of the gradient of the sum of `_call`'s outputs, as text (traced only)."""
  loss = lambda x: _call(kind, x, **options).sum()
  return str(jax.make_jaxpr(jax.grad(loss, allow_int=True))(x))


@pytest.mark.parametrize("kind", [KINDS[0], KINDS[1], KINDS[2], KINDS[10]], ids=lambda k: k[0])
def test_linear_attention_on_cpu_takes_chunks_of_32_steps(kind, monkeypatch):
  """On CPU, outside the parallel form, linear attention runs chunks of 32 steps by default
  with a decay per key, and with one decay per head or none from 8 (batch row, head) sequences
  on whose states hold fewer than 2^14 entries, else 64 (traced: the default's program is that
  of the chunk size); its gradients and JVPs there match autodiff of the float64 loop over 70
  steps."""
  monkeypatch.setattr(modes.jax, "default_backend", lambda: "cpu")
  per_key = kind[2] == "key"
  for batch, heads, mode, size, dims in (
      ((4,), 2, "chunked", 32, (5, 3)), ((2, 2), 2, "sequential", 32, (5, 3)),
      ((3,), 2, "chunked", 32 if per_key else 64, (5, 3)), ((2,), 4, "parallel", 64, (5, 3)),
      ((4,), 2, "chunked", 32 if per_key else 64, (128, 128))):
    x = _abstract(_inputs(np.random.default_rng(15), kind, batch, 70, heads=heads, dim_k=dims[0],
                          dim_v=dims[1]))
    assert (_gradient_trace(kind, x, mode=mode, chunk_size=None)
            == _gradient_trace(kind, x, mode=mode, chunk_size=size)), (batch, heads, mode, dims)
  if kind[2]:
    _check_gradients_and_jvp(kind, _inputs(np.random.default_rng(11), kind, (4,), 70), 1e-6,
                             modes=(("auto", None),))


@pytest.mark.parametrize("kind", [k for k in KINDS if k[1] in ("delta", "product")],
                         ids=lambda k: k[0])
def test_delta_rules_on_cpu_take_chunks_of_32_steps_below_large_states(kind, monkeypatch):
  """On CPU the delta rules run chunks of 32 steps by default, and of 64 from states of 2^17
  entries on (K=256 V=512), except with a decay per key (traced only)."""
  monkeypatch.setattr(modes.jax, "default_backend", lambda: "cpu")
  for dim_k, dim_v, size in ((5, 3, 32), (256, 512, 32 if kind[2] == "key" else 64)):
    x = _abstract(_inputs(np.random.default_rng(15), kind, (2,), 70, heads=1, dim_k=dim_k,
                          dim_v=dim_v))
    trace = lambda size, x=x: str(jax.make_jaxpr(functools.partial(
        _call, kind, mode="chunked", chunk_size=size))(x))
    assert trace(None) == trace(size), (dim_k, dim_v)


STREAMED = 60


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_bfloat16_inputs_accumulate_in_float32(kind):
  rng = np.random.default_rng(16)
  x = _inputs(rng, kind, (2,), 150, reset_rate=0.02)
  low = {n: None if x[n] is None or n == "reset" else jnp.asarray(x[n], jnp.bfloat16) for n in x}
  low["reset"] = x["reset"]
  exact = {n: x[n] if n == "reset" or x[n] is None else np.asarray(low[n], np.float64) for n in x}
  expected, expected_final = _reference(kind, exact)
  for mode in ("sequential", "chunked"):
    out, final = _jitted(kind, mode, 64)(low)
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    # Only the final rounding to bfloat16 (8 bits of mantissa) separates them.
    _assert_close(np.asarray(out, np.float64), expected, 2e-2)
    _assert_close(np.asarray(final, np.float64), expected_final, 1e-5)
  # Decoding token by token carries the float32 state: no rounding accumulates on the way.
  state, outs = low["initial_state"], []
  for t in range(STREAMED):
    piece = {n: v if v is None or n == "initial_state" else v[:, t:t + 1] for n, v in low.items()}
    out, state = _jitted(kind, "auto", None)(dict(piece, initial_state=state))
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    outs.append(np.asarray(out, np.float64))
  _assert_close(np.concatenate(outs, axis=1), expected[:, :STREAMED], 2**-8)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_jit_equals_no_jit_and_does_not_retrace(kind):
  rng = np.random.default_rng(17)
  x = _inputs(rng, kind, (2,), 21)
  eager = _call(kind, x, mode="chunked", chunk_size=8, return_final_state=True)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def jitted(x):
    return _call(kind, x, mode="chunked", chunk_size=8, return_final_state=True)

  chex.assert_trees_all_close(jitted(x), eager, rtol=1e-12, atol=1e-12)
  jitted(_inputs(rng, kind, (2,), 21))


@pytest.mark.parametrize("kind", [KINDS[1], KINDS[4]], ids=["ssd", "gated-deltanet"])
def test_gradient_memory_holds_one_state_per_chunk_not_per_step(kind):
  """Each added step costs the gradient far less than the state `lax.scan` autodiff keeps per step."""
  heads, dim = 2, 32

  def temp_bytes(length):
    x = _inputs(np.random.default_rng(18), kind, (), length, heads=heads, dim_k=dim, dim_v=dim,
                reset_rate=0.0)
    x = {n: v if v is None or n == "reset" else jnp.asarray(v, jnp.float32) for n, v in x.items()}
    names = _differentiable(x)
    loss = _loss(functools.partial(_call, kind, mode="chunked", return_final_state=True), names)
    compiled = jax.jit(jax.grad(loss)).lower([x[n] for n in names], x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  per_step = (temp_bytes(2048) - temp_bytes(1024)) / 1024
  assert per_step < heads * dim * dim * 4 / 4


def test_one_decay_per_key_is_one_per_head_when_the_keys_agree():
  rng = np.random.default_rng(19)
  x = _inputs(rng, KINDS[1], (2,), 33)
  per_key = dict(x, log_decay=np.repeat(x["log_decay"][..., None], 5, axis=-1))
  for mode in ("chunked", "parallel"):
    _assert_close(_jitted(KINDS[2], mode, CHUNK)(per_key)[0],
                  _jitted(KINDS[1], mode, CHUNK)(x)[0], 1e-12)


def test_delta_rule_with_beta_zero_is_a_decaying_identity():
  """beta = 0 writes nothing: the state only decays and q reads it."""
  rng = np.random.default_rng(20)
  x = _inputs(rng, KINDS[4], (), 30, reset_rate=0.0)
  x["beta"] = np.zeros_like(x["beta"])
  out, final = _jitted(KINDS[4], "chunked", 8)(x)
  decay = np.exp(np.cumsum(x["log_decay"], axis=0))  # (T, H)
  states = decay[:, :, None, None] * x["initial_state"]
  _assert_close(out, np.einsum("thk,thkv->thv", x["q"], states), 1e-12)
  _assert_close(final, states[-1], 1e-12)


def _valid(**overrides):
  x = dict(q=jnp.ones((2, 5, 3, 4)), k=jnp.ones((2, 5, 3, 4)), v=jnp.ones((2, 5, 3, 6)),
           beta=jnp.ones((2, 5, 3)))
  x.update(overrides)
  return x


ERRORS = [
    (dict(k=jnp.ones((2, 5, 3, 5))), ValueError, "`k` must have the shape of `q`"),
    (dict(v=jnp.ones((2, 4, 3, 6))), ValueError, "`v` must be"),
    # grouped heads: v's 4 heads are not groups of q's 3 (and the generalized delta rule takes
    # no groups)
    (dict(v=jnp.ones((2, 5, 4, 6))), ValueError, "`v` must be"),
    (dict(q=jnp.ones((5, 4)), k=jnp.ones((5, 4)), v=jnp.ones((5, 4))), ValueError, "`q` must be"),
    (dict(q=jnp.ones((2, 5, 3, 4), jnp.int32)), TypeError, "`q` must have a real floating"),
    (dict(log_decay=jnp.zeros((2, 5))), ValueError, "`log_decay` must be"),
    (dict(log_decay=jnp.full((2, 5, 3), 0.5)), ValueError, "<= 0 .* got values in .0.5, 0.5.."),
    (dict(log_decay=jnp.full((2, 5, 3), -jnp.inf)), ValueError, "finite"),
    (dict(log_decay=np.where(np.arange(5)[:, None] == 1, np.nan, -0.5) * np.ones((2, 5, 3))),
     ValueError, "6 non-finite values, the finite ones in .-0.5, -0.5."),
    (dict(reset=jnp.zeros((2, 5), jnp.int32)), TypeError, "`reset` must be a boolean"),
    (dict(reset=jnp.zeros((5, 2), bool)), ValueError, "`reset` must have shape (2, 5)"),
    (dict(initial_state=jnp.zeros((2, 3, 6, 4))), ValueError, "`initial_state` must have shape"),
    (dict(mode="fast"), ValueError, "`mode` must be one of"),
    (dict(chunk_size=0), ValueError, "`chunk_size` must be positive"),
    (dict(chunk_size=2.0), TypeError, "`chunk_size` must be a positive int"),
]


FUNCTIONS = ["linear", "delta", "dplr"]


@pytest.mark.parametrize("function", FUNCTIONS,
                         ids=["linear_attention", "delta_rule", "generalized_delta_rule"])
@pytest.mark.parametrize("overrides, error, match", ERRORS,
                         ids=[e[2].split("`")[1] if "`" in e[2] else e[2] for e in ERRORS])
def test_bad_input_is_refused_naming_the_argument(function, overrides, error, match):
  x = dict(dict.fromkeys(("log_decay", "initial_state", "reset", "a", "b")), **_valid(**overrides))
  x["a"] = x["b"] = x["k"]
  kwargs = {n: x.pop(n) for n in ("mode", "chunk_size") if n in x}
  with pytest.raises(error, match=match.replace("(", r"\(").replace(")", r"\)")):
    _call(("", function, None), x, **kwargs)


@pytest.mark.parametrize("function", FUNCTIONS,
                         ids=["linear_attention", "delta_rule", "generalized_delta_rule"])
def test_decays_computed_by_the_caller_go_unchecked_eagerly_as_under_jit(function):
  x = _valid(log_decay=np.where(np.arange(5)[:, None] == 1, np.nan, -0.5) * np.ones((2, 5, 3)),
             reset=np.arange(5) == 3 * np.ones((2, 1), bool), initial_state=None)
  x["a"], x["b"] = -0.5 * x["k"], x["k"]
  call = functools.partial(_call, ("", function, None), x, mode="chunked")
  eager = np.asarray(call(check_log_decay=False))
  np.testing.assert_array_equal(eager, jax.jit(call)())
  assert np.all(np.isnan(eager[:, 1:3])) and np.all(np.isfinite(eager[:, [0, 3, 4]]))


def test_delta_rule_refuses_a_misshapen_beta():
  x = _valid()
  with pytest.raises(ValueError, match="`beta` must have shape"):
    delta_rule(x["q"], x["k"], x["v"], jnp.ones((2, 5)))


def test_generalized_delta_rule_refuses_misshapen_or_missing_read_and_write_vectors():
  x = _valid()
  with pytest.raises(ValueError, match=r"`a` must have shape \(2, 5, 3, 4\)"):
    generalized_delta_rule(x["q"], x["k"], x["v"], jnp.ones((2, 5, 3, 3)), x["k"])
  with pytest.raises(TypeError, match="`b` must have a real floating"):
    generalized_delta_rule(x["q"], x["k"], x["v"], x["k"], jnp.ones((2, 5, 3, 4), jnp.int32))
  with pytest.raises(ValueError, match="`a` and `b` must be arrays"):
    generalized_delta_rule(x["q"], x["k"], x["v"], None, x["k"])


PRODUCT_ERRORS = [
    (dict(k=jnp.ones((2, 5, 3, 4))), "`k` must be `(..., T, n, H, K)`"),
    (dict(k=jnp.ones((2, 5, 2, 3, 5))), "`k` must be `(..., T, n, H, K)`"),
    (dict(k=jnp.ones((2, 5, 0, 3, 4))), "n >= 1"),
    (dict(v=jnp.ones((2, 5, 3, 3, 6))), "`v` must be `(..., T, n, H, V)`"),
    (dict(beta=jnp.ones((2, 5, 3))), "`beta` must have shape (2, 5, 2, 3)"),
    (dict(log_decay=jnp.zeros((2, 5, 2, 3))), "`log_decay` must be (..., T, H)"),
    (dict(reset=jnp.zeros((2, 10), bool)), "`reset` must have shape (2, 5)"),
]


@pytest.mark.parametrize("overrides, match", PRODUCT_ERRORS, ids=[e[1] for e in PRODUCT_ERRORS])
def test_delta_product_refuses_shapes_that_do_not_fit_n_steps_per_token(overrides, match):
  x = dict(q=jnp.ones((2, 5, 3, 4)), k=jnp.ones((2, 5, 2, 3, 4)), v=jnp.ones((2, 5, 2, 3, 6)),
           beta=jnp.ones((2, 5, 2, 3)), log_decay=None, reset=None)
  x.update(overrides)
  with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
    delta_product(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], reset=x["reset"])
