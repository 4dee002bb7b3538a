"""Multi-query associative recall (MQAR): key-value pairs, then queries of every key at random places."""

from __future__ import annotations

import numpy as np

from ssmkit._src.data.arguments import check_int
from ssmkit._src.data.dataset import SequenceDataset


def _first_of_random_order(rng: np.random.Generator, scores: np.ndarray, count: int) -> np.ndarray:
  """Per row, `count` distinct column indices drawn without replacement with probabilities
  proportional to exp(scores) (the Gumbel top-k trick: the largest `count` perturbed scores)."""
  perturbed = scores - np.log(-np.log(rng.random(scores.shape)))
  return np.argsort(-perturbed, axis=1)[:, :count]


def mqar(
    *,
    num_train: int = 100000,
    num_test: int = 1000,
    length: int = 64,
    num_pairs: int = 8,
    vocab_size: int = 64,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    seed: int = 0,
) -> SequenceDataset:
  """Multi-query associative recall: after the key-value pairs, recall the value of each queried key.

  Vocabulary: keys are 1 .. `vocab_size` // 2 - 1, values `vocab_size` // 2 .. `vocab_size` - 1;
  `num_classes = vocab_size`. A sequence of `length` steps starts with `num_pairs` pairs
  `k_1 v_1 k_2 v_2 ...` of distinct keys and distinct values, drawn uniformly. In the steps
  after them, every key appears once more, as a query, at an even offset 2 g from the end of
  the pairs; the slots g in [0, S) (S = (`length` - 2 `num_pairs`) // 2) are drawn without
  replacement with probability proportional to (g + 1)^(`power_a` - 1), a power law that
  favours queries soon after the pairs (`power_a` = 1: uniform). The target at a query is
  its key's value; every other target is -1 (no loss). The remaining steps hold tokens drawn
  uniformly from the whole vocabulary (`random_non_queries`) or 0.

  Args:
    num_train: number of training sequences, at least 1.
    num_test: number of test sequences, at least 1.
    length: number of steps, at least 4 * `num_pairs` (room for a query slot per key).
    num_pairs: number of key-value pairs (and queries) per sequence, at least 1.
    vocab_size: number of tokens, at least 2 * `num_pairs` + 2.
    power_a: exponent of the query placement law, in (0, 1].
    random_non_queries: fill the steps that are neither pairs nor queries with random tokens
      (True) or with 0.
    seed: seed of the generator, a non-negative int.

  Returns:
    A `SequenceDataset` with tokens `(N, length)` int32 and per-step targets `(N, length)`
    int32.

  Examples:
    >>> import numpy as np
    >>> from ssmkit.data import mqar
    >>> ds = mqar(num_train=2, num_test=1, length=16, num_pairs=2, vocab_size=12)
    >>> x, y = ds.x_train[0], ds.y_train[0]
    >>> pairs = dict(zip(x[0:4:2], x[1:4:2]))
    >>> asked = np.flatnonzero(y >= 0)
    >>> bool(len(asked) == 2 and all(y[t] == pairs[x[t]] for t in asked))
    True

  References:
    Arora et al., "Zoology: Measuring and improving recall in efficient language models",
    ICLR 2024 (arXiv:2312.04927), Sec. 3; the `multiquery_ar` generator of
    HazyResearch/zoology.
  """
  num_train = check_int(num_train, "num_train", minimum=1)
  num_test = check_int(num_test, "num_test", minimum=1)
  num_pairs = check_int(num_pairs, "num_pairs", minimum=1)
  length = check_int(length, "length", minimum=4 * num_pairs)
  vocab_size = check_int(vocab_size, "vocab_size", minimum=2 * num_pairs + 2)
  if isinstance(power_a, bool) or not isinstance(power_a, (int, float, np.integer, np.floating)):
    raise TypeError(f"`power_a` must be a float, got {power_a!r}.")
  if not 0 < power_a <= 1:
    raise ValueError(f"`power_a` must lie in (0, 1], got {power_a}.")
  if not isinstance(random_non_queries, (bool, np.bool_)):
    raise TypeError(f"`random_non_queries` must be a bool, got {random_non_queries!r}.")
  check_int(seed, "seed", minimum=0)

  rng = np.random.default_rng(seed)
  num = num_train + num_test
  half = vocab_size // 2
  context = 2 * num_pairs
  keys = 1 + _first_of_random_order(rng, np.zeros((num, half - 1)), num_pairs)
  values = half + _first_of_random_order(rng, np.zeros((num, vocab_size - half)), num_pairs)
  slots = (length - context) // 2
  law = (power_a - 1) * np.log(np.arange(1, slots + 1))
  queries = context + 2 * _first_of_random_order(rng, np.broadcast_to(law, (num, slots)), num_pairs)
  x = rng.integers(0, vocab_size, (num, length)) if random_non_queries else np.zeros((num, length), int)
  x[:, 0:context:2], x[:, 1:context:2] = keys, values
  np.put_along_axis(x, queries, keys, axis=1)
  y = np.full((num, length), -1)
  np.put_along_axis(y, queries, values, axis=1)
  x, y = x.astype(np.int32), y.astype(np.int32)
  return SequenceDataset.split(x, y, num_train, num_classes=vocab_size, vocab_size=vocab_size)
