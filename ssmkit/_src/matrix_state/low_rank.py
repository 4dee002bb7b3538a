"""A solved chunk's map kept at low rank: S -> A S + L^T (X + Y S) + U.

The delta rules' chunks solve for rows x = X + Y S, one per step, given the state S entering
the chunk: the values each step writes (the delta rule) or what each step reads (the
generalized delta rule's a_t S_{t-1}). The state leaving the chunk is A S + L^T x + U (A row
decays) and the outputs read S and x. Run one chunk after another, the map costs two
products of a `(C, K)` and a `(K, V)` size per entering state, where the `(K, K)` matrix
A + L^T Y costs one of `(K, C)` by `(C, K)` to form and one of `(K, K)` by `(K, V)` to apply,
and the outputs read x where they would otherwise read S through a query corrected by Y.
Side by side, B=2 T=4096 H=4 K=V=64 on CPU, the gradients took 10-16% less time than with
the matrix (the generalized delta rule's 90.1 against 107.4 ms, the delta product's 130.0
against 147.6, KDA's 81.4 against 90.2, the delta rule's 68.2 against 77.5), in the same
memory. Combining maps as a tree or across devices needs the matrix (`dense`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ssmkit._src import state_pass

Array = jax.Array


class Solve(NamedTuple):
  """What a solved chunk adds to its linear-attention parts (`common.read_out`): its rows and
  how the outputs read them, `(Z, H, n, ...)`.

  Attributes:
    left, x, y: as in `LowRank`.
    weights: `(Z, H, n, R, C)` G: each read step's output adds G x.
  """

  left: Array
  x: Array
  y: Array
  weights: Array


class LowRank(NamedTuple):
  """Maps S -> A S + L^T (X + Y S) + U per batch row, head and chunk, `(Z, H, n, ...)`.

  Attributes:
    a: `(Z, H, n, K, 1)` or `(Z, H, n, 1, 1)` row decays.
    left: `(Z, H, n, C, K)` L, what each step's row adds to the state leaving the chunk.
    x: `(Z, H, n, C, V)` X, the rows from a zero entering state.
    y: `(Z, H, n, C, K)` Y, how the rows read the entering state.
    u: `(Z, H, n, K, V)` U, or None for zero.
    cut: `(Z, 1, n)` True where a reset cuts the chunk from the entering state, or None
      (no resets).
  """

  a: Array
  left: Array
  x: Array
  y: Array
  u: Array | None
  cut: Array | None


def chunk(m: LowRank, i: int) -> LowRank:
  """The map of chunk `i`."""
  return LowRank(*(None if x is None else x[:, :, i] for x in m))


def advance(m: LowRank, s: Array, precision) -> tuple[Array, Array]:
  """One chunk's map applied to the `(Z, H, K, V)` state `s`: the state leaving it and the
  rows x `(Z, H, C, V)`.

  With resets, the rows read `s` with its non-finite entries zeroed, as the outputs do
  (`common.read_out`): only the steps before a chunk's first reset read `s`, and a NaN they
  read must not reach the others through a product. With a cut, L is zero on those steps, so
  A S, zeroed first, is all that could carry a NaN in `s` across the reset; without one, the
  columns of `s` with a non-finite entry leave as NaN, as the steps (and the matrix) spread it.
  """
  if m.cut is None:
    read, spread = s, None
  else:
    finite = jnp.isfinite(s)
    read = jnp.where(finite, s, 0)
    spread = ~jnp.all(finite, axis=-2, keepdims=True) & ~m.cut[..., None, None]  # (Z, H, 1, V)
  x = m.x + jnp.einsum("...ck,...kv->...cv", m.y, read, precision=precision)
  new = m.a * state_pass.cut_off(m.cut, s) + jnp.einsum("...ck,...cv->...kv", m.left, x,
                                                         precision=precision)
  if m.u is not None:
    new = new + m.u
  return (new if spread is None else jnp.where(spread, jnp.nan, new)), x


def dense(m: LowRank, precision) -> state_pass.Maps:
  """The same maps as `(K, K)` matrices: S -> (A + L^T Y) S + (L^T X + U)."""
  dim = m.left.shape[-1]
  eye = jnp.eye(dim, dtype=m.left.dtype).reshape((1,) * (m.a.ndim - 2) + (dim, dim))
  product = lambda z: jnp.einsum("...ck,...cd->...kd", m.left, z, precision=precision)
  u = product(m.x)
  return state_pass.Maps(m.a * eye + product(m.y), u if m.u is None else u + m.u, m.cut)
