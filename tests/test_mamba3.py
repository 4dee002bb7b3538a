"""`ssmkit.scan.mamba3` against a float64 loop written from state-spaces/mamba's
`mamba3_siso_step_ref` and `mamba3_MIMO_step_ref` (tests/references.py): every mode, lengths
0 to 65, resets, streaming, gradients and JVPs, NaN before a reset, bad inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import references
from ssmkit.scan import Mamba3State, linear_attention, mamba3

MODES = ["sequential", "chunked", "parallel", "auto"]
LENGTHS = [0, 1, 2, 7, 17, 65]
# (ranks, rotary layout): SISO turns adjacent channels, MIMO the two halves, as the reference.
CASES = [(None, "interleaved"), (3, "halves")]
CASE_IDS = ["siso", "mimo"]
HEADS, N, P, ANGLES = 2, 6, 3, 2


def _inputs(rng, ranks, batch, length, reset_rate=0.15):
  """Random inputs: decays A dt with A in [-2, -0.5] and dt in [0.05, 1], lambda in [0, 1],
  angle increments dt * pi * tanh(.), a random state to start from."""
  rows = (*batch, length) + (() if ranks is None else (ranks,)) + (HEADS,)
  dt = rng.uniform(0.05, 1.0, (*batch, length, HEADS))
  return dict(
      q=rng.normal(size=(*rows, N)), k=rng.normal(size=(*rows, N)), v=rng.normal(size=(*rows, P)),
      log_decay=-rng.uniform(0.5, 2.0, dt.shape) * dt, step_size=dt,
      trapezoid=rng.uniform(0.0, 1.0, dt.shape),
      angle_rate=dt[..., None] * np.pi * np.tanh(rng.normal(size=(*dt.shape, ANGLES))),
      reset=rng.uniform(size=(*batch, length)) < reset_rate,
      initial_state=Mamba3State(
          rng.normal(size=(*batch, HEADS, N, P)), rng.normal(size=(*batch, HEADS, ANGLES)),
          rng.normal(size=(*rows[:len(batch)], *rows[len(batch) + 1:], N)),
          rng.normal(size=(*rows[:len(batch)], *rows[len(batch) + 1:], P))))


def _ranked(x, ranks, axis):
  """A SISO array with the rank axis of one the reference loops over."""
  return jnp.expand_dims(x, axis) if ranks is None else x


def _reference(x, ranks, layout, loop=references.mamba3):
  time = x["log_decay"].ndim - 2
  start = x["initial_state"]
  state = (start.state, start.angle, _ranked(start.key, ranks, time), _ranked(start.value, ranks, time))
  out, final = loop(*(_ranked(x[n], ranks, time + 1) for n in ("q", "k", "v")),
                    *(x[n] for n in ("log_decay", "step_size", "trapezoid", "angle_rate")),
                    state, x["reset"], layout)
  if ranks is None:
    out = out.squeeze(time + 1)
    final = (*final[:2], final[2].squeeze(time), final[3].squeeze(time))
  return out, final


def _call(x, ranks, layout, **options):
  del ranks
  return mamba3(x["q"], x["k"], x["v"], x["log_decay"], x["step_size"], x["trapezoid"],
                x["angle_rate"], rotary=layout, initial_state=x["initial_state"],
                reset=x["reset"], return_final_state=True, **options)


@functools.cache
def _jitted(ranks, layout, mode, chunk_size):
  return jax.jit(functools.partial(_call, ranks=ranks, layout=layout, mode=mode,
                                   chunk_size=chunk_size))


def _assert_close(actual, expected, tol=1e-8):
  for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    want = np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ranks, layout", CASES, ids=CASE_IDS)
def test_every_mode_matches_the_float64_loop(ranks, layout, mode):
  rng = np.random.default_rng(5)
  for i, length in enumerate(LENGTHS):
    x = _inputs(rng, ranks, [(), (2,)][i % 2], length)
    out, final = _jitted(ranks, layout, mode, None if mode == "auto" else 8)(x)
    assert out.dtype == jnp.float64 and isinstance(final, Mamba3State)
    _assert_close((out, tuple(final)), _reference(x, ranks, layout))


@pytest.mark.parametrize("ranks, layout", CASES, ids=CASE_IDS)
def test_a_reset_cuts_every_input_before_it_exactly(ranks, layout):
  """The outputs from a reset on (inside a chunk of 8 steps, and of "auto"'s 64) and the final
  state are the same to the last bit whatever came before it: every input before the reset
  and the state it starts from changed (the programs of the test above)."""
  first = [27, 21]
  x = _inputs(np.random.default_rng(9), ranks, (2,), 65, reset_rate=0.0)
  other = _inputs(np.random.default_rng(10), ranks, (2,), 65, reset_rate=0.0)
  x["reset"][0, first[0]] = x["reset"][1, first[1]] = True
  y = dict(x, initial_state=other["initial_state"])
  for name in ("q", "k", "v", "log_decay", "step_size", "trapezoid", "angle_rate"):
    y[name] = x[name].copy()
    for row, start in enumerate(first):
      y[name][row, :start] = other[name][row, :start]
  for mode in MODES:
    (out_x, final_x), (out_y, final_y) = (
        _jitted(ranks, layout, mode, None if mode == "auto" else 8)(d) for d in (x, y))
    for row, start in enumerate(first):
      np.testing.assert_array_equal(out_x[row, start:], out_y[row, start:], err_msg=mode)
      assert not np.allclose(out_x[row, :start], out_y[row, :start], atol=0)
    for got_x, got_y in zip(final_x, final_y, strict=True):
      np.testing.assert_array_equal(got_x, got_y, err_msg=mode)


@pytest.mark.parametrize("ranks, layout", CASES, ids=CASE_IDS)
def test_a_sequence_continues_from_its_state_in_pieces(ranks, layout):
  x = _inputs(np.random.default_rng(6), ranks, (2,), 30)
  whole, final = _jitted(ranks, layout, "chunked", 8)(x)
  piece = lambda x, a, b: {n: v if n == "initial_state" else v[:, a:b] for n, v in x.items()}
  first, middle = _jitted(ranks, layout, "chunked", 8)(piece(x, 0, 13))
  second, end = _jitted(ranks, layout, "chunked", 8)(dict(piece(x, 13, 30), initial_state=middle))
  _assert_close((np.concatenate([first, second], axis=1), end), (whole, final), 1e-12)


def test_without_rotation_and_with_lambda_one_it_is_mamba2():
  """lambda = 1 drops the previous token's term: linear attention with keys dt_t k_t."""
  x = _inputs(np.random.default_rng(7), None, (), 20)
  out = mamba3(x["q"], x["k"], x["v"], x["log_decay"], x["step_size"], np.ones((20, HEADS)),
               reset=x["reset"])
  expected = linear_attention(x["q"], x["k"] * x["step_size"][..., None], x["v"], x["log_decay"],
                              reset=x["reset"])
  _assert_close(out, expected, 1e-12)


def _loss(f):
  def loss(floats, x):
    out, final = f(x | floats | {"initial_state": Mamba3State(*floats["initial_state"])})
    return jnp.sum(jnp.sin(out)) + sum(jnp.sum(s**2) for s in jax.tree.leaves(final))
  return loss


def _floats(x):
  return {n: v for n, v in x.items() if n != "reset"} | {"initial_state": tuple(x["initial_state"])}


@pytest.mark.parametrize("ranks, layout", CASES, ids=CASE_IDS)
def test_gradients_and_jvp_match_autodiff_of_the_loop(ranks, layout):
  rng = np.random.default_rng(8)
  x = _inputs(rng, ranks, (2,), 37)
  floats = _floats(x)
  tangents = jax.tree.map(lambda v: rng.normal(size=v.shape), floats)
  reference = _loss(lambda y: _reference(y, ranks, layout, references.mamba3_scan))
  expected = jax.jit(jax.grad(reference))(floats, x)
  expected_jvp = jax.jit(lambda f, t: jax.jvp(lambda f: reference(f, x), (f,), (t,))[1])(
      floats, tangents)
  for mode, chunk in (("sequential", 8), ("chunked", 8), ("parallel", 8), ("auto", None)):
    loss = _loss(_jitted(ranks, layout, mode, chunk))
    _assert_close(jax.jit(jax.grad(loss))(floats, x), expected, 1e-7)
    _assert_close(jax.jit(lambda f, t, loss=loss: jax.jvp(lambda f: loss(f, x), (f,), (t,))[1])(
        floats, tangents), expected_jvp, 1e-7)


@pytest.mark.parametrize("name", ["v", "k", "step_size", "angle_rate", "initial_state"])
def test_nan_before_a_reset_reaches_nothing_after_it(name):
  """The loss reads the outputs from the reset on; NaN before it (or in the state it starts
  from) leaves those outputs and their gradients finite and equal to the clean inputs'."""
  ranks, layout = CASES[1]
  x = _inputs(np.random.default_rng(9), ranks, (), 40, reset_rate=0.0)
  x["reset"][[0, 25]] = True
  poisoned = dict(x)
  if name == "initial_state":
    poisoned["initial_state"] = Mamba3State(*(np.full_like(s, np.nan) for s in x["initial_state"]))
  else:
    poisoned[name] = x[name].copy()
    poisoned[name][20:25] = np.nan

  def tail(floats, x, f):
    out, _ = f(x | floats | {"initial_state": Mamba3State(*floats["initial_state"])})
    return jnp.sum(jnp.sin(out[25:]))

  for mode, chunk in (("chunked", 8), ("auto", None)):
    f = _jitted(ranks, layout, mode, chunk)
    grads = jax.jit(jax.grad(tail), static_argnums=2)(_floats(poisoned), poisoned, f)
    clean = jax.jit(jax.grad(tail), static_argnums=2)(_floats(x), x, f)
    for n in ("q", "k", "v", "step_size", "trapezoid", "log_decay", "angle_rate"):
      _assert_close(grads[n][25:], clean[n][25:])


def test_bfloat16_inputs_give_bfloat16_outputs_close_to_float32():
  x = _inputs(np.random.default_rng(11), 2, (), 20)
  x = {n: v if n in ("reset", "initial_state") else v.astype(np.float32) for n, v in x.items()}
  x["initial_state"] = Mamba3State(*(s.astype(np.float32) for s in x["initial_state"]))
  low = {n: v.astype(jnp.bfloat16) if n in ("q", "k", "v") else v for n, v in x.items()}
  out, final = _call(low, 2, "halves", mode="chunked")
  assert out.dtype == jnp.bfloat16 and final.state.dtype == jnp.float32
  expected, _ = _call(x, 2, "halves", mode="chunked")
  error = np.linalg.norm(np.asarray(out, np.float32) - expected) / np.linalg.norm(expected)
  assert error < 2e-2, error


@pytest.mark.parametrize(("change", "match"), [
    (dict(q=np.zeros((5, 3, 6))), "`q` must be"),
    (dict(k=np.zeros((5, 2, 5))), "`k` must"),
    (dict(v=np.zeros((4, 2, 3))), "`v` must be"),
    (dict(step_size=np.zeros((5, 3))), "`step_size` must"),
    (dict(angle_rate=np.zeros((5, 2, 4))), "`angle_rate` must be"),
    (dict(reset=np.zeros(4, bool)), "`reset` must"),
    (dict(rotary="neox"), "`rotary` must be one of"),
    (dict(initial_state=Mamba3State(np.zeros((2, 6, 3)), np.zeros((2, 2)), np.zeros((2, 6)),
                                    np.zeros((2, 2)))), "`initial_state` must have the shapes"),
    # Values known at trace time, as `delta_rule` checks its decays.
    (dict(log_decay=np.full((5, 2), 0.5)), r"`log_decay` must be finite and <= 0 \(a decay"),
    (dict(log_decay=np.full((5, 2), np.nan)), r"`log_decay` must be finite .* 10 non-finite"),
    (dict(step_size=np.full((5, 2), -0.1)), r"`step_size` must be finite and >= 0 \(a step"),
    (dict(trapezoid=np.full((5, 2), 1.5)),
     r"`trapezoid` must be finite and >= 0 and <= 1 .* values in \[1.5, 1.5\]"),
])
def test_bad_inputs_are_named(change, match):
  x = _inputs(np.random.default_rng(10), None, (), 5)
  args = dict(q=x["q"], k=x["k"], v=x["v"], log_decay=x["log_decay"], step_size=x["step_size"],
              trapezoid=x["trapezoid"], angle_rate=x["angle_rate"], reset=x["reset"]) | change
  with pytest.raises(ValueError, match=match):
    mamba3(**args)


def test_traced_values_out_of_range_are_the_callers_and_the_layer_skips_the_check():
  """Under `jit` the values are unknown: a positive decay computes (it grows), as `delta_rule`
  does; `check_values=False` takes concrete values unchecked (the layer's NaN flows through)."""
  x = _inputs(np.random.default_rng(10), None, (), 5)
  args = (x["q"], x["k"], x["v"], np.full((5, 2), 0.5), x["step_size"], x["trapezoid"])
  out = jax.jit(mamba3)(*args)
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(mamba3(*args, check_values=False), out)
