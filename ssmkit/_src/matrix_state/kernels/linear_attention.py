"""Pallas kernels of chunked linear attention, one decay per head or per key channel.

Per chunk of C steps, with b_t the cumulative log-decay of t's segment (`decays`):

  o_t = sum_{s <= t in t's segment} (q_t . k_s e^{b_t - b_s}) v_s + [t in segment 0] (q_t e^{b_t}) S,
  S' = [no reset] e^{b_C} S + sum_{s in the last segment} (k_s e^{b_C - b_s})^T v_s,

and back, with A the scores and dA = do v^T:

  dq_t = sum_s dA_ts k_s e^{b_t - b_s} + [t in segment 0] e^{b_t} (do_t S^T),
  dk_s = sum_t dA_ts q_t e^{b_t - b_s} + [s last] e^{b_C - b_s} (v_s dS'^T),
  dv_s = sum_t A_ts do_t + [s last] (k_s e^{b_C - b_s}) dS',
  dS = [no reset] e^{b_C} dS' + sum_{t in segment 0} (q_t e^{b_t})^T do_t,
  d b_t = q_t dq_t - k_t dk_t (+ <dS', S'> at the last step), dg = the segment's reverse sum.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src.matrix_state.inputs import Inputs
from ssmkit._src.matrix_state.kernels import chunked, decays
from ssmkit._src.matrix_state.kernels.decays import dot, dot_nt, dot_tn

Array = jax.Array
Decays = decays.HeadDecay | decays.KeyDecay


def leaving(dec: Decays, k: Array, v: Array, state: Array, precision) -> Array:
  """The `(K, V)` state leaving a chunk."""
  return dec.through * state + dot_tn(k * dec.to_end, v, precision)


def read_write(dec: Decays, q: Array, k: Array, v: Array, state: Array,
               precision) -> tuple[Array, Array]:
  """One chunk's outputs and leaving state, `(C, V)` and `(K, V)`."""
  out = dot(dec.scores(q, k, precision), v, precision) + dot(q * dec.entering, state, precision)
  return out, leaving(dec, k, v, state, precision)


def read_write_backward(dec: Decays, q: Array, k: Array, v: Array, state: Array,
                        d_out: Array, d_leaving: Array, precision):
  """`read_write`'s cotangents: `(dq, dk, dv, db, dS)`, db `(C, K)` that of the cumulative
  decays (per key channel even where one decay per head sums it)."""
  dq, dk = dec.grads(dot_nt(d_out, v, precision), q, k, precision)
  dq = dq + dec.entering * dot_nt(d_out, state, precision)
  dk = dk + dec.to_end * dot_nt(v, d_leaving, precision)
  dv = dot_tn(dec.scores(q, k, precision), d_out, precision) + dot(k * dec.to_end, d_leaving,
                                                                   precision)
  d_state = dec.through * d_leaving + dot_tn(q * dec.entering, d_out, precision)
  at_end = lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0) == q.shape[0] - 1
  after = leaving(dec, k, v, state, precision)
  db = q * dq - k * dk + jnp.where(at_end, jnp.sum(d_leaving * after, axis=1)[None, :], 0.0)
  return dq, dk, dv, db, d_state


def _forward(x: dict[str, Array], state: Array, precision) -> tuple[Array, Array]:
  return read_write(decays.of(x["g"], x["reset"]), x["q"], x["k"], x["v"], state, precision)


def _backward(x: dict[str, Array], state: Array, d_out: Array, d_leaving: Array, precision):
  dec = decays.of(x["g"], x["reset"])
  dq, dk, dv, db, d_state = read_write_backward(dec, x["q"], x["k"], x["v"], state, d_out,
                                                d_leaving, precision)
  return dict(q=dq, k=dk, v=dv, g=dec.decay_gradient(db)), d_state


def run(x: Inputs, chunk_size: int | None, precision,
        fallback: Callable[[Inputs], tuple[Array, Array]]) -> tuple[Array, Array]:
  """Linear attention of `x` (float32 accumulation, T > 0) by the kernels: `(Z, T, H, V)` outputs
  and the `(Z, H, K, V)` final state; `fallback` is the XLA form, for inputs (or cotangents)
  with a non-finite entry (`routed`)."""
  # beta_t k_t^T v_t = k_t^T (beta_t v_t): the write strengths scale the values, which have one
  # head per head of the state where the keys may serve a group of them.
  v = x.v if x.beta is None else x.v * x.beta[..., None]
  g, reset = chunked.decays_and_resets(x)

  def by_xla(q, k, v, g, reset, state):
    return fallback(chunked.inputs(x, reset, q=q, k=k, v=v, log_decay=g, beta=None, state=state))

  step = lambda *a: _forward(*a, precision)
  step_back = lambda *a: _backward(*a, precision)
  return chunked.run(step, step_back, dict(q=x.q, k=x.k, v=v, g=g, reset=reset), x.state,
                     chunked.chunk_size(x.q.shape[1], chunk_size), by_xla)
