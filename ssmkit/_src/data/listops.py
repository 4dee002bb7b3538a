"""ListOps: evaluate nested prefix expressions of MAX, MIN, MED and SM over the digits 0-9."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ssmkit._src.data.arguments import check_int
from ssmkit._src.data.dataset import SequenceDataset

_PAD = 0
_FIRST_DIGIT = 1
_OPEN = 11
_CLOSE = 12
_FIRST_OPERATOR = 13
_VOCAB_SIZE = 17
_NUM_CLASSES = 10
# Long Range Arena's generator makes an argument a nested expression with probability 0.25.
_NESTING_PROBABILITY = 0.25
_SHORTEST_EXPRESSION = 5  # [ MAX 0 1 ]


def _median(values: list[int]) -> int:
  """`int(np.median(values))`, as in Long Range Arena: an even count floors the middle pair's mean."""
  ordered = sorted(values)
  return (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) // 2


# In token order from `_FIRST_OPERATOR`: MAX, MIN, MED, SM.
_OPERATORS = (max, min, _median, lambda values: sum(values) % 10)


class _TooLong(Exception):
  """An expression has outgrown `max_length`: it is discarded as soon as that is known."""


class _ExpressionSampler:
  """Draws expressions no longer than `max_length` tokens, with their values."""

  def __init__(self, rng: np.random.Generator, max_depth: int, max_args: int, max_length: int):
    self._uniforms = self._blocks_of_uniforms(rng)
    self._max_depth = max_depth
    self._max_args = max_args
    self._max_length = max_length

  @staticmethod
  def _blocks_of_uniforms(rng: np.random.Generator) -> Iterator[float]:
    # One generator call per draw would take most of the time: draw uniforms in blocks instead.
    while True:
      yield from rng.random(4096).tolist()

  def _integer(self, n: int) -> int:
    """A uniform integer in [0, n)."""
    return int(next(self._uniforms) * n)

  def sample(self) -> tuple[list[int], int]:
    """Returns the tokens of a random expression and its value."""
    while True:
      tokens: list[int] = []
      try:
        value = self._expression(1, tokens)
      except _TooLong:
        continue
      return tokens, value

  def _expression(self, depth: int, tokens: list[int]) -> int:
    """Appends the tokens of a random expression at nesting `depth` to `tokens`; returns its value."""
    operator = self._integer(len(_OPERATORS))
    tokens += [_OPEN, _FIRST_OPERATOR + operator]
    values = []
    for _ in range(2 + self._integer(self._max_args - 1)):
      if depth < self._max_depth and next(self._uniforms) < _NESTING_PROBABILITY:
        values.append(self._expression(depth + 1, tokens))
      else:
        digit = self._integer(10)
        tokens.append(_FIRST_DIGIT + digit)
        values.append(digit)
      if len(tokens) >= self._max_length:  # the closing `]` is still to come
        raise _TooLong
    tokens.append(_CLOSE)
    return _OPERATORS[operator](values)


def listops(
    *,
    num_train: int = 2000,
    num_test: int = 500,
    max_depth: int = 4,
    max_args: int = 5,
    max_length: int = 256,
    seed: int = 0,
) -> SequenceDataset:
  """ListOps: the value 0-9 of a nested prefix expression, one class per sequence.

  An expression is `[ OP a_1 ... a_k ]` with k uniform in [2, max_args], OP uniform among MAX,
  MIN, MED (median; for an even k the floor of the mean of the two middle values, as
  `int(np.median(...))` in Long Range Arena) and SM (sum modulo 10), and each argument a nested
  expression with probability 0.25 (while the nesting depth stays <= `max_depth`, the outermost
  expression being at depth 1) or else a uniform digit. Expressions longer than `max_length`
  tokens are discarded and drawn again. Sequences are padded at the end to `max_length`.

  Vocabulary (`vocab_size = 17`): 0 = padding, 1-10 = digits 0-9 (token = digit + 1), 11 = `[`,
  12 = `]`, 13 = MAX, 14 = MIN, 15 = MED, 16 = SM. For example, `[ SM 3 [ MAX 1 4 ] 5 ]` has
  value 2 and reads 11 16 4 11 13 2 5 12 6 12.

  Args:
    num_train: number of training sequences, at least 1.
    num_test: number of test sequences, at least 1.
    max_depth: the deepest nesting of operators, at least 1 (1 = a single operator over digits).
    max_args: the most arguments of one operator, at least 2.
    max_length: the padded sequence length, at least 5 (the length of `[ MAX 0 1 ]`).
    seed: seed of the generator, a non-negative int.

  Returns:
    A `SequenceDataset` with tokens `(N, max_length)` int32, labels `(N,)` int32 in [0, 10) and
    masks `(N, max_length)` bool that are True on the expression's tokens.

  Examples:
    >>> from ssmkit.data import listops
    >>> ds = listops(num_train=3, num_test=2, max_depth=1, max_args=2, max_length=8)
    >>> ds.x_train.shape, ds.vocab_size, ds.num_classes
    ((3, 8), 17, 10)
    >>> ds.mask_train.sum(axis=1).tolist()  # a single operator over two digits
    [5, 5, 5]

  References:
    Nangia & Bowman, "ListOps: A Diagnostic Dataset for Latent Tree Learning", 2018
    (arXiv:1804.06028); Tay et al., "Long Range Arena: A Benchmark for Efficient Transformers",
    2021 (arXiv:2011.04006).
  """
  num_train = check_int(num_train, "num_train", minimum=1)
  num_test = check_int(num_test, "num_test", minimum=1)
  max_depth = check_int(max_depth, "max_depth", minimum=1)
  max_args = check_int(max_args, "max_args", minimum=2)
  max_length = check_int(max_length, "max_length", minimum=_SHORTEST_EXPRESSION)
  check_int(seed, "seed", minimum=0)

  sampler = _ExpressionSampler(np.random.default_rng(seed), max_depth, max_args, max_length)
  num = num_train + num_test
  x = np.full((num, max_length), _PAD, np.int32)
  y = np.empty(num, np.int32)
  for i in range(num):
    tokens, y[i] = sampler.sample()
    x[i, : len(tokens)] = tokens
  return SequenceDataset.split(x, y, num_train, num_classes=_NUM_CLASSES, vocab_size=_VOCAB_SIZE,
                               mask=x != _PAD)
