"""Fixed-shape batches: shuffled train batches with a resumable position, padded eval batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ssmkit._src.train.errors import ConfigError

if TYPE_CHECKING:
  from ssmkit.data import SequenceDataset

Batch = dict[str, np.ndarray]


def split_arrays(dataset: SequenceDataset, split: str) -> Batch:
  """The "x", "y" and (if the dataset has one) "mask" arrays of the "train" or "test" split."""
  arrays = {"x": getattr(dataset, f"x_{split}"), "y": getattr(dataset, f"y_{split}")}
  mask = getattr(dataset, f"mask_{split}")
  if mask is not None:
    arrays["mask"] = mask
  return arrays


class TrainBatches:
  """Shuffled minibatches of `batch_size` examples, epoch after epoch; partial batches are dropped.

  The order of epoch e is a permutation drawn from `np.random.default_rng((seed, e))`, so the
  position (epoch, batch) is the iterator's whole state: `state()` gives it and `restore()` goes
  back to it, and a restored iterator yields exactly the batches the original would have.

  Args:
    arrays: `(N, ...)` arrays with a common first axis, e.g. from `split_arrays`.
    batch_size: examples per batch, at most N.
    seed: seed of the data order.
  """

  def __init__(self, arrays: Batch, batch_size: int, seed: int):
    self._arrays = arrays
    self._num_examples = len(arrays["x"])
    if not 1 <= batch_size <= self._num_examples:
      raise ConfigError(
          f"`data.batch_size` must lie in [1, {self._num_examples}] (the training examples), "
          f"got {batch_size}."
      )
    self._batch_size = batch_size
    self._seed = seed
    self._epoch, self._batch = 0, 0
    self._order = self._permutation(0)

  @property
  def steps_per_epoch(self) -> int:
    """Full batches per pass over the examples."""
    return self._num_examples // self._batch_size

  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng((self._seed, epoch)).permutation(self._num_examples)

  def state(self) -> dict[str, int]:
    """The position of the next batch: {"epoch": e, "batch": b}."""
    return {"epoch": self._epoch, "batch": self._batch}

  def restore(self, state: dict[str, int]) -> None:
    """Continues from a position that `state()` returned."""
    self._epoch, self._batch = int(state["epoch"]), int(state["batch"])
    self._order = self._permutation(self._epoch)

  def __iter__(self) -> TrainBatches:
    return self

  def __next__(self) -> Batch:
    if self._batch == self.steps_per_epoch:
      self._epoch, self._batch = self._epoch + 1, 0
      self._order = self._permutation(self._epoch)
    start = self._batch * self._batch_size
    indices = self._order[start : start + self._batch_size]
    self._batch += 1
    return {key: array[indices] for key, array in self._arrays.items()}


def eval_batches(arrays: Batch, batch_size: int) -> list[Batch]:
  """All examples in order, in batches of `batch_size`; the last is padded to full size.

  Padding repeats the first example; every batch has a "valid" `(batch_size,)` bool array, False
  on padding, so each example is counted exactly once.

  Args:
    arrays: `(M, ...)` arrays with a common first axis.
    batch_size: examples per batch.

  Returns:
    ceil(M / batch_size) batches with the keys of `arrays` and "valid".
  """
  num_examples = len(arrays["x"])
  batches = []
  for start in range(0, num_examples, batch_size):
    indices = np.arange(start, start + batch_size)
    valid = indices < num_examples
    indices = np.where(valid, indices, 0)
    batches.append({**{key: array[indices] for key, array in arrays.items()}, "valid": valid})
  return batches
