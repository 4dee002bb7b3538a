"""Pallas kernels of the chunked (gated) delta rule, one decay per head or per key channel.

Inside a chunk, with the decays of `decays`, the writes u_t = beta_t (v_t - (k_t e^{b_t}) S_{t-1})
solve the unit lower-triangular system of the UT transform (as `matrix_state.delta_rule`):

  (I + L) u = beta (v - [segment 0] (k e^b) S),   L_ts = beta_t sum_d k_td k_sd e^{b_td - b_sd}, s < t,

and the chunk is then linear attention with values u (`linear_attention.read_write`). The
inverse (I + L)^{-1} is formed with products only, (I - L)(I + L^2)(I + L^4)... of the nilpotent
L (as `triangular` does for the XLA form). Back, from du (linear attention's dv):

  dr = (I + L)^{-T} du,  dv = beta dr,  dbeta = dr . (v - W S) + dL . KK,  dL = -dr u^T,

with W = [segment 0] k e^b, KK = L / beta, and dW = -(beta dr) S^T, dS += -W^T (beta dr).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ssmkit._src.matrix_state.inputs import Inputs
from ssmkit._src.matrix_state.kernels import chunked, decays
from ssmkit._src.matrix_state.kernels.decays import dot, dot_nt, dot_tn
from ssmkit._src.matrix_state.kernels.linear_attention import read_write, read_write_backward
from ssmkit._src.matrix_state.kernels.segments import HIGHEST

Array = jax.Array


def unit_lower_inverse(lower: Array) -> Array:
  """(I + L)^{-1} of a strictly lower-triangular `(C, C)` L, by repeated squaring."""
  size = lower.shape[0]
  eye = (jnp.arange(size)[:, None] == jnp.arange(size)[None, :]).astype(lower.dtype)
  inverse = eye - lower
  power, reach = lower, 2
  while reach < size:
    power = dot(power, power, HIGHEST)
    inverse = inverse + dot(power, inverse, HIGHEST)
    reach *= 2
  return inverse


class _Writes:
  """A chunk's writes u and what their derivative needs."""

  def __init__(self, dec, x: dict[str, Array], state: Array, precision):
    self.beta = x["beta"][:, None]
    self.kk = dec.scores(x["k"], x["k"], precision, strict=True)
    self.inverse = unit_lower_inverse(self.beta * self.kk)
    self.written = x["k"] * dec.entering  # W: the keys that read the entering state
    self.base = x["v"] - dot(self.written, state, precision)
    self.u = dot(self.inverse, self.beta * self.base, precision)


def _forward(x: dict[str, Array], state: Array, precision) -> tuple[Array, Array]:
  dec = decays.of(x["g"], x["reset"])
  u = _Writes(dec, x, state, precision).u
  return read_write(dec, x["q"], x["k"], u, state, precision)


def _backward(x: dict[str, Array], state: Array, d_out: Array, d_leaving: Array, precision):
  dec = decays.of(x["g"], x["reset"])
  w = _Writes(dec, x, state, precision)
  k = x["k"]
  dq, dk, du, db, d_state = read_write_backward(dec, x["q"], k, w.u, state, d_out, d_leaving,
                                                precision)
  d_rhs = dot_tn(w.inverse, du, precision)
  dv = w.beta * d_rhs
  d_lower = -dot_nt(d_rhs, w.u, precision)
  d_beta = jnp.sum(d_rhs * w.base, axis=1) + jnp.sum(d_lower * w.kk, axis=1)
  d_written = -dot_nt(dv, state, precision)
  d_state = d_state - dot_tn(w.written, dv, precision)
  d_rows, d_cols = dec.grads(w.beta * d_lower, k, k, precision, strict=True)
  dk = dk + dec.entering * d_written + d_rows + d_cols
  db = db + w.written * d_written + k * (d_rows - d_cols)
  return dict(q=dq, k=dk, v=dv, beta=d_beta, g=dec.decay_gradient(db)), d_state


def run(x: Inputs, chunk_size: int | None, precision,
        fallback: Callable[[Inputs], tuple[Array, Array]]) -> tuple[Array, Array]:
  """The delta rule of `x` (float32 accumulation, T > 0) by the kernels: `(Z, T, H, V)` outputs
  and the `(Z, H, K, V)` final state; `fallback` is the XLA form, for inputs (or cotangents)
  with a non-finite entry (`routed`)."""
  g, reset = chunked.decays_and_resets(x)

  def by_xla(q, k, v, beta, g, reset, state):
    return fallback(chunked.inputs(x, reset, q=q, k=k, v=v, beta=beta, log_decay=g, state=state))

  step = lambda *a: _forward(*a, precision)
  step_back = lambda *a: _backward(*a, precision)
  return chunked.run(step, step_back, dict(q=x.q, k=x.k, v=x.v, beta=x.beta, g=g, reset=reset),
                     x.state, chunked.chunk_size(x.q.shape[1], chunk_size), by_xla)
