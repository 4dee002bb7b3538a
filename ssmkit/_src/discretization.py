"""Discretisation of continuous-time SSMs x' = A x + B u with step dt, and step-size init.

Used by S4D and S5 (ZOH or bilinear, their `discretization` option) and by their step-size
initialisation. The selective layers (Mamba, Mamba-2, Gated DeltaNet) discretise inside their
own recurrence, as their reference code does: exp(dt A) for A and the Euler step dt B for B,
with dt an input-dependent step. A is diagonal `(..., N)` (the
layers' case) or dense `(..., N, N)`; B is `(..., N, H)`, or `(..., N)` beside a diagonal
A for one input per state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _one_input(a: Array, b: Array, diagonal: bool) -> bool:
  """Whether `b` is one input per state (diagonal `a` of the same shape), else a matrix."""
  n = a.shape[-1]
  if not diagonal and (a.ndim < 2 or a.shape[-2] != n):
    raise ValueError(f"`a` must be square `(..., N, N)` when not diagonal, got {a.shape}.")
  if diagonal and b.shape == a.shape:
    return True
  if b.ndim < 2 or b.shape[-2] != n:
    expected = "`(..., N)` like `a` or `(..., N, H)`" if diagonal else "`(..., N, H)`"
    raise ValueError(f"`b` must be {expected} with N = {n}, got {b.shape}.")
  return False


def _as_matrix_step(dt: Array) -> Array:
  """dt with two trailing axes, to scale the `(N, N)` matrices of a dense `a`."""
  return dt[..., None, None]


def zoh(a: Array, b: Array, dt: Array, *, diagonal: bool = True) -> tuple[Array, Array]:
  """Zero-order hold: A_bar = exp(dt A), B_bar = A^-1 (exp(dt A) - I) B.

  Args:
    a: state matrix, diagonal `(..., N)` (default) or dense `(..., N, N)` with
      `diagonal=False`; real or complex, invertible.
    b: input matrix `(..., N, H)`; with a diagonal `a`, also `(..., N)` (one input per
      state, as in S4D).
    dt: positive step sizes; with a diagonal `a` they broadcast against it (a scalar, per
      channel `(..., 1)` or per state `(..., N)`), with a dense one against its batch axes.
    diagonal: whether `a` holds the diagonal only.

  Returns:
    `(a_bar, b_bar)` with the shapes of `a` and `b`.
  """
  a, b, dt = jnp.asarray(a), jnp.asarray(b), jnp.asarray(dt)
  one_input = _one_input(a, b, diagonal)
  if diagonal:
    a_bar = jnp.exp(dt * a)
    gain = (a_bar - 1) / a
    return a_bar, gain * b if one_input else gain[..., None] * b
  a_bar = jax.scipy.linalg.expm(_as_matrix_step(dt) * a)
  eye = jnp.eye(a.shape[-1], dtype=a_bar.dtype)
  return a_bar, jnp.linalg.solve(a, (a_bar - eye) @ b)


def bilinear(a: Array, b: Array, dt: Array, *, diagonal: bool = True) -> tuple[Array, Array]:
  """Bilinear (Tustin): A_bar = (I - dt/2 A)^-1 (I + dt/2 A), B_bar = (I - dt/2 A)^-1 dt B.

  Args and returns as `zoh`.
  """
  a, b, dt = jnp.asarray(a), jnp.asarray(b), jnp.asarray(dt)
  one_input = _one_input(a, b, diagonal)
  if diagonal:
    inverse = 1 / (1 - dt / 2 * a)
    a_bar = inverse * (1 + dt / 2 * a)
    gain = inverse * dt
    return a_bar, gain * b if one_input else gain[..., None] * b
  step = _as_matrix_step(dt)
  eye = jnp.eye(a.shape[-1], dtype=a.dtype)
  left = eye - step / 2 * a
  return jnp.linalg.solve(left, eye + step / 2 * a), jnp.linalg.solve(left, step * b)


def by_name(name: str):
  """`zoh` or `bilinear` by name, for a layer's `discretization` attribute."""
  methods = {"zoh": zoh, "bilinear": bilinear}
  if name not in methods:
    raise ValueError(f"`discretization` must be 'zoh' or 'bilinear', got {name!r}.")
  return methods[name]


def log_step_init(
    dt_min: float = 1e-3, dt_max: float = 1e-1
) -> jax.nn.initializers.Initializer:
  """Initialiser of log(dt) uniform in [log dt_min, log dt_max] (S4, S4D, S5, Mamba)."""
  if not 0 < dt_min <= dt_max:
    raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}.")

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    return jax.random.uniform(
        key, shape, dtype, minval=jnp.log(dt_min), maxval=jnp.log(dt_max)
    )

  return init
