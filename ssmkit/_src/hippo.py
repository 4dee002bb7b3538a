"""HiPPO matrices and the diagonal initialisations derived from them (S4D, S5).

Gu et al., "HiPPO: Recurrent memory with optimal polynomial projections", NeurIPS 2020;
Gu et al., "On the parameterization and initialization of diagonal state space models"
(S4D), NeurIPS 2022; Smith et al., "Simplified state space layers for sequence modeling"
(S5), ICLR 2023. Computed in float64 NumPy once, at initialisation.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def legs(n: int) -> tuple[np.ndarray, np.ndarray]:
  """The HiPPO-LegS state matrix A `(n, n)` and input vector B `(n,)`, float64.

  A[i, j] = -sqrt(2i + 1) sqrt(2j + 1) below the diagonal, -(i + 1) on it, 0 above;
  B[i] = sqrt(2i + 1).
  """
  _check_size(n)
  p = np.sqrt(2 * np.arange(n) + 1.0)
  a = -np.tril(np.outer(p, p), -1) - np.diag(np.arange(1.0, n + 1))
  return a, p


def legs_normal(n: int) -> tuple[np.ndarray, np.ndarray]:
  """HiPPO-N: the normal part S = A + P P^T of HiPPO-LegS, P[i] = sqrt(i + 1/2).

  S is -1/2 on the diagonal plus a skew-symmetric matrix, so it is normal and unitarily
  diagonalisable; A itself is not. Returns S `(n, n)` and the low-rank factor P `(n,)`.
  """
  a, _ = legs(n)
  p = np.sqrt(np.arange(n) + 0.5)
  return a + np.outer(p, p), p


class Diagonalized(NamedTuple):
  """HiPPO-N as S = V diag(eigenvalues) V^H.

  Attributes:
    eigenvalues: `(n,)` complex128, real parts -1/2.
    eigenvectors: `(n, n)` complex128 unitary V.
    b: `(n,)` complex128, the HiPPO-LegS input vector in the eigenbasis, V^H B.
  """

  eigenvalues: np.ndarray
  eigenvectors: np.ndarray
  b: np.ndarray


def legs_normal_diagonalized(n: int) -> Diagonalized:
  """Eigendecomposition of HiPPO-N, sorted by imaginary part (conjugate pairs adjacent).

  S = -1/2 I + K with K skew-symmetric, so K / i is Hermitian: `eigh` of it gives exact
  purely imaginary eigenvalues and a unitary basis; the real part is set to -1/2 exactly.
  """
  s, _ = legs_normal(n)
  _, b = legs(n)
  skew = s + 0.5 * np.eye(n)
  imag, v = np.linalg.eigh(-1j * skew)
  order = np.argsort(imag, kind="stable")
  imag, v = imag[order], v[:, order]
  eigenvalues = -0.5 + 1j * imag
  return Diagonalized(eigenvalues, v, v.conj().T @ b)


def s4d_lin(n: int) -> np.ndarray:
  """S4D-Lin eigenvalues -1/2 + i pi k, k = 0 .. n-1, complex128."""
  _check_size(n)
  return -0.5 + 1j * np.pi * np.arange(n)


def s4d_legs(n: int) -> tuple[np.ndarray, np.ndarray]:
  """S4D-LegS: the eigenvalues of HiPPO-N of size 2n with positive imaginary part, and B.

  Those of size 2n come in conjugate pairs (and the real layer keeps one of each pair), so
  n are returned, sorted by imaginary part, with the HiPPO-LegS input vector in the same
  eigenbasis (V^H B), both complex128.
  """
  _check_size(n)
  eigenvalues, _, b = legs_normal_diagonalized(2 * n)
  keep = eigenvalues.imag > 0
  return eigenvalues[keep], b[keep]


def _check_size(n: int) -> None:
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
    raise ValueError(f"the state size must be a positive int, got {n!r}.")
