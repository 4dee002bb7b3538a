"""Selective copying: recall the data tokens scattered among blanks, in order, after the blanks end."""

from __future__ import annotations

import numpy as np

from ssmkit._src.data.arguments import check_int
from ssmkit._src.data.dataset import SequenceDataset

_BLANK = 0
_MARKER = 1
_FIRST_DATA_TOKEN = 2


def selective_copying(
    *,
    num_train: int = 10000,
    num_test: int = 1000,
    length: int = 256,
    num_tokens: int = 8,
    num_data_tokens: int = 8,
    seed: int = 0,
) -> SequenceDataset:
  """Selective copying: copy the data tokens out of a noisy sequence, skipping the blanks.

  Vocabulary: 0 = blank (the noise token), 1 = marker, 2 .. `num_data_tokens` + 1 = data tokens;
  `vocab_size = num_classes = num_data_tokens + 2`. A sequence has `length + num_tokens` steps:
  the first `length` steps are blank except for `num_tokens` data tokens, drawn uniformly (with
  repetition) and placed at distinct uniformly random positions; the last `num_tokens` steps are
  markers. The target at the i-th marker is the i-th data token in order of appearance; every other
  target is -1 (no loss). The spacing of the data tokens varies from sequence to sequence, which
  defeats models whose dynamics do not depend on the input (time-invariant convolutions).

  Args:
    num_train: number of training sequences, at least 1.
    num_test: number of test sequences, at least 1.
    length: number of steps before the markers, at least `num_tokens`.
    num_tokens: number of data tokens to copy, at least 1.
    num_data_tokens: number of distinct data tokens, at least 1.
    seed: seed of the generator, a non-negative int.

  Returns:
    A `SequenceDataset` with tokens `(N, length + num_tokens)` int32 and per-step targets
    `(N, length + num_tokens)` int32.

  Examples:
    >>> from ssmkit.data import selective_copying
    >>> ds = selective_copying(num_train=1, num_test=1, length=6, num_tokens=2, num_data_tokens=3)
    >>> ds.x_train.shape, ds.vocab_size, ds.num_classes
    ((1, 8), 5, 5)
    >>> x, y = ds.x_train[0], ds.y_train[0]
    >>> bool((y[-2:] == x[x >= 2]).all() and (y[:-2] == -1).all())
    True

  References:
    Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023
    (arXiv:2312.00752), Sec. 3.1 and 4.1.1, Fig. 2.
  """
  num_train = check_int(num_train, "num_train", minimum=1)
  num_test = check_int(num_test, "num_test", minimum=1)
  num_tokens = check_int(num_tokens, "num_tokens", minimum=1)
  length = check_int(length, "length", minimum=1)
  if num_tokens > length:
    raise ValueError(f"`num_tokens`={num_tokens} must be <= `length`={length}.")
  num_data_tokens = check_int(num_data_tokens, "num_data_tokens", minimum=1)
  check_int(seed, "seed", minimum=0)

  rng = np.random.default_rng(seed)
  num = num_train + num_test
  # The first `num_tokens` of a uniformly random ordering are distinct uniform positions.
  positions = np.sort(np.argsort(rng.random((num, length)), axis=1)[:, :num_tokens], axis=1)
  vocab_size = num_data_tokens + _FIRST_DATA_TOKEN
  data = rng.integers(_FIRST_DATA_TOKEN, vocab_size, (num, num_tokens), np.int32)
  x = np.full((num, length + num_tokens), _BLANK, np.int32)
  np.put_along_axis(x, positions, data, axis=1)
  x[:, length:] = _MARKER
  y = np.full_like(x, -1)
  y[:, length:] = data
  return SequenceDataset.split(x, y, num_train, num_classes=vocab_size, vocab_size=vocab_size)
