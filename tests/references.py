"""Independent float64 NumPy references: plain Python loops, no ssmkit code."""

from __future__ import annotations

import numpy as np


def scan_loop(fn, elems, reverse=False):
  """Inclusive scan of a binary `fn` over the leading axis of a tuple of arrays."""
  length = elems[0].shape[0]
  order = range(length - 1, -1, -1) if reverse else range(length)
  outs = [np.empty_like(np.asarray(e)) for e in elems]
  acc = None
  for t in order:
    item = tuple(np.asarray(e)[t] for e in elems)
    acc = item if acc is None else fn(acc, item)
    for out, value in zip(outs, acc, strict=False):
      out[t] = value
  return tuple(outs)


def linear_recurrence(a, b, h0=None, reset=None, reverse=False):
  """h_t = a_t h_{t-1} + b_t over axis 0 in float64/complex128; a, reset broadcast to b."""
  b = np.asarray(b)
  dtype = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
  b = b.astype(dtype)
  a = np.broadcast_to(np.asarray(a).astype(dtype), b.shape)
  reset = np.zeros(b.shape, bool) if reset is None else np.broadcast_to(reset, b.shape)
  h = np.zeros(b.shape[1:], dtype) if h0 is None else np.asarray(h0).astype(dtype)
  out = np.empty_like(b)
  order = range(b.shape[0] - 1, -1, -1) if reverse else range(b.shape[0])
  for t in order:
    h = np.where(reset[t], b[t], a[t] * h + b[t])
    out[t] = h
  return out


def selective_scan(u, dt, a, b, c, h0=None, reset=None):
  """Mamba's selective scan over axis -2 in float64, one step at a time; returns (y, h_last).

  h_t = exp(dt_t[:, None] * a) * h_{t-1} + (dt_t * u_t)[:, None] * b_t[None, :] and
  y_t = h_t @ c_t, for u, dt `(..., T, D)`, a `(D, N)`, b, c `(..., T, N)`; `reset[..., t]`
  zeroes the state before step t.
  """
  u, dt, a, b, c = (np.asarray(x, np.float64) for x in (u, dt, a, b, c))
  h = np.zeros(u.shape[:-2] + a.shape) if h0 is None else np.array(h0, np.float64)
  reset = np.zeros(u.shape[:-1], bool) if reset is None else np.asarray(reset)
  y = np.empty(u.shape)
  for t in range(u.shape[-2]):
    h = np.where(reset[..., t, None, None], 0.0, h)
    x_t = dt[..., t, :] * u[..., t, :]
    h = np.exp(dt[..., t, :, None] * a) * h + x_t[..., None] * b[..., t, None, :]
    y[..., t, :] = np.sum(h * c[..., t, None, :], axis=-1)
  return y, h


def _segments(length, truncated):
  """[start, end) ranges of the trajectory, each ending after a truncated step or at T."""
  ends = [t + 1 for t in range(length) if truncated[t]]
  starts = [0, *ends]
  ends = [*ends, length] if not ends or ends[-1] != length else ends
  return [(s, e) for s, e in zip(starts, ends, strict=False) if s < e]


def _float64_trajectory(rewards, discounts, values, lambda_, truncated):
  """Float64 copies, lambda_ broadcast per step, and no truncation when `truncated` is None."""
  r, d, v = (np.asarray(x, np.float64) for x in (rewards, discounts, values))
  lam = np.broadcast_to(np.asarray(lambda_, np.float64), r.shape)
  truncated = np.zeros(r.shape[0], bool) if truncated is None else np.asarray(truncated)
  return r, d, v, lam, truncated


def lambda_returns(rewards, discounts, values, lambda_, bootstrap, truncated=None, final_values=None):
  """Float64 lambda-returns of one trajectory (axis 0), one episode segment at a time.

  The trajectory is split after every truncated step; each segment is an independent
  trajectory whose last step bootstraps from `final_values` (truncated) or from `bootstrap`
  (the end of the rollout). `values[t]` is the value after step t.
  """
  r, d, v, lam, truncated = _float64_trajectory(rewards, discounts, values, lambda_, truncated)
  length = r.shape[0]
  out = np.empty(length)
  for start, end in _segments(length, truncated):
    tail = float(final_values[end - 1]) if truncated[end - 1] else float(bootstrap)
    g = tail
    for t in range(end - 1, start - 1, -1):
      v_next = tail if t == end - 1 else v[t]
      lam_t = 0.0 if t == end - 1 else lam[t]
      g = r[t] + d[t] * ((1 - lam_t) * v_next + lam_t * g)
      out[t] = g
  return out


def generalized_advantage_estimation(rewards, discounts, values, lambda_, truncated=None,
                                     final_values=None):
  """Float64 GAE of one trajectory from its definition: discounted sums of TD errors.

  A_t = sum_k (prod_{j<k} d_j lambda_j) delta_k over the steps k of t's episode segment,
  with delta_k = r_k + d_k v'_{k+1} - v_k and v' the final value at a truncated step.
  """
  r, d, v, lam, truncated = _float64_trajectory(rewards, discounts, values, lambda_, truncated)
  length = r.shape[0]
  out = np.empty(length)
  for start, end in _segments(length, truncated):
    v_next = v[start + 1 : end + 1].copy()
    if truncated[end - 1]:
      v_next[-1] = final_values[end - 1]
    delta = r[start:end] + d[start:end] * v_next - v[start:end]
    for t in range(start, end):
      weight, total = 1.0, 0.0
      for k in range(t, end):
        total += weight * delta[k - start]
        weight *= d[k] * lam[k]
      out[t] = total
  return out


def n_step_returns(rewards, discounts, values, n, lambda_, truncated=None, final_values=None):
  """Float64 n-step returns of one trajectory: each window recursed on its own.

  The window of step t covers t .. min(t + n, end) - 1, `end` the end of t's episode
  segment; it bootstraps from the value after its last step (the final value when that
  step is truncated).
  """
  r, d, v, lam, truncated = _float64_trajectory(rewards, discounts, values, lambda_, truncated)
  length = r.shape[0]
  out = np.empty(length)
  for start, end in _segments(length, truncated):
    v_seg = v[start:end].copy()
    if truncated[end - 1]:
      v_seg[-1] = final_values[end - 1]
    for t in range(start, end):
      last = min(t + n, end) - 1
      g = v_seg[last - start]
      for k in range(last, t - 1, -1):
        lam_k = 0.0 if k == end - 1 and truncated[k] else lam[k]
        g = r[k] + d[k] * ((1 - lam_k) * v_seg[k - start] + lam_k * g)
      out[t] = g
  return out


def vtrace(v_tm1, v_t, r_t, discount_t, rho_tm1, lambda_, clip_rho_threshold=1.0,
           clip_pg_rho_threshold=1.0, sample_mask=None, truncated=None, final_values=None):
  """Float64 V-trace of one trajectory from IMPALA's sums; returns (errors, pg, q_estimate).

  v_s - V(x_s) = sum_k (prod_{i<k} w_i) m_k delta_k over the steps k of s's episode segment,
  with delta_k = min(rho_bar, rho_k) (r_k + d_k v'_{k+1} - V(x_k)), w_i = d_i c_i on learnable
  steps (c_i = lambda_i min(1, rho_i)) and 1 on the others (rlax's `sample_mask`).
  """
  r, d, v, lam, truncated = _float64_trajectory(r_t, discount_t, v_tm1, lambda_, truncated)
  v_t, rho = np.asarray(v_t, np.float64), np.asarray(rho_tm1, np.float64)
  mask = np.ones(r.shape, bool) if sample_mask is None else np.asarray(sample_mask)
  length = r.shape[0]
  errors, q_estimate = np.empty(length), np.empty(length)
  for start, end in _segments(length, truncated):
    v_next = v_t[start:end].copy()
    if truncated[end - 1]:
      v_next[-1] = final_values[end - 1]
    delta = np.minimum(clip_rho_threshold, rho[start:end]) * (
        r[start:end] + d[start:end] * v_next - v[start:end])
    for s in range(start, end):
      weight, total = 1.0, 0.0
      for k in range(s, end):
        total += weight * mask[k] * delta[k - start]
        weight *= d[k] * lam[k] * min(1.0, rho[k]) if mask[k] else 1.0
      errors[s] = total
  targets = errors + v
  for start, end in _segments(length, truncated):
    for s in range(start, end):
      if s == end - 1:
        bootstrap = final_values[s] if truncated[s] else v_t[s]
      else:
        bootstrap = lam[s] * targets[s + 1] + (1 - lam[s]) * v[s + 1]
      q_estimate[s] = r[s] + d[s] * bootstrap
  pg = np.minimum(clip_pg_rho_threshold, rho) * (q_estimate - v)
  return errors, pg, q_estimate


def retrace(qa_tm1, qa_t, expected_q_t, c_t, r_t, discount_t, truncated=None, final_values=None):
  """Float64 Retrace errors G_t - qa_tm1_t of one trajectory, one episode segment at a time.

  G_t = r_t + d_t (E_t - c_t qa_t + c_t G_{t+1}) inside a segment; its last step bootstraps
  from E_t alone, the final value when the segment ends in a truncation.
  """
  r, d, expected, _, truncated = _float64_trajectory(r_t, discount_t, expected_q_t, 1.0, truncated)
  qa_t, c = np.asarray(qa_t, np.float64), np.asarray(c_t, np.float64)
  length = r.shape[0]
  out = np.empty(length)
  for start, end in _segments(length, truncated):
    last = end - 1
    g = r[last] + d[last] * (final_values[last] if truncated[last] else expected[last])
    out[last] = g
    for t in range(last - 1, start - 1, -1):
      g = r[t] + d[t] * (expected[t] - c[t] * qa_t[t] + c[t] * g)
      out[t] = g
  return out - np.asarray(qa_tm1, np.float64)


def _matrix_state_step(xp, state, q_t, k_t, v_t, g_t, beta_t, a_t, b_t, reset_t, exclusive=False):
  """One step of `matrix_state` for `(..., H, K)` rows q_t, k_t, `(..., H, V)` v_t; a delta
  product's k_t, v_t, beta_t have an axis of n sub-steps before the heads."""
  state = xp.where(reset_t[..., None, None, None], 0.0, state)
  decay = xp.exp(g_t)[..., None] if g_t.ndim == q_t.ndim else xp.exp(g_t)[..., None, None]
  if a_t is not None:  # the generalized delta rule reads the state before it decays
    read = xp.einsum("...k,...kv->...v", a_t, state)
    state = decay * state + b_t[..., :, None] * read[..., None, :]
    state = state + k_t[..., :, None] * v_t[..., None, :]
  elif beta_t is None:
    state = decay * state
    if exclusive:  # read before the write
      return state + k_t[..., :, None] * v_t[..., None, :], xp.einsum("...k,...kv->...v", q_t, state)
    state = state + k_t[..., :, None] * v_t[..., None, :]
  else:
    state = decay * state
    products = k_t.ndim > q_t.ndim
    for j in range(k_t.shape[-3] if products else 1):
      k_j, v_j, beta_j = ((k_t[..., j, :, :], v_t[..., j, :, :], beta_t[..., j, :]) if products
                          else (k_t, v_t, beta_t))
      predicted = xp.einsum("...k,...kv->...v", k_j, state)
      state = state + k_j[..., :, None] * (beta_j[..., None] * (v_j - predicted))[..., None, :]
  return state, xp.einsum("...k,...kv->...v", q_t, state)


def matrix_state(q, k, v, log_decay=None, beta=None, initial_state=None, reset=None, a=None,
                 b=None, exclusive=False):
  """Linear attention, the gated delta rule, its products or the generalized delta rule, one
  step at a time in float64.

  Per head, with S a (K, V) matrix and row vectors q_t, k_t (K,) and v_t (V,):
  linear attention S_t = exp(g_t) S_{t-1} + k_t^T v_t; delta rule (beta given)
  S_t = (I - beta_t k_t^T k_t) exp(g_t) S_{t-1} + beta_t k_t^T v_t; delta product (k
  `(..., T, n, H, K)`): the decay, then n delta-rule steps per token; generalized delta rule
  (a, b given) S_t = exp(g_t) S_{t-1} + b_t^T (a_t S_{t-1}) + k_t^T v_t; o_t = q_t S_t, or
  with `exclusive` (linear attention) o_t = q_t exp(g_t) S_{t-1}. `log_decay` is None,
  `(..., T, H)` or `(..., T, H, K)` (one decay per key row of S); `reset` `(..., T)` zeroes S
  before step t. Returns `(o, S_T)`.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  batch, length, heads, dim_k = q.shape[:-3], q.shape[-3], q.shape[-2], q.shape[-1]
  state = np.zeros((*batch, heads, dim_k, v.shape[-1]))
  if initial_state is not None:
    state = np.array(initial_state, np.float64)
  g = np.zeros(q.shape[:-1]) if log_decay is None else np.asarray(log_decay, np.float64)
  reset = np.zeros(q.shape[:-2], bool) if reset is None else np.asarray(reset)
  at = lambda x, t: None if x is None else np.asarray(x, np.float64)[(..., t) + (slice(None),) * (
      np.ndim(x) - q.ndim + 2)]
  out = np.empty((*q.shape[:-1], v.shape[-1]))
  for t in range(length):
    g_t = g[..., t, :, :] if g.ndim == q.ndim else g[..., t, :]
    state, out[..., t, :, :] = _matrix_state_step(
        np, state, q[..., t, :, :], at(k, t), at(v, t), g_t, at(beta, t), at(a, t), at(b, t),
        reset[..., t], exclusive)
  return out, state


def matrix_state_scan(q, k, v, log_decay=None, beta=None, initial_state=None, reset=None,
                      a=None, b=None, exclusive=False):
  """`matrix_state` as a `jax.lax.scan` in the inputs' dtype, to differentiate with JAX."""
  import jax
  import jax.numpy as jnp

  time = lambda x: None if x is None else jnp.moveaxis(jnp.asarray(x), q.ndim - 3, 0)
  state = initial_state
  if state is None:
    state = jnp.zeros((*q.shape[:-3], q.shape[-2], q.shape[-1], v.shape[-1]), q.dtype)
  g = jnp.zeros(q.shape[:-1], q.dtype) if log_decay is None else log_decay
  reset = np.zeros(q.shape[:-2], bool) if reset is None else reset
  xs = (time(q), time(k), time(v), time(g), time(beta), time(a), time(b),
        jnp.moveaxis(jnp.asarray(reset), -1, 0))
  final, out = jax.lax.scan(lambda s, x: _matrix_state_step(jnp, s, *x, exclusive), state, xs)
  return jnp.moveaxis(out, 0, q.ndim - 3), final


def _mamba3_turn(xp, x, theta, layout):
  """`x` `(..., N)` with channel pairs as complex numbers times exp(i theta) `(..., S)`: pairs
  (2i, 2i + 1) ("interleaved") or (i, i + N/2) ("halves"), the channels past S untouched."""
  n, s = x.shape[-1], theta.shape[-1]
  first, second = (x[..., 0:2 * s:2], x[..., 1:2 * s:2]) if layout == "interleaved" else (
      x[..., :s], x[..., n // 2:n // 2 + s])
  z = (first + 1j * second) * xp.exp(1j * theta)
  if layout == "interleaved":
    turned = xp.stack([z.real, z.imag], axis=-1).reshape(*x.shape[:-1], 2 * s)
    return xp.concatenate([turned, x[..., 2 * s:]], axis=-1)
  return xp.concatenate([z.real, x[..., s:n // 2], z.imag, x[..., n // 2 + s:]], axis=-1)


def _mamba3_step(xp, layout, carry, inputs):
  """One token of Mamba-3's recurrence, as state-spaces/mamba's `mamba3_MIMO_step_ref`: rows
  `(..., R, H, N)` q, k, `(..., R, H, P)` v; `(..., H)` log-decay, dt, lambda; `(..., H, S)`
  angle rate; `(...,)` reset. The carry: S `(..., H, N, P)`, theta, the last rotated keys and
  values."""
  state, theta, k_prev, v_prev = carry
  q, k, v, g, dt, lam, rate, reset = inputs
  keep = ~reset
  state = xp.where(keep[..., None, None, None], state, 0.0)
  theta = xp.where(keep[..., None, None], theta, 0.0) + rate
  theta = theta - 2 * np.pi * xp.floor(theta / (2 * np.pi))  # in [0, 2 pi), as the reference
  k_prev = xp.where(keep[..., None, None, None], k_prev, 0.0)
  v_prev = xp.where(keep[..., None, None, None], v_prev, 0.0)
  q, k = (_mamba3_turn(xp, x, theta[..., None, :, :], layout) for x in (q, k))
  alpha = xp.exp(g)
  beta, gamma = (1 - lam) * dt * alpha, lam * dt
  write = lambda a, b: xp.einsum("...rhn,...rhp->...hnp", a, b)
  state = (alpha[..., None, None] * state + beta[..., None, None] * write(k_prev, v_prev)
           + gamma[..., None, None] * write(k, v))
  return (state, theta, k, v), xp.einsum("...rhn,...hnp->...rhp", q, state)


def mamba3(q, k, v, log_decay, step_size, trapezoid, angle_rate, initial_state, reset,
           layout="interleaved"):
  """Mamba-3's recurrence one token at a time in float64, on rank-R rows (`(..., T, R, H, N)`
  q, k, `(..., T, R, H, P)` v): S_t = alpha_t S_{t-1} + beta_t k~_{t-1}^T v_{t-1}
  + gamma_t k~_t^T v_t, o_t = q~_t S_t, with keys and queries turned by the cumulative angles.
  `initial_state` is `(S, theta, k~_{-1}, v_{-1})`. Returns `(o, final carry)`."""
  f64 = lambda x: np.asarray(x, np.float64)
  carry = tuple(f64(x) for x in initial_state)
  time = np.ndim(log_decay) - 2
  out = np.empty((*v.shape[:-1], carry[0].shape[-1]))
  for t in range(np.shape(log_decay)[time]):
    at = lambda x, t=t: np.take(np.asarray(x), t, axis=time)
    carry, out_t = _mamba3_step(np, layout, carry, (
        *(f64(at(x)) for x in (q, k, v, log_decay, step_size, trapezoid, angle_rate)), at(reset)))
    np.moveaxis(out, time, 0)[t] = out_t
  return out, carry


def mamba3_scan(q, k, v, log_decay, step_size, trapezoid, angle_rate, initial_state, reset,
                layout="interleaved"):
  """`mamba3` as a `jax.lax.scan` in the inputs' dtype, to differentiate with JAX."""
  import jax
  import jax.numpy as jnp

  time = jnp.ndim(log_decay) - 2
  xs = tuple(jnp.moveaxis(jnp.asarray(x), time, 0)
             for x in (q, k, v, log_decay, step_size, trapezoid, angle_rate, reset))
  carry, out = jax.lax.scan(lambda c, x: _mamba3_step(jnp, layout, c, x), tuple(initial_state), xs)
  return jnp.moveaxis(out, 0, time), carry
