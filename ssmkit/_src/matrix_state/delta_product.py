"""Gated DeltaProduct: several delta-rule steps per token, the delta rule over interleaved steps."""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src import checks
from ssmkit._src.matrix_state import common, delta_rule
from ssmkit._src.matrix_state.inputs import prepare
from ssmkit._src.modes import Mode

Array = jax.Array


def _check(q, k, v, beta, log_decay, reset) -> tuple[Array, Array, Array, Array, int]:
  q, k, v, beta = (checks.real_floating(x, name)
                   for x, name in ((q, "q"), (k, "k"), (v, "v"), (beta, "beta")))
  if q.ndim < 3:
    raise ValueError(f"`q` must be `(..., T, H, K)`, got shape {q.shape}.")
  if k.ndim != q.ndim + 1 or k.shape[:-3] + k.shape[-2:] != q.shape[:-2] + q.shape[-2:]:
    raise ValueError(
        f"`k` must be `(..., T, n, H, K)`: n keys per step of `q` {q.shape}, got {k.shape}.")
  steps = k.shape[-3]
  if steps < 1:
    raise ValueError(f"`k` must have n >= 1 keys per step, got shape {k.shape}.")
  if v.shape[:-1] != k.shape[:-1]:
    raise ValueError(
        f"`v` must be `(..., T, n, H, V)` with the leading shape {k.shape[:-1]} of `k`, got "
        f"{v.shape}.")
  checks.check_shape(beta, k.shape[:-1], "beta", "(..., T, n, H)")
  if log_decay is not None and jnp.shape(log_decay) not in (q.shape[:-1], q.shape):
    raise ValueError(f"`log_decay` must be (..., T, H) or (..., T, H, K): {q.shape[:-1]} or "
                     f"{q.shape}, got {jnp.shape(log_decay)}.")
  if reset is not None:
    checks.check_shape(jnp.asarray(reset), q.shape[:-2], "reset",
                       "(..., T): the leading shape of `q`")
  return q, k, v, beta, steps


def interleave(x: Array | None, steps: int, axis: int) -> Array | None:
  """`(..., T, n, ...)` with time at `axis` -> `(..., T * n, ...)`."""
  if x is None:
    return None
  return x.reshape((*x.shape[:axis], x.shape[axis] * steps, *x.shape[axis + 2:]))


def at_step(x: Array | None, steps: int, index: int, axis: int) -> Array | None:
  """`x` with time at `axis` placed at step `index` of n per token, zeros (False) elsewhere."""
  if x is None:
    return None
  x = jnp.asarray(x)
  axis = axis % x.ndim
  spread = jnp.zeros((*x.shape[:axis + 1], steps, *x.shape[axis + 1:]), x.dtype)
  spread = lax.dynamic_update_index_in_dim(spread, jnp.expand_dims(x, axis + 1), index, axis + 1)
  return interleave(spread, steps, axis)


def delta_product(
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
):
  """Gated DeltaProduct: n delta-rule steps per token, a product of n Householder transitions.

  Per head, with a `(K, V)` state S, for each token t the state decays once, then takes n
  delta-rule steps with keys k_{t,j}, values v_{t,j} and strengths beta_{t,j}, and q_t
  reads it:

    S_{t,0} = diag(exp(g_t)) S_{t-1},
    S_{t,j} = (I - beta_{t,j} k_{t,j}^T k_{t,j}) S_{t,j-1} + beta_{t,j} k_{t,j}^T v_{t,j},
    S_t = S_{t,n},    o_t = q_t S_t,

  so the transition is a product of n generalized Householder matrices.

  n = 1 is `delta_rule`. This is that function over the T * n interleaved steps (the
  decay and `reset` on each token's first step, the query on its last), so every mode,
  streaming and `axis_name` work as there; a device's slice of T tokens is T * n steps.
  The chunked forms score only the steps that are read, a token's last (when `chunk_size`
  is a multiple of n): its gradient took 201 ms against 218 ms with every step scored
  (B=2 T=4096 H=4 K=V=64, n=2, CPU). The step loop takes a token's n steps per iteration;
  "auto" decodes a single token with it, and on CPU computes values with it below 2^15
  (batch row, head, interleaved step) triples, as `delta_rule` does.
  flash-linear-attention's `chunk_gated_delta_product` takes the same interleaved keys as
  `(B, T * n, H, K)`: `k.reshape(B, T, n, H, K)` is this function's layout. No scaling of
  `q` is implied.

  Args:
    q: `(..., T, H, K)` queries, real floating.
    k: `(..., T, n, H, K)` n keys per token (the layers normalise them to unit length).
    v: `(..., T, n, H, V)` values.
    beta: `(..., T, n, H)` write strengths (in [0, 2] each step is a reflection or a
      contraction).
    log_decay: None, `(..., T, H)` or `(..., T, H, K)`: log of each token's decay, <= 0.
    initial_state: `(..., H, K, V)` state before the first token; default zeros.
    reset: `(..., T)` booleans; True clears the state before that token.
    mode: as in `delta_rule`.
    chunk_size: delta-rule steps per chunk (n per token); default as `delta_rule`'s, at
      most T * n.
    return_final_state: also return S_T.
    axis_name: sequence parallelism as in `delta_rule`, tokens split over the devices.
    precision: precision of the matrix products (`jax.lax.Precision`).
    check_log_decay: as in `linear_attention`.

  Returns:
    `o` `(..., T, H, V)`; with `return_final_state`, `(o, S_T)`, as `delta_rule`.

  Raises:
    TypeError: for integer or complex inputs, or a non-boolean `reset`.
    ValueError: for shapes that do not fit `q` and n, and as `delta_rule`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.scan import delta_product
    >>> k = jnp.ones((1, 2, 1, 1))  # T=1, two steps, one head, K=1
    >>> v = jnp.array([[[[4.0]], [[8.0]]]])
    >>> delta_product(k[:, 0], k, v, jnp.full((1, 2, 1), 0.5))[:, 0, 0]  # 2, then halfway to 8
    Array([5.], dtype=float32)

  References:
    Siems et al., "DeltaProduct: improving state-tracking in linear RNNs via Householder
    products", 2025; flash-linear-attention, `fla/ops/gated_delta_product/naive.py`.
  """
  q, k, v, beta, steps = _check(q, k, v, beta, log_decay, reset)
  time = q.ndim - 3
  mode = common.check_options(mode, chunk_size, axis_name)
  x = prepare(at_step(q, steps, steps - 1, time), interleave(k, steps, time),
              interleave(v, steps, time), log_decay=at_step(log_decay, steps, 0, time),
              beta=interleave(beta, steps, time), initial_state=initial_state,
              reset=at_step(reset, steps, 0, time), check_log_decay=check_log_decay)
  out = delta_rule.evaluate(x, mode=mode, chunk_size=chunk_size, axis_name=axis_name,
                            precision=precision, return_final_state=return_final_state,
                            read_every=steps)
  return out
