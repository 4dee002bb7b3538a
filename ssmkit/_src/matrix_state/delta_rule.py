"""The (gated) delta rule: S_t = exp(g_t) (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t."""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src.matrix_state import chunks, common, low_rank, steps, triangular
from ssmkit._src.matrix_state.inputs import Inputs, prepare
from ssmkit._src.matrix_state.kernels import delta_rule as kernels
from ssmkit._src.modes import (
    DELTA_VALUES_CHUNKED_FROM,
    DELTA_VALUES_CHUNKED_ROWS,
    Impl,
    Mode,
    parse_impl,
)

Array = jax.Array


def _step(precision):
  """One token's step: the reset and decay, then n delta-rule writes (k_t, v_t and beta_t with
  a leading axis of n), then the read."""

  def step(s, x):
    q_t, k_t, v_t, beta_t, g_t, reset_t = x  # (Z, n, H, K|V) writes, (Z, H[, K]), (Z,)
    if reset_t is not None:
      s = jnp.where(reset_t[:, None, None, None], 0, s)
    s = steps.decayed(s, g_t)
    writes = (jnp.moveaxis(a, 1, 0) for a in (k_t, v_t, beta_t))
    for k_j, v_j, beta_j in zip(*writes, strict=True):
      predicted = jnp.einsum("zhk,zhkv->zhv", k_j, s, precision=precision)
      s = s + k_j[..., :, None] * (beta_j[..., None] * (v_j - predicted))[..., None, :]
    return s, jnp.einsum("zhk,zhkv->zhv", q_t, s, precision=precision)

  return step


def _sequential(x: Inputs, size: int | None, precision, per_token: int = 1) -> tuple[Array, Array]:
  """The step loop, one iteration per token of `per_token` steps (`evaluate`'s `read_every`):
  the decay and reset of its first step, the query of its last, the token's output."""
  tokens = lambda a: a.reshape((a.shape[0], a.shape[1] // per_token, per_token, *a.shape[2:]))
  q, k, v, beta, g, reset = (None if a is None else tokens(a)
                             for a in (x.q, x.k, x.v, x.beta, x.log_decay, x.reset))
  first = lambda a: None if a is None else a[:, :, 0]
  return steps.run(_step(precision), (q[:, :, -1], k, v, beta, first(g), first(reset)),
                   x.state, None if size is None else max(size // per_token, 1))


def _chunk_maps(c: chunks.Chunks, precision, read_every: int = 1, factored: bool = False):
  """The chunks' maps (`low_rank.LowRank`, rows x = u) and the outputs from entering states.

  Inside a chunk with cumulative log-decay b, the writes u_t = beta_t (v_t - k_t
  diag(exp(g_t)) S_{t-1}) solve the unit lower-triangular system
  (I + L) u = beta v - beta (k exp(b)) S_0 with L_ts = beta_t sum_d k_td k_sd
  exp(b_td - b_sd) for s < t (the UT transform of the WY representation; one decay per
  head is the same for every d). Solving once for both right-hand sides gives
  u = U - W S_0 for any entering state S_0; the chunk is then linear attention with
  values u.

  With `read_every` r, only the queries of steps r - 1, 2r - 1, ... are read
  (`common.read_out`): the other steps' scores, outputs and readings of the entering state
  are not computed. `factored`: as `chunks.per_key_scores` takes it.
  """
  q, k, v, beta, g, reset = c.q, c.k, c.v, c.beta, c.log_decay, c.reset
  seg = chunks.segments(reset, q.shape[3])
  read = lambda x: chunks.read_rows(x, read_every)
  bad = None
  if reset is not None:
    (k, v, beta, g), bad = common.sanitize((k, v, beta, g))
  if g is None or g.ndim == 4:
    (q,), bad_query = common.sanitize((read(q),))
    kk = jnp.einsum("zhncd,zhnsd->zhncs", k, k, precision=precision)
    qk = jnp.einsum("zhncd,zhnsd->zhncs", q, k, precision=precision)
  if g is None:
    interact = jnp.where(seg.strict, kk, 0)
    weights = jnp.where(read(seg.causal), qk, 0)
    k_in, q_in, k_out = k, q, k
    a = jnp.ones((*q.shape[:3], 1, 1), q.dtype)
  elif g.ndim == 4:
    b = chunks.cumulative(g, seg)
    total = b[:, :, :, -1]
    decay = chunks.pairwise_decay(g, seg.causal)
    interact = jnp.where(seg.strict, kk * decay, 0)
    weights = qk * read(decay)
    k_in = k * jnp.exp(b)[..., None]
    q_in = q * jnp.exp(read(b))[..., None]
    k_out = k * chunks.decay_to_end(g, seg)[..., None]
    a = jnp.exp(total)[..., None, None]
  else:  # one decay per key channel: the decays scale the rows of S, M's diagonal
    # The per-key scores take square chunks: every query is scored, the read rows kept.
    (q,), bad_query = common.sanitize((q,))
    bad_query = read(bad_query)
    b = chunks.cumulative(g, seg)
    total = b[:, :, :, -1]
    (kk,), (qk,) = chunks.per_key_scores((k, q), (k,), g, b, b, precision, factored=factored,
                                      index=seg.index)
    interact = jnp.where(seg.strict, kk, 0)
    weights = jnp.where(read(seg.causal), read(qk), 0)
    k_in = k * jnp.exp(b)
    q_in = read(q * jnp.exp(b))
    k_out = k * chunks.decay_to_end(g, seg, b if factored else None)
    a = jnp.exp(total)[..., None]
  rows = beta[..., None]
  rhs = jnp.concatenate([v, -chunks.masked(k_in, seg.first)], axis=-1)  # (Z, H, n, C, V + K)
  solved = triangular.unit_lower_solve(rows * interact, rows * rhs, precision)
  dim_v = v.shape[-1]
  # The writes U - W S_0 are the rows: o = weights (U - W S_0) + exp(b) q S_0.
  solve = low_rank.Solve(chunks.masked(k_out, seg.last), solved[..., :dim_v],
                         solved[..., dim_v:], weights)
  return common.read_out(a, None, q_in, None, seg, bad, bad_query, reset, precision, read_every,
                         solve=solve)


def delta_rule(
    q,
    k,
    v,
    beta,
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
    impl: str | Impl = "auto",
):
  """The delta rule and the gated delta rule (DeltaNet, Gated DeltaNet, KDA), per head.

  With a `(K, V)` state S, row vectors q_t, k_t `(K,)`, v_t `(V,)` and a write strength
  beta_t:

    S_t = (I - beta_t k_t^T k_t) diag(exp(g_t)) S_{t-1} + beta_t k_t^T v_t,    o_t = q_t S_t,

  i.e. the state decays, then moves its prediction k_t S for key k_t a fraction beta_t of
  the way to v_t. `log_decay` g_t is one number per head (Gated DeltaNet), one per key
  channel, scaling the rows of S (Kimi Delta Attention), or absent (DeltaNet). No
  normalisation of the keys or scaling of `q` is implied (the layers normalise keys to
  unit length, which keeps the transition a contraction for beta in [0, 2]).
  `reset[..., t]` clears the state before step t, also inside a chunk; the outputs and
  gradients from a reset on are the same to the last bit whatever came before it.

  The chunked mode solves, per chunk of C steps, the unit lower-triangular system of the
  UT transform (Yang et al. 2024) for the chunk's writes given any entering state, so a
  chunk becomes matrix products plus a `(K, K)` transition carried to the next chunk.
  Gradients are JAX's own (forward and reverse mode); they keep one state per chunk and
  recompute the rest. bfloat16/float16 inputs accumulate in float32.

  Args:
    q: `(..., T, H, K)` queries, real floating; or `(..., T, H / G, K)` with G value heads
      per head of q and k (grouped heads, as Mamba-2's groups of B and C or Qwen3-Next's
      value heads): value head h reads query and key head h // G.
    k: `(..., T, H, K)` keys, or `(..., T, H / G, K)` as `q`.
    v: `(..., T, H, V)` values.
    beta: `(..., T, H)` write strengths (usually in (0, 1)).
    log_decay: None, `(..., T, H)` or `(..., T, H, K)`: log of the decay, <= 0 and finite;
      a per-key decay stays exact however strong (each exponent is a difference <= 0).
    initial_state: `(..., H, K, V)` state before the first step; default zeros.
    reset: `(..., T)` booleans; True clears the state before that step.
    mode: "sequential", "chunked", "parallel" (chunk transitions combined as a tree of
      `(K, K)` products) or "auto"; see `linear_attention`. On CPU, "auto" computes values
      step by step below 16 (batch row, head) sequences and 2^15 (batch row, head, step)
      triples (derivatives chunked); on accelerators it runs the chunked form, whose memory
      the tree's matrices take 4-7x of.
    chunk_size: steps per chunk; default 32 on CPU for states of fewer than 2^17 (K x V)
      entries, else 64 (32 with one decay per key channel everywhere); at most T.
    return_final_state: also return S_T.
    axis_name: sequence parallelism as in `linear_attention`; a device sums its slice up
      as S -> M S + U with M the `(K, K)` product of its transitions.
    precision: precision of the matrix products (`jax.lax.Precision`).
    check_log_decay: as in `linear_attention`.
    impl: "xla", "pallas" or "auto", as in `linear_attention`: the kernels solve each chunk's
      system by products too, and take `beta`, both decays, resets, `initial_state` and any
      T; `axis_name`, float64, non-finite inputs or cotangents and `jvp` go to the XLA form.

  Returns:
    `o` `(..., T, H, V)`; with `return_final_state`, `(o, S_T)`, dtypes as in
    `linear_attention`.

  Raises:
    TypeError: for integer or complex inputs, or a non-boolean `reset`.
    ValueError: for shapes that do not fit `q`, a positive or non-finite `log_decay` known
      at trace time, an unknown `mode` or `impl`, a non-positive `chunk_size`, or an
      `axis_name` outside `shard_map`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.scan import delta_rule
    >>> k = jnp.ones((2, 1, 1))  # T=2, one head, K=1
    >>> v = jnp.array([[[4.0]], [[8.0]]])
    >>> delta_rule(k, k, v, jnp.full((2, 1), 0.5))[:, 0, 0]  # halfway to v, twice
    Array([2., 5.], dtype=float32)

  References:
    Schlag et al., "Linear transformers are secretly fast weight programmers", ICML 2021;
    Yang et al., "Parallelizing linear transformers with the delta rule over sequence
    length", NeurIPS 2024; Yang, Kautz & Hatamizadeh, "Gated delta networks", ICLR 2025;
    Kimi Team, "Kimi Linear: an expressive, efficient attention architecture", 2025.
  """
  mode = common.check_options(mode, chunk_size, axis_name)
  impl = parse_impl(impl)
  x = prepare(q, k, v, log_decay=log_decay, beta=beta, initial_state=initial_state,
              reset=reset, check_log_decay=check_log_decay, grouped=True)
  by_xla = lambda x, return_final_state: evaluate(
      x, mode=mode, chunk_size=chunk_size, axis_name=axis_name, precision=precision,
      return_final_state=return_final_state)
  return common.evaluate_by(impl, x, kernels.run, by_xla, chunk_size=chunk_size,
                            axis_name=axis_name, precision=precision,
                            return_final_state=return_final_state)


def evaluate(x: Inputs, *, mode: Mode, chunk_size: int | None, axis_name: Hashable | None,
             precision, return_final_state: bool, read_every: int = 1):
  """`delta_rule` on checked inputs (`prepare`).

  With `read_every` r (`delta_product`'s tokens of r steps), only the outputs of steps
  r - 1, 2r - 1, ... are returned (`common.evaluate`), and only the first step of each r has
  a decay or a reset: the step loop takes r steps per iteration, and the chunked forms skip
  the other steps' queries when a chunk holds whole groups of r steps.
  """
  per_key = x.log_decay is not None and x.log_decay.ndim == 4
  small = x.k.shape[-1] * x.v.shape[-1] < common.SOLVED_STATES_BELOW
  default = (common.SOLVED_CHUNK_SIZE if per_key or (jax.default_backend() == "cpu" and small)
             else common.DEFAULT_CHUNK_SIZE)
  return common.evaluate(x, _sequential, _chunk_maps, matrix=True, mode=mode,
                         chunk_size=chunk_size, axis_name=axis_name, precision=precision,
                         return_final_state=return_final_state, default_chunk_size=default,
                         per_key_scores=per_key, chunked_values_from=DELTA_VALUES_CHUNKED_FROM,
                         chunked_values_rows=DELTA_VALUES_CHUNKED_ROWS, read_every=read_every)
