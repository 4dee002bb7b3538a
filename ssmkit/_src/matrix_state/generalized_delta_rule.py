"""The generalized delta rule: S_t = diag(exp(g_t)) S_{t-1} + b_t^T (a_t S_{t-1}) + k_t^T v_t."""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src.matrix_state import chunks, common, low_rank, steps, triangular
from ssmkit._src.matrix_state.inputs import Inputs, prepare
from ssmkit._src.modes import DELTA_VALUES_CHUNKED_FROM, Mode

Array = jax.Array


def _step(precision):
  def step(s, x):
    q_t, k_t, v_t, a_t, b_t, g_t, reset_t = x  # (Z, H, K|V) vectors, (Z, H[, K]), (Z,)
    if reset_t is not None:
      s = jnp.where(reset_t[:, None, None, None], 0, s)
    read = jnp.einsum("zhk,zhkv->zhv", a_t, s, precision=precision)
    s = (steps.decayed(s, g_t) + b_t[..., :, None] * read[..., None, :]
         + k_t[..., :, None] * v_t[..., None, :])
    return s, jnp.einsum("zhk,zhkv->zhv", q_t, s, precision=precision)

  return step


def _sequential(x: Inputs, size: int | None, precision) -> tuple[Array, Array]:
  return steps.run(_step(precision), (x.q, x.k, x.v, x.a, x.b, x.log_decay, x.reset), x.state,
                   size)


def _chunk_maps(c: chunks.Chunks, precision, factored: bool = False):
  """The chunks' maps (`low_rank.LowRank`, rows x = w) and the outputs from entering states.

  Inside a chunk with cumulative per-key log-decays B_t (and B_{t-1} before step t), the
  reads w_t = a_t S_{t-1} solve the unit lower-triangular system
  (I - L) w = P v + (a exp(B_{t-1})) S_0, with L_ts = sum_d a_td b_sd exp(B_{t-1,d} - B_sd)
  and P_ts the same with k for b, s < t. Solving once for both right-hand sides gives
  w = W + R S_0 for any entering state S_0; the chunk is then linear attention with keys
  [b, k] and values [w, v]: the state leaves as exp(B_C) S_0 + b_out^T w + k_out^T v.
  """
  q, k, v, a, b, g, reset = c.q, c.k, c.v, c.a, c.b, c.log_decay, c.reset
  seg = chunks.segments(reset, q.shape[3])
  (q,), bad_query = common.sanitize((q,))
  bad = None
  if reset is not None:
    (k, v, a, b, g), bad = common.sanitize((k, v, a, b, g))
  if g is None:
    g = jnp.zeros_like(k)
  elif g.ndim == 4:
    g = jnp.broadcast_to(g[..., None], k.shape)
  after = chunks.cumulative(g, seg)
  before = chunks.cumulative(g, seg, behind=True)
  total = after[:, :, :, -1:]
  ((ab, ak),) = chunks.per_key_scores((a,), (b, k), g, before, after, precision, strict=True,
                                      factored=factored, index=seg.index)
  ((qb, qk),) = chunks.per_key_scores((q,), (b, k), g, after, after, precision, factored=factored,
                                      index=seg.index)
  ab, ak = (jnp.where(seg.strict, x, 0) for x in (ab, ak))
  qb, qk = (jnp.where(seg.causal, x, 0) for x in (qb, qk))
  mix = lambda s, x: jnp.einsum("zhncs,zhnse->zhnce", s, x, precision=precision)
  rhs = jnp.concatenate([mix(ak, v), chunks.masked(a * jnp.exp(before), seg.first)],
                        axis=-1)  # (Z, H, n, C, V + K)
  solved = triangular.unit_lower_solve(-ab, rhs, precision)
  dim_v = v.shape[-1]
  w, r = solved[..., :dim_v], solved[..., dim_v:]
  to_end = chunks.decay_to_end(g, seg, after if factored else None)
  b_out, k_out = (chunks.masked(x * to_end, seg.last) for x in (b, k))
  u = jnp.einsum("zhnsd,zhnse->zhnde", k_out, v, precision=precision)
  decay = jnp.exp(total[:, :, :, 0])[..., None]  # (Z, H, n, K, 1)
  return common.read_out(decay, u, q * jnp.exp(after), mix(qk, v), seg, bad, bad_query, reset,
                         precision, solve=low_rank.Solve(b_out, w, r, qb))


def generalized_delta_rule(
    q,
    k,
    v,
    a,
    b,
    log_decay=None,
    *,
    initial_state=None,
    reset=None,
    mode: str | Mode = "auto",
    chunk_size: int | None = None,
    return_final_state: bool = False,
    axis_name: Hashable | None = None,
    precision: lax.PrecisionLike = None,
    check_log_decay: bool = True,
):
  """The generalized delta rule: a diagonal-plus-rank-one transition per step (RWKV-7).

  With a `(K, V)` state S and row vectors q_t, k_t, a_t, b_t `(K,)`, v_t `(V,)`:

    S_t = (diag(exp(g_t)) + b_t^T a_t) S_{t-1} + k_t^T v_t,    o_t = q_t S_t,

  i.e. the state decays, a_t reads it (a_t S_{t-1}, a `(V,)` row) and b_t writes what it
  read back, then k_t writes v_t. The conventions are flash-linear-attention's
  `chunk_dplr_delta_rule` (`a` reads, `b` writes) without its scaling of `q`. RWKV-7
  passes a = -kappa, b = kappa * alpha for a unit key kappa and an in-context learning
  rate alpha in [0, 1], which makes the transition diag(exp(g)) - kappa^T (kappa * alpha);
  the delta rule is a = -beta k, b = k, and keys k beta and values v. `log_decay` is one
  number per key channel (RWKV-7), one per head, or absent. `reset[..., t]` clears the
  state before step t, also inside a chunk; the outputs and gradients from a reset on are
  the same to the last bit whatever came before it.

  The chunked mode solves, per chunk of C steps, a unit lower-triangular system for the
  reads given any entering state, so a chunk becomes matrix products plus a `(K, K)`
  transition carried to the next chunk. Every decay in it is a difference of cumulative
  log-decays <= 0, so the per-key decays stay exact however strong. Gradients are JAX's
  own (forward and reverse mode); they keep one state per chunk and recompute the rest.
  bfloat16/float16 inputs accumulate in float32.

  Args:
    q: `(..., T, H, K)` queries, real floating.
    k: `(..., T, H, K)` keys.
    v: `(..., T, H, V)` values.
    a: `(..., T, H, K)` the vectors that read the state.
    b: `(..., T, H, K)` the vectors that write what `a` read.
    log_decay: None, `(..., T, H)` or `(..., T, H, K)`: log of the decay, <= 0 and finite.
    initial_state: `(..., H, K, V)` state before the first step; default zeros.
    reset: `(..., T)` booleans; True clears the state before that step.
    mode: "sequential", "chunked", "parallel" (chunk transitions combined as a tree of
      `(K, K)` products) or "auto"; see `linear_attention`. On CPU, "auto" computes values
      step by step below 2^15 (batch row, head, step) triples (derivatives chunked); on
      accelerators it runs the chunked form, as for `delta_rule`.
    chunk_size: steps per chunk; default 32, at most T.
    return_final_state: also return S_T.
    axis_name: sequence parallelism as in `linear_attention`; a device sums its slice up
      as S -> M S + U with M the `(K, K)` product of its transitions.
    precision: precision of the matrix products (`jax.lax.Precision`).
    check_log_decay: as in `linear_attention`.

  Returns:
    `o` `(..., T, H, V)`; with `return_final_state`, `(o, S_T)`, dtypes as in
    `linear_attention`.

  Raises:
    TypeError: for integer or complex inputs, or a non-boolean `reset`.
    ValueError: for shapes that do not fit `q`, a positive or non-finite `log_decay` known
      at trace time, an unknown `mode`, a non-positive `chunk_size`, or an `axis_name`
      outside `shard_map`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.scan import generalized_delta_rule
    >>> ones = jnp.ones((2, 1, 1))  # T=2, one head, K=1
    >>> v = jnp.array([[[4.0]], [[8.0]]])
    >>> # a = -0.5 k, b = k: the delta rule, halfway to v (written as 0.5 v), twice
    >>> generalized_delta_rule(ones, ones, 0.5 * v, -0.5 * ones, ones)[:, 0, 0]
    Array([2., 5.], dtype=float32)

  References:
    Peng et al., "RWKV-7 'Goose' with expressive dynamic state evolution", 2025;
    flash-linear-attention, `fla/ops/generalized_delta_rule/dplr/naive.py`.
  """
  mode = common.check_options(mode, chunk_size, axis_name)
  x = prepare(q, k, v, log_decay=log_decay, beta=None, initial_state=initial_state,
              reset=reset, check_log_decay=check_log_decay, a=a, b=b)
  if x.a is None or x.b is None:
    raise ValueError("`a` and `b` must be arrays `(..., T, H, K)`, got None.")
  return common.evaluate(x, _sequential, _chunk_maps, matrix=True, mode=mode,
                         chunk_size=chunk_size, axis_name=axis_name, precision=precision,
                         return_final_state=return_final_state,
                         default_chunk_size=common.SOLVED_CHUNK_SIZE, per_key_scores=True,
                         chunked_values_from=DELTA_VALUES_CHUNKED_FROM)
