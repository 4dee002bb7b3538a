"""MNIST-1D, generated offline from the `mnist1d` package's digit templates."""

from __future__ import annotations

import random

import numpy as np

from ssmkit._src.data.arguments import check_fraction, check_int
from ssmkit._src.data.dataset import SequenceDataset

_NUM_CLASSES = 10


def mnist1d(*, num_samples: int = 5000, train_split: float = 0.8, seed: int = 42) -> SequenceDataset:
  """MNIST-1D: 40-step noisy, shifted, sheared 1-D digit templates, one class per sequence.

  The data are generated offline by `mnist1d.data.make_dataset` with the package's default
  arguments except `num_samples`, `train_split` and `seed`; the defaults reproduce the published
  dataset's 4000 / 1000 split. `make_dataset` seeds NumPy's and Python's global random generators;
  both states are restored afterwards, so a call leaves the caller's global randomness untouched
  (not thread-safe: other threads drawing from the global generators meanwhile would see the seed).

  Args:
    num_samples: total number of sequences, at least 10; rounded down to a multiple of 10 (an
      equal number per digit).
    train_split: fraction of the sequences in the training split; both splits must be non-empty.
    seed: seed of the generator, an int in [0, 2**32).

  Returns:
    A `SequenceDataset` with inputs `(N, 40, 1)` float32 (standardised over the whole dataset)
    and labels `(N,)` int32 in [0, 10).

  Examples:
    >>> from ssmkit.data import mnist1d
    >>> ds = mnist1d(num_samples=100)
    >>> ds.x_train.shape, ds.x_test.shape, ds.num_classes
    ((80, 40, 1), (20, 40, 1), 10)

  References:
    Greydanus & Kobak, "Scaling Down Deep Learning with MNIST-1D", ICML 2024 (arXiv:2011.14439).
  """
  check_int(num_samples, "num_samples", minimum=_NUM_CLASSES)
  check_fraction(train_split, "train_split")
  check_int(seed, "seed", minimum=0)
  total = num_samples // _NUM_CLASSES * _NUM_CLASSES
  if not 0 < int(total * train_split) < total:
    raise ValueError(
        f"`train_split`={train_split} leaves an empty split of the {total} sequences of `num_samples`."
    )
  # `mnist1d` belongs to the optional `train` dependencies, so it is imported only when needed.
  from mnist1d.data import get_dataset_args, make_dataset

  args = get_dataset_args()
  args.num_samples, args.train_split, args.seed = num_samples, train_split, seed
  numpy_state, python_state = np.random.get_state(), random.getstate()
  try:
    data = make_dataset(args)
  finally:
    np.random.set_state(numpy_state)
    random.setstate(python_state)
  return SequenceDataset(
      x_train=data["x"].astype(np.float32)[..., None],
      y_train=data["y"].astype(np.int32),
      x_test=data["x_test"].astype(np.float32)[..., None],
      y_test=data["y_test"].astype(np.int32),
      num_classes=_NUM_CLASSES,
  )
