"""The Mamba-3 block (Lahoti et al., 2026): Mamba-2 with an exponential-trapezoidal input, a
data-dependent rotation of B and C (a complex-valued state) and optional MIMO ranks, and no
short convolution."""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common, functional
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.layers.initializers import constant, dt_bias_init, uniform
from ssmkit._src.layers.norms import EPS, rms_norm
from ssmkit._src.linear_recurrence import accumulation_dtype
from ssmkit._src.matrix_state.mamba3 import Mamba3State, mamba3
from ssmkit._src.modes import Mode

Array = jax.Array


def _sizes(cfg: Any, features: int) -> dict[str, int]:
  """The widths of a Mamba-3 block over `features`: inner, heads, ranks R, angles S."""
  inner = cfg.expand * features
  split = int(cfg.d_state * cfg.rope_fraction)
  return {"inner": inner, "heads": inner // cfg.head_dim, "ranks": cfg.mimo_rank or 1,
          "angles": (split - split % 2) // 2}


def _check(cfg: Any, features: int) -> dict[str, int]:
  for name in ("d_state", "expand", "head_dim", "n_groups"):
    common.check_positive_int(getattr(cfg, name), name)
  if cfg.mimo_rank is not None:
    common.check_positive_int(cfg.mimo_rank, "mimo_rank")
  sizes = _sizes(cfg, features)
  if sizes["inner"] % cfg.head_dim:
    raise ValueError(f"`head_dim`={cfg.head_dim} must divide the inner width expand * H = "
                     f"{sizes['inner']}.")
  if sizes["heads"] % cfg.n_groups:
    raise ValueError(f"`n_groups`={cfg.n_groups} must divide the number of heads, {sizes['heads']}.")
  if cfg.rope_fraction not in (0.5, 1.0):
    raise ValueError(f"`rope_fraction` must be 0.5 or 1.0, got {cfg.rope_fraction!r}.")
  if not 0 < cfg.dt_min < cfg.dt_max:
    raise ValueError(f"`dt_min` and `dt_max` must be 0 < dt_min < dt_max, got {cfg.dt_min!r}, "
                     f"{cfg.dt_max!r}.")
  if not cfg.a_floor > 0 or not cfg.norm_eps > 0:
    raise ValueError(f"`a_floor` and `norm_eps` must be > 0, got {cfg.a_floor!r}, {cfg.norm_eps!r}.")
  return sizes


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The parameters of a Mamba-3 block over `features` channels, initialised as the reference."""
  s = _check(cfg, features)
  inner, heads, ranks, n = s["inner"], s["heads"], s["ranks"], cfg.d_state
  bc = cfg.n_groups * ranks * n
  per_rank = lambda value: ParamSpec((heads, ranks, cfg.head_dim), constant(value))
  specs = {
      # nn.Linear initialises as U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
      "in_proj": ParamSpec((features, 2 * inner + 2 * bc + 3 * heads + s["angles"]),
                           uniform(features**-0.5)),
      "dt_bias": ParamSpec((heads,), dt_bias_init(cfg.dt_min, cfg.dt_max)),
      "B_norm": ParamSpec((n,), nn.initializers.ones),
      "C_norm": ParamSpec((n,), nn.initializers.ones),
      "B_bias": ParamSpec((heads, ranks, n), nn.initializers.ones),
      "C_bias": ParamSpec((heads, ranks, n), nn.initializers.ones),
      "D": ParamSpec((heads,), nn.initializers.ones),
  }
  if cfg.mimo_rank is not None:
    specs |= {"mimo_x": per_rank(1 / ranks), "mimo_z": per_rank(1.0), "mimo_o": per_rank(1 / ranks)}
  if cfg.outproj_norm:
    specs["norm_scale"] = ParamSpec((inner,), nn.initializers.ones)
  return specs | {"out_proj": ParamSpec((inner, features), uniform(inner**-0.5))}


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> Mamba3State:
  """The zero state for inputs `(*batch, H)`: `(*batch, heads, N, P)`, the angles, and the
  last token's keys and values (`(*batch, [R,] heads, N)`, `(*batch, [R,] heads, P)`)."""
  *batch, features = input_shape
  s = _check(cfg, features)
  heads, ranks = s["heads"], (cfg.mimo_rank,) if cfg.mimo_rank is not None else ()
  zeros = lambda *shape: jnp.zeros((*batch, *shape), jnp.float32)
  return Mamba3State(zeros(heads, cfg.d_state, cfg.head_dim), zeros(heads, s["angles"]),
                     zeros(*ranks, heads, cfg.d_state), zeros(*ranks, heads, cfg.head_dim))


def decay_rate(a: Array, floor: float) -> Array:
  """A = min(-h(a), -floor) with the heavy-tailed h(a) = 1 + a for a >= 0, 1 / (1 - a) below:
  the reference's data-dependent A (since 2026-06; softplus before), whose magnitude falls
  only as 1 / |a| for negative a and never below `floor`."""
  heavy = jnp.maximum(a, 0) + 1 / (1 - jnp.minimum(a, 0))
  return jnp.minimum(-heavy, -floor)


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: Mamba3State | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, Mamba3State]:
  """The Mamba-3 block over `(..., T, H)` inputs: `(y, state after the last step)`."""
  s = _sizes(cfg, x.shape[-1])
  inner, heads, ranks, n, p = s["inner"], s["heads"], s["ranks"], cfg.d_state, cfg.head_dim
  mimo = cfg.mimo_rank is not None
  dtype = common.computation_dtype(x.dtype)
  acc = accumulation_dtype(x.dtype)
  bc = cfg.n_groups * ranks * n
  # The projection's order, as in the reference: [z, x, B, C, dt, A, lambda, angles].
  z, u, b, c, dt, a, trap, angles = jnp.split(
      common.project(x, params["in_proj"], dtype),
      list(itertools.accumulate((inner, inner, bc, bc, heads, heads, heads))), axis=-1)

  def rows(m: Array, name: str) -> Array:
    # (..., T, R G N) normalised per (rank, group), each group's heads sharing it, plus the
    # per-head bias: (..., T, [R,] heads, N). One rank (SISO) or one group takes no axis of its
    # own: XLA's CPU sums over an array with a unit axis ran up to 60 times slower.
    shared = (*((ranks,) if mimo else ()), *((cfg.n_groups,) if cfg.n_groups > 1 else ()))
    m = rms_norm(m.reshape(*m.shape[:-1], *shared, n), params[f"{name}_norm"].astype(acc),
                 cfg.norm_eps)
    if cfg.n_groups > 1:
      m = jnp.repeat(m, heads // cfg.n_groups, axis=-2)
    else:
      m = jnp.broadcast_to(m[..., None, :], (*m.shape[:-1], heads, n))
    bias = params[f"{name}_bias"].astype(acc)  # (heads, R, N)
    return m + common.leading_ones(jnp.swapaxes(bias, 0, 1) if mimo else bias[:, 0], m.ndim)

  k, q = rows(b, "B"), rows(c, "C")
  dt = jax.nn.softplus(dt + common.leading_ones(params["dt_bias"].astype(acc), dt.ndim))
  log_decay = decay_rate(a, cfg.a_floor) * dt
  rate = math.pi * jnp.tanh(angles)[..., None, :] * dt[..., None]
  v = u.reshape(*u.shape[:-1], heads, p)
  if mimo:  # R rows of x
    v = v[..., None, :, :] * common.leading_ones(jnp.swapaxes(params["mimo_x"], 0, 1).astype(acc),
                                                 v.ndim + 1)
  o, state = mamba3(q, k, v, log_decay, dt, jax.nn.sigmoid(trap), rate,
                    rotary="halves" if mimo else "interleaved", initial_state=initial_state,
                    reset=reset, mode=mode, chunk_size=cfg.chunk_size, return_final_state=True,
                    axis_name=axis_name, check_values=False)
  d = common.leading_ones(params["D"].astype(acc)[:, None], o.ndim)
  y = o + d * v
  z = z.reshape(*z.shape[:-1], heads, p)
  if mimo:
    z = z[..., None, :, :] * common.leading_ones(jnp.swapaxes(params["mimo_z"], 0, 1).astype(acc),
                                                 z.ndim + 1)
  if cfg.outproj_norm:
    y = rms_norm(y, params["norm_scale"].astype(acc).reshape(heads, p), cfg.norm_eps)
  y = y * jax.nn.silu(z)
  if mimo:
    y = jnp.sum(y * common.leading_ones(jnp.swapaxes(params["mimo_o"], 0, 1).astype(acc), y.ndim),
                axis=-3)
  y = common.project(y.reshape(*y.shape[:-2], inner), params["out_proj"], dtype)
  return y.astype(x.dtype), state


def step(cfg: Any, params: dict[str, Array], state: Mamba3State, x_t: Array,
         reset: Array | None = None) -> tuple[Mamba3State, Array]:
  """One step of the Mamba-3 block on `(*batch, H)` inputs: `(state, y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class Mamba3(functional.LinenLayer):
  """Mamba-3 block: in-projection, the trapezoidal rotary SSM over heads, gate, out-projection.

  Inputs `(..., T, H)` give outputs `(..., T, H)`. One projection (no convolution) gives, per
  step, z and x (`expand * H` each, heads of `head_dim` channels P), B and C (`n_groups` groups
  of `mimo_rank` rows of N = `d_state`), dt, A, lambda per head and S angles (S = N
  `rope_fraction` / 2, shared by the heads). B and C are RMS-normalised per row and get a
  per-head bias; dt = softplus(dt + dt_bias); A = min(-h(a), -`a_floor`) with the heavy tail
  h(a) = 1 + a (a >= 0), 1 / (1 - a) (a < 0); lambda = sigmoid(.); the angles advance by
  pi tanh(.) dt. Per head, `ssmkit.scan.mamba3`:

    S_t = exp(A_t dt_t) (S_{t-1} + (1 - lambda_t) dt_t B~_{t-1}^T x_{t-1}) + lambda_t dt_t B~_t^T x_t,
    y_t = C~_t S_t + D x_t,

  with B~, C~ turned by the cumulative angles (adjacent channel pairs; the halves with MIMO),
  then y_t * SiLU(z_t) (after a per-head RMSNorm with `outproj_norm`) projected back to H.
  With `mimo_rank` R, x enters as R rows x * mimo_x, each row of C reads S, each output row is
  gated by SiLU(z * mimo_z) and the rows are summed with weights mimo_o. `reset` starts a new
  sequence; the state is a `ssmkit.scan.Mamba3State`.

  Attributes:
    d_state: state size N per head (the size of B and C).
    expand: inner width = expand * H.
    head_dim: channels P per head; must divide expand * H (the reference's default is 64;
      32 serves any H that is a multiple of 16).
    n_groups: groups of heads that share B and C; must divide the number of heads.
    rope_fraction: the share of B's and C's channels that turn, 0.5 or 1.0.
    mimo_rank: None (SISO) or the rank R of the MIMO form.
    outproj_norm: a per-head RMSNorm before the gate.
    dt_min, dt_max: the range of the initial steps.
    a_floor: the smallest |A|.
    norm_eps: the epsilon of the RMSNorms.
    chunk_size: steps per chunk (R per token) of the chunkwise algorithm; default `linear_attention`'s.
    param_dtype: dtype of the parameters.

  References:
    Lahoti et al., "Mamba-3: improved sequence modeling using state space principles", 2026
    (arXiv:2603.15569); the reference module `mamba_ssm/modules/mamba3.py` of
    state-spaces/mamba.
  """

  d_state: int = 128
  expand: int = 2
  head_dim: int = 32
  n_groups: int = 1
  rope_fraction: float = 0.5
  mimo_rank: int | None = None
  outproj_norm: bool = False
  dt_min: float = 1e-3
  dt_max: float = 1e-1
  a_floor: float = 1e-4
  norm_eps: float = EPS
  chunk_size: int | None = None
  param_dtype: jnp.dtype = jnp.float32

  # As in the reference: D and the step bias without weight decay; the biases and norms too.
  parameter_groups = common.ParameterGroups(
      no_decay=frozenset({"dt_bias", "D", "B_bias", "C_bias", "B_norm", "C_norm", "norm_scale"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)
