"""Induction heads: after a special token reappears, recall the token that followed it the first time."""

from __future__ import annotations

import numpy as np

from ssmkit._src.data.arguments import check_int
from ssmkit._src.data.dataset import SequenceDataset

_SPECIAL = 0


def induction_heads(
    *,
    num_train: int = 10000,
    num_test: int = 1000,
    length: int = 256,
    vocab_size: int = 16,
    seed: int = 0,
) -> SequenceDataset:
  """Induction heads: predict the token that followed the first occurrence of a special token.

  Vocabulary: 0 = the special token, 1 .. `vocab_size` - 1 = ordinary tokens;
  `num_classes = vocab_size`. A sequence has `length` steps of ordinary tokens drawn uniformly,
  except that step `p`, uniform in [0, length - 3], and the last step `length - 1` hold the special
  token, so it occurs exactly twice and the token at `p + 1` is ordinary. The target at the last
  step is the token at `p + 1`; every other target is -1 (no loss).

  Args:
    num_train: number of training sequences, at least 1.
    num_test: number of test sequences, at least 1.
    length: number of steps, at least 3.
    vocab_size: number of tokens, the special one included, at least 2.
    seed: seed of the generator, a non-negative int.

  Returns:
    A `SequenceDataset` with tokens `(N, length)` int32 and per-step targets `(N, length)` int32.

  Examples:
    >>> import numpy as np
    >>> from ssmkit.data import induction_heads
    >>> ds = induction_heads(num_train=2, num_test=1, length=10, vocab_size=4)
    >>> x, y = ds.x_train[0], ds.y_train[0]
    >>> first = np.flatnonzero(x == 0)[0]
    >>> bool(x[-1] == 0 and y[-1] == x[first + 1] and (y[:-1] == -1).all())
    True

  References:
    Olsson et al., "In-context Learning and Induction Heads", 2022 (arXiv:2209.11895); Gu & Dao,
    "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023 (arXiv:2312.00752),
    Sec. 4.1.2.
  """
  num_train = check_int(num_train, "num_train", minimum=1)
  num_test = check_int(num_test, "num_test", minimum=1)
  length = check_int(length, "length", minimum=3)
  vocab_size = check_int(vocab_size, "vocab_size", minimum=2)
  check_int(seed, "seed", minimum=0)

  rng = np.random.default_rng(seed)
  num = num_train + num_test
  x = rng.integers(_SPECIAL + 1, vocab_size, (num, length), np.int32)
  rows = np.arange(num)
  first = rng.integers(0, length - 2, num)
  x[rows, first] = _SPECIAL
  x[:, -1] = _SPECIAL
  y = np.full_like(x, -1)
  y[:, -1] = x[rows, first + 1]
  return SequenceDataset.split(x, y, num_train, num_classes=vocab_size, vocab_size=vocab_size)
