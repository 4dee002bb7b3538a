"""`ssmkit.data`: every dataset read back by an independent decoder of its documented layout."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mnist1d.data import get_dataset_args, make_dataset
from sklearn.datasets import load_digits

from ssmkit import data
from ssmkit.data import SequenceDataset

# Small arguments of every dataset, for the tests that run over all of them.
SMALL = {
    "induction_heads": {"num_train": 12, "num_test": 5, "length": 17},
    "listops": {"num_train": 12, "num_test": 5, "max_length": 40},
    "mnist1d": {"num_samples": 60},
    "mqar": {"num_train": 12, "num_test": 5, "length": 20, "num_pairs": 3, "vocab_size": 10},
    "selective_copying": {"num_train": 12, "num_test": 5, "length": 19, "num_tokens": 4},
    "sequential_digits": {},
}
# Documented vocabularies.
BLANK, MARKER, FIRST_DATA_TOKEN = 0, 1, 2
SPECIAL = 0
LISTOPS_SYMBOLS = {0: "PAD", **{d + 1: d for d in range(10)}, 11: "[", 12: "]", 13: "MAX", 14: "MIN",
                   15: "MED", 16: "SM"}


def _arrays(ds: SequenceDataset) -> list[np.ndarray | None]:
  return [ds.x_train, ds.y_train, ds.x_test, ds.y_test, ds.mask_train, ds.mask_test]


def _assert_same(a: SequenceDataset, b: SequenceDataset) -> None:
  for x, y in zip(_arrays(a), _arrays(b), strict=True):
    if x is None:
      assert y is None
    else:
      np.testing.assert_array_equal(x, y)
  assert (a.num_classes, a.vocab_size) == (b.num_classes, b.vocab_size)


# Contract shared by every dataset.


@pytest.mark.parametrize("name", sorted(SMALL))
def test_same_seed_same_data_whatever_ran_before(name: str):
  first = data.load(name, seed=3, **SMALL[name])
  np.random.seed(0)
  random.seed(0)
  np.random.random(5)
  data.load(name, seed=4, **SMALL[name])
  _assert_same(first, data.load(name, seed=3, **SMALL[name]))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_different_seeds_give_different_data(name: str):
  a, b = (data.load(name, seed=seed, **SMALL[name]) for seed in (1, 2))
  assert a.x_train.shape == b.x_train.shape
  assert not np.array_equal(a.x_train, b.x_train)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_split_sizes_dtypes_and_target_ranges(name: str):
  ds = data.load(name, **SMALL[name])
  if "num_train" in SMALL[name]:
    assert (ds.num_train, ds.num_test) == (SMALL[name]["num_train"], SMALL[name]["num_test"])
  tokens = ds.vocab_size is not None
  for x, y in ((ds.x_train, ds.y_train), (ds.x_test, ds.y_test)):
    assert x.dtype == (np.int32 if tokens else np.float32)
    assert x.ndim == (2 if tokens else 3)
    assert y.dtype == np.int32
    assert y.shape == (x.shape[:2] if ds.per_step else x.shape[:1])
    assert y.min() >= (-1 if ds.per_step else 0) and y.max() < ds.num_classes
    if tokens:
      assert x.min() >= 0 and x.max() < ds.vocab_size
  assert ds.sequence_length == ds.x_train.shape[1] == ds.x_test.shape[1]


# MNIST-1D.


def test_mnist1d_default_is_the_published_4000_1000_split_of_40_steps():
  ds = data.mnist1d()
  assert ds.x_train.shape == (4000, 40, 1) and ds.x_test.shape == (1000, 40, 1)
  assert ds.num_classes == 10 and ds.num_features == 1 and not ds.per_step
  labels = np.concatenate([ds.y_train, ds.y_test])
  np.testing.assert_array_equal(np.bincount(labels, minlength=10), np.full(10, 500))
  # make_dataset standardises the whole dataset; float32 storage explains the tolerance.
  inputs = np.concatenate([ds.x_train, ds.x_test]).astype(np.float64)
  np.testing.assert_allclose([inputs.mean(), inputs.std()], [0.0, 1.0], atol=1e-5)


def test_mnist1d_matches_the_package_generator_with_the_same_arguments():
  ds = data.mnist1d(num_samples=200, train_split=0.75, seed=5)
  args = get_dataset_args()
  args.num_samples, args.train_split, args.seed = 200, 0.75, 5
  reference = make_dataset(args)
  np.testing.assert_array_equal(ds.x_train[..., 0], reference["x"].astype(np.float32))
  np.testing.assert_array_equal(ds.x_test[..., 0], reference["x_test"].astype(np.float32))
  np.testing.assert_array_equal(ds.y_train, reference["y"])
  np.testing.assert_array_equal(ds.y_test, reference["y_test"])


def test_mnist1d_leaves_the_global_random_generators_untouched():
  np.random.seed(11)
  random.seed(11)
  expected = (np.random.random(3), random.random())
  np.random.seed(11)
  random.seed(11)
  data.mnist1d(num_samples=30)
  np.testing.assert_array_equal(np.random.random(3), expected[0])
  assert random.random() == expected[1]


# Sequential and permuted digits.


def _pixel_rows(ds: SequenceDataset) -> tuple[np.ndarray, np.ndarray]:
  """Un-scales every sequence back to the 0..16 intensities of a flattened image, train then test."""
  x = np.concatenate([ds.x_train, ds.x_test])[..., 0] * 16
  np.testing.assert_array_equal(x, np.round(x))  # k / 16 is exact in float32
  return x.astype(np.int64), np.concatenate([ds.y_train, ds.y_test])


def _sorted_pairs(images: np.ndarray, labels: np.ndarray) -> list[tuple[bytes, int]]:
  return sorted((row.tobytes(), int(label)) for row, label in zip(images, labels, strict=True))


@pytest.mark.parametrize("seed", [0, 7])
def test_digit_sequences_are_the_sklearn_images_read_row_by_row(seed: int):
  ds = data.sequential_digits(seed=seed)
  digits = load_digits()
  assert ds.x_train.shape[1:] == (64, 1) and ds.num_classes == 10
  assert ds.x_train.min() >= 0 and ds.x_train.max() <= 1
  rows, labels = _pixel_rows(ds)
  # Train and test together hold every (image, label) pair of scikit-learn exactly once.
  images = digits.images.reshape(len(digits.images), 64).astype(np.int64)
  assert _sorted_pairs(rows, labels) == _sorted_pairs(images, digits.target)


@pytest.mark.parametrize("test_fraction", [0.2, 0.37])
def test_digit_split_is_stratified(test_fraction: float):
  ds = data.sequential_digits(test_fraction=test_fraction, seed=2)
  per_class = np.bincount(load_digits().target)
  test_per_class = np.bincount(ds.y_test, minlength=10)
  assert np.all(np.abs(test_per_class - test_fraction * per_class) <= 0.5)
  np.testing.assert_array_equal(np.bincount(ds.y_train, minlength=10) + test_per_class, per_class)


def _column_permutation(plain: np.ndarray, permuted: np.ndarray) -> np.ndarray:
  """Returns `perm` with `permuted[:, j] == plain[:, perm[j]]`, matching identical columns in order."""
  perm = []
  for j in range(permuted.shape[1]):
    matches = [k for k in range(plain.shape[1]) if np.array_equal(plain[:, k], permuted[:, j])]
    free = [k for k in matches if k not in perm]
    assert free, f"column {j} of the permuted sequences is no column of the plain ones"
    perm.append(free[0])
  return np.array(perm)


def test_permuted_digits_reorder_every_sequence_by_one_fixed_permutation():
  plain, permuted = (
      np.concatenate([ds.x_train, ds.x_test])[..., 0]
      for ds in (data.sequential_digits(seed=0), data.sequential_digits(permuted=True, seed=0))
  )
  perm = _column_permutation(plain, permuted)
  np.testing.assert_array_equal(np.sort(perm), np.arange(64))
  assert not np.array_equal(perm, np.arange(64))
  # The permutation does not depend on the split seed, and the split does not depend on `permuted`.
  other_plain = data.sequential_digits(seed=9)
  other_permuted = data.sequential_digits(permuted=True, seed=9)
  np.testing.assert_array_equal(other_permuted.y_train, other_plain.y_train)
  np.testing.assert_array_equal(other_permuted.x_train, other_plain.x_train[:, perm])
  np.testing.assert_array_equal(other_permuted.x_test, other_plain.x_test[:, perm])


# Selective copying.


def _check_selective_copying(ds: SequenceDataset, length: int, num_tokens: int, num_data_tokens: int):
  assert ds.vocab_size == ds.num_classes == num_data_tokens + 2 and ds.per_step
  for x, y in zip(np.concatenate([ds.x_train, ds.x_test]), np.concatenate([ds.y_train, ds.y_test]),
                  strict=True):
    assert len(x) == len(y) == length + num_tokens
    copied = []
    for t in range(length):
      assert x[t] != MARKER and y[t] == -1
      if x[t] != BLANK:
        assert FIRST_DATA_TOKEN <= x[t] < FIRST_DATA_TOKEN + num_data_tokens
        copied.append(x[t])
    assert len(copied) == num_tokens
    for i in range(num_tokens):
      assert x[length + i] == MARKER and y[length + i] == copied[i]


def test_selective_copying_targets_are_the_data_tokens_in_order():
  ds = data.selective_copying(num_train=30, num_test=10, length=64, num_tokens=8, num_data_tokens=5)
  _check_selective_copying(ds, 64, 8, 5)


@settings(max_examples=30, deadline=None)
@given(
    length=st.sampled_from([1, 2, 3, 7, 13, 31]),
    token_fraction=st.floats(0, 1),
    num_data_tokens=st.sampled_from([1, 2, 5]),
    seed=st.integers(0, 2**16),
)
def test_selective_copying_sizes_sweep(
    length: int, token_fraction: float, num_data_tokens: int, seed: int
):
  num_tokens = max(1, round(token_fraction * length))
  ds = data.selective_copying(num_train=4, num_test=3, length=length, num_tokens=num_tokens,
                              num_data_tokens=num_data_tokens, seed=seed)
  _check_selective_copying(ds, length, num_tokens, num_data_tokens)


def test_selective_copying_positions_vary_between_sequences():
  ds = data.selective_copying(num_train=50, num_test=1, length=32, num_tokens=4)
  assert len({tuple(np.flatnonzero(x[:32])) for x in ds.x_train}) > 1


# Induction heads.


def _check_induction_heads(ds: SequenceDataset, length: int, vocab_size: int):
  assert ds.vocab_size == ds.num_classes == vocab_size and ds.per_step
  for x, y in zip(np.concatenate([ds.x_train, ds.x_test]), np.concatenate([ds.y_train, ds.y_test]),
                  strict=True):
    assert len(x) == length
    first = next(t for t in range(length) if x[t] == SPECIAL)
    assert first + 1 < length - 1 and x[first + 1] != SPECIAL
    assert x[-1] == SPECIAL and sum(token == SPECIAL for token in x) == 2
    assert y[-1] == x[first + 1]
    assert all(target == -1 for target in y[:-1])


def test_induction_heads_last_target_follows_the_first_special_token():
  _check_induction_heads(data.induction_heads(num_train=40, num_test=10, length=64), 64, 16)


@settings(max_examples=30, deadline=None)
@given(
    length=st.sampled_from([3, 4, 5, 7, 13, 97]),
    vocab_size=st.sampled_from([2, 3, 16]),
    seed=st.integers(0, 2**16),
)
def test_induction_heads_sizes_sweep(length: int, vocab_size: int, seed: int):
  ds = data.induction_heads(num_train=4, num_test=3, length=length, vocab_size=vocab_size, seed=seed)
  _check_induction_heads(ds, length, vocab_size)


# Multi-query associative recall.


def _check_mqar(ds: SequenceDataset, length: int, num_pairs: int, vocab_size: int,
                random_non_queries: bool = True):
  assert ds.vocab_size == ds.num_classes == vocab_size and ds.per_step
  half, context = vocab_size // 2, 2 * num_pairs
  for x, y in zip(np.concatenate([ds.x_train, ds.x_test]), np.concatenate([ds.y_train, ds.y_test]),
                  strict=True):
    assert len(x) == length
    keys, values = list(x[0:context:2]), list(x[1:context:2])
    assert len(set(keys)) == len(set(values)) == num_pairs
    assert all(1 <= k < half for k in keys) and all(half <= v < vocab_size for v in values)
    asked = [t for t in range(length) if y[t] != -1]
    assert all(t >= context and (t - context) % 2 == 0 for t in asked)
    assert sorted(x[t] for t in asked) == sorted(keys)
    assert all(y[t] == values[keys.index(x[t])] for t in asked)
    if not random_non_queries:
      assert all(x[t] == 0 for t in range(context, length) if y[t] == -1)


def test_mqar_queries_every_key_once_for_its_value():
  _check_mqar(data.mqar(num_train=40, num_test=10, length=64, num_pairs=8, vocab_size=64), 64, 8, 64)


@settings(max_examples=30, deadline=None)
@given(
    num_pairs=st.sampled_from([1, 2, 3, 7]),
    extra_length=st.sampled_from([0, 1, 2, 5, 13]),
    extra_vocab=st.sampled_from([0, 1, 3, 40]),
    random_non_queries=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_mqar_sizes_sweep(num_pairs: int, extra_length: int, extra_vocab: int,
                          random_non_queries: bool, seed: int):
  length, vocab_size = 4 * num_pairs + extra_length, 2 * num_pairs + 2 + extra_vocab
  ds = data.mqar(num_train=4, num_test=3, length=length, num_pairs=num_pairs, vocab_size=vocab_size,
                 random_non_queries=random_non_queries, power_a=0.5, seed=seed)
  _check_mqar(ds, length, num_pairs, vocab_size, random_non_queries)


@pytest.mark.parametrize("power_a", [0.01, 0.3, 1.0])
def test_mqar_query_places_follow_the_power_law(power_a: float):
  """With one pair, the query's slot g has probability proportional to (g + 1)^(power_a - 1)."""
  slots = 6
  ds = data.mqar(num_train=20000, num_test=1, length=2 + 2 * slots, num_pairs=1, vocab_size=8,
                 power_a=power_a, seed=5)
  g = (np.argmax(ds.y_train >= 0, axis=1) - 2) // 2
  counts = np.bincount(g, minlength=slots)
  p = np.arange(1, slots + 1) ** (power_a - 1.0)
  p /= p.sum()
  # Each count is within 5 binomial standard deviations of its expectation.
  np.testing.assert_array_less(np.abs(counts - 20000 * p), 5 * np.sqrt(20000 * p * (1 - p)))


# ListOps.


def _evaluate(symbols: list, max_depth: int, max_args: int) -> int:
  """Parses and evaluates a whole prefix expression, checking its nesting and argument counts."""
  position = 0

  def expression(depth: int) -> int:
    nonlocal position
    assert symbols[position] == "[" and depth <= max_depth
    operator = symbols[position + 1]
    position += 2
    args = []
    while symbols[position] != "]":
      if symbols[position] == "[":
        args.append(expression(depth + 1))
      else:
        assert isinstance(symbols[position], int)
        args.append(symbols[position])
        position += 1
    position += 1
    assert 2 <= len(args) <= max_args
    return {"MAX": max, "MIN": min, "MED": lambda a: int(np.median(a)), "SM": lambda a: sum(a) % 10}[
        operator](args)

  value = expression(1)
  assert position == len(symbols)
  return value


def _check_listops(ds: SequenceDataset, max_depth: int, max_args: int, max_length: int):
  assert ds.vocab_size == 17 and ds.num_classes == 10 and not ds.per_step
  for x, y, mask in (
      (ds.x_train, ds.y_train, ds.mask_train),
      (ds.x_test, ds.y_test, ds.mask_test),
  ):
    assert x.shape[1] == max_length
    for tokens, label, real in zip(x, y, mask, strict=True):
      size = int(np.sum(tokens != 0))
      np.testing.assert_array_equal(real, np.arange(max_length) < size)
      assert np.all(tokens[size:] == 0)
      assert label == _evaluate([LISTOPS_SYMBOLS[t] for t in tokens[:size]], max_depth, max_args)


def test_listops_labels_are_the_values_of_the_expressions():
  ds = data.listops(num_train=60, num_test=20, max_depth=3, max_args=5, max_length=128)
  _check_listops(ds, 3, 5, 128)
  depths = [np.max(np.cumsum((x == 11).astype(int) - (x == 12))) for x in ds.x_train]
  assert max(depths) > 1  # nested expressions occur
  assert len(np.unique(ds.y_train)) > 3


@settings(max_examples=30, deadline=None)
@given(
    max_depth=st.sampled_from([1, 2, 3]),
    max_args=st.sampled_from([2, 3, 7]),
    max_length=st.sampled_from([5, 7, 13, 64]),
    seed=st.integers(0, 2**16),
)
def test_listops_sizes_sweep(max_depth: int, max_args: int, max_length: int, seed: int):
  ds = data.listops(num_train=4, num_test=3, max_depth=max_depth, max_args=max_args,
                    max_length=max_length, seed=seed)
  _check_listops(ds, max_depth, max_args, max_length)


def test_listops_median_of_an_even_count_floors_the_mean_of_the_middle_pair():
  ds = data.listops(num_train=300, num_test=1, max_depth=1, max_args=4, max_length=8)
  med = [(tokens, label) for tokens, label in zip(ds.x_train, ds.y_train, strict=True)
         if tokens[1] == 15 and np.sum(tokens != 0) == 7]
  assert med, "no MED over four digits among the samples"
  for tokens, label in med:
    middle_pair = sorted(tokens[2:6] - 1)[1:3]
    assert label == sum(middle_pair) // 2


# Registry.


@pytest.mark.parametrize("name", sorted(SMALL))
def test_load_builds_the_dataset_of_that_name(name: str):
  _assert_same(data.load(name, **SMALL[name]), getattr(data, name)(**SMALL[name]))


def test_load_rejects_unknown_names_and_keywords():
  with pytest.raises(ValueError, match=r"'mnist'.*induction_heads.*listops.*mnist1d"):
    data.load("mnist")
  with pytest.raises(TypeError, match=r"'selective_copying'.*'lenght'"):
    data.load("selective_copying", lenght=10)


# Argument and field checks.


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: data.mnist1d(num_samples=9), "num_samples"),
        (lambda: data.mnist1d(train_split=1.0), "train_split"),
        (lambda: data.mnist1d(num_samples=10, train_split=0.05), "train_split"),
        (lambda: data.sequential_digits(test_fraction=0.0), "test_fraction"),
        (lambda: data.sequential_digits(test_fraction=0.001), "test_fraction"),
        (lambda: data.selective_copying(length=3, num_tokens=4), "num_tokens"),
        (lambda: data.selective_copying(length=0), "length"),
        (lambda: data.selective_copying(num_data_tokens=0), "num_data_tokens"),
        (lambda: data.selective_copying(num_train=0), "num_train"),
        (lambda: data.induction_heads(length=2), "length"),
        (lambda: data.induction_heads(vocab_size=1), "vocab_size"),
        (lambda: data.induction_heads(num_test=0), "num_test"),
        (lambda: data.mqar(length=15, num_pairs=4), "length"),
        (lambda: data.mqar(vocab_size=9, num_pairs=4), "vocab_size"),
        (lambda: data.mqar(num_pairs=0), "num_pairs"),
        (lambda: data.mqar(power_a=0.0), "power_a"),
        (lambda: data.listops(max_length=4), "max_length"),
        (lambda: data.listops(max_args=1), "max_args"),
        (lambda: data.listops(max_depth=0), "max_depth"),
        (lambda: data.load("listops", seed=-1), "seed"),
    ],
)
def test_bad_sizes_raise_naming_the_argument(call: Callable[[], object], match: str):
  with pytest.raises(ValueError, match=match):
    call()


def _tokens(**changes: object) -> SequenceDataset:
  """A valid per-step token dataset of 2 + 1 sequences of 4 steps, with `changes` applied."""
  fields = {
      "x_train": np.array([[1, 2, 3, 0], [3, 0, 0, 0]], np.int32),
      "y_train": np.array([[-1, -1, 2, -1], [1, -1, -1, -1]], np.int32),
      "x_test": np.array([[2, 2, 0, 0]], np.int32),
      "y_test": np.array([[-1, 0, -1, -1]], np.int32),
      "num_classes": 3,
      "vocab_size": 4,
      "mask_train": np.array([[True, True, True, False], [True, False, False, False]]),
      "mask_test": None,
  }
  return SequenceDataset(**{**fields, **changes})


def test_sequence_dataset_properties_and_immutability():
  ds = _tokens()
  assert ds.per_step and ds.sequence_length == 4 and ds.num_features is None
  assert (ds.num_train, ds.num_test) == (2, 1)
  with pytest.raises(dataclasses.FrozenInstanceError):
    ds.num_classes = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"x_train": np.zeros((2, 4), np.int64)}, "x_train"),
        ({"x_test": np.array([[4, 0, 0, 0]], np.int32)}, "x_test"),
        ({"x_test": np.zeros((1, 5), np.int32), "y_test": np.zeros((1, 5), np.int32)}, "x_test"),
        ({"vocab_size": None}, "x_train"),
        ({"y_train": np.zeros((2, 3), np.int32)}, "y_train"),
        ({"y_test": np.zeros(1, np.int32)}, "y_test"),
        ({"y_test": np.array([[-1, 3, -1, -1]], np.int32)}, "y_test"),
        ({"num_classes": 0}, "num_classes"),
        ({"mask_test": np.array([[True, False, True, False]])}, "mask_test"),
        ({"mask_test": np.array([[False, False, False, False]])}, "mask_test"),
        ({"mask_test": np.ones((1, 4), np.int32)}, "mask_test"),
        ({"mask_train": np.array([[True, True, False, False], [True, False, False, False]])}, "y_train"),
        ({"x_train": [[1, 2, 3, 0], [3, 0, 0, 0]]}, "x_train"),
        ({"reset_train": np.zeros((2, 3), bool)}, "reset_train"),
        ({"reset_test": np.zeros((1, 4), np.int32)}, "reset_test"),
        ({"reset_test": [[True, False, False, False]]}, "reset_test"),
    ],
)
def test_sequence_dataset_rejects_inconsistent_fields_naming_them(changes: dict, match: str):
  with pytest.raises((ValueError, TypeError), match=match):
    _tokens(**changes)
