"""Sequential and permuted 8x8 digits: scikit-learn's bundled digit images read pixel by pixel."""

from __future__ import annotations

import numpy as np

from ssmkit._src.data.arguments import check_fraction, check_int
from ssmkit._src.data.dataset import SequenceDataset

_NUM_CLASSES = 10
_NUM_PIXELS = 64
_MAX_INTENSITY = 16.0
# The permuted task is one fixed task: its pixel order does not depend on the split seed.
_PERMUTATION_SEED = 0


def sequential_digits(
    *, permuted: bool = False, test_fraction: float = 0.2, seed: int = 0
) -> SequenceDataset:
  """The 1797 8x8 handwritten digits as 64-step pixel sequences, one class per sequence.

  Each image of `sklearn.datasets.load_digits` (shipped with scikit-learn, no download) is read
  in raster order, row by row, and its intensities 0..16 are divided by 16. The split is
  stratified: in every class, `round(test_fraction * count)` images drawn with `seed` go to the
  test split; both splits are then shuffled. With `permuted`, the 64 steps of every sequence are
  reordered by one fixed permutation (drawn once from a constant seed, the same for every `seed`),
  the digits analogue of permuted MNIST; the split is the same as without `permuted`.

  Args:
    permuted: reorder the steps by the fixed permutation.
    test_fraction: fraction of each class in the test split, strictly between 0 and 1.
    seed: seed of the split, a non-negative int.

  Returns:
    A `SequenceDataset` with inputs `(N, 64, 1)` float32 in [0, 1] and labels `(N,)` int32 in
    [0, 10).

  Examples:
    >>> from ssmkit.data import sequential_digits
    >>> ds = sequential_digits(permuted=True)
    >>> ds.x_train.shape, ds.x_test.shape, ds.num_classes
    ((1438, 64, 1), (359, 64, 1), 10)

  References:
    Le, Jaitly & Hinton, "A Simple Way to Initialize Recurrent Networks of Rectified Linear
    Units", 2015 (arXiv:1504.00941); Alpaydin & Kaynak, "Optical Recognition of Handwritten
    Digits", UCI Machine Learning Repository, 1998.
  """
  check_fraction(test_fraction, "test_fraction")
  check_int(seed, "seed", minimum=0)
  # scikit-learn belongs to the optional `train` dependencies, so it is imported only when needed.
  from sklearn.datasets import load_digits

  digits = load_digits()
  x = (digits.images.reshape(-1, _NUM_PIXELS, 1) / _MAX_INTENSITY).astype(np.float32)
  y = digits.target.astype(np.int32)
  if permuted:
    x = x[:, np.random.default_rng(_PERMUTATION_SEED).permutation(_NUM_PIXELS)]
  rng = np.random.default_rng(seed)
  is_test = np.zeros(len(y), bool)
  for label in range(_NUM_CLASSES):
    members = rng.permutation(np.flatnonzero(y == label))
    is_test[members[: round(test_fraction * len(members))]] = True
  if is_test.all() or not is_test.any():
    raise ValueError(f"`test_fraction`={test_fraction} leaves an empty split of the {len(y)} digits.")
  train = rng.permutation(np.flatnonzero(~is_test))
  test = rng.permutation(np.flatnonzero(is_test))
  return SequenceDataset(
      x_train=x[train], y_train=y[train], x_test=x[test], y_test=y[test], num_classes=_NUM_CLASSES
  )
