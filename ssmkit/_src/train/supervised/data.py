"""A supervised run's data: both splits resident on the device, batches picked there by index.

The host decides only the order, as small index arrays: which examples make each train batch
(a fresh permutation every epoch) and the fixed-size eval batches. The device gathers each
batch from the arrays it holds, so a train step never waits for the host to copy its batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from ssmkit._src.train.core.errors import ConfigError

if TYPE_CHECKING:
  from ssmkit.data import SequenceDataset

Arrays = dict[str, np.ndarray]


def split_arrays(dataset: SequenceDataset, split: str) -> Arrays:
  """The "x", "y" and (where the dataset has them) "mask" and "reset" arrays of the "train" or
  "test" split."""
  arrays = {"x": getattr(dataset, f"x_{split}"), "y": getattr(dataset, f"y_{split}")}
  for key in ("mask", "reset"):
    if getattr(dataset, f"{key}_{split}") is not None:
      arrays[key] = getattr(dataset, f"{key}_{split}")
  return arrays


class TrainOrder:
  """The examples of every train batch, epoch after epoch; the last partial batch of an epoch is dropped.

  The order of epoch e is a permutation drawn from `np.random.default_rng((seed, e))`, so the
  position (epoch, batch) is the order's whole state: `state()` gives it and `restore()` goes
  back to it, and a restored order yields exactly the batches the original would have.

  Args:
    num_examples: N, the number of training examples.
    batch_size: examples per batch, at most N.
    seed: seed of the data order.
  """

  def __init__(self, num_examples: int, batch_size: int, seed: int):
    if not 1 <= batch_size <= num_examples:
      raise ConfigError(
          f"`data.batch_size` must lie in [1, {num_examples}] (the training examples), got {batch_size}."
      )
    self._num_examples, self._batch_size, self._seed = num_examples, batch_size, seed
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

  def __iter__(self) -> TrainOrder:
    return self

  def __next__(self) -> np.ndarray:
    """The `(batch_size,)` example indices of the next batch."""
    if self._batch == self.steps_per_epoch:
      self._epoch, self._batch = self._epoch + 1, 0
      self._order = self._permutation(self._epoch)
    start = self._batch * self._batch_size
    self._batch += 1
    return self._order[start : start + self._batch_size]

  def take(self, num_steps: int, rows: int) -> np.ndarray:
    """The indices of the next `num_steps` batches, `(rows, batch_size)` int32; rows past them 0."""
    indices = np.zeros((rows, self._batch_size), np.int32)
    for row in range(num_steps):
      indices[row] = next(self)
    return indices


def eval_indices(num_examples: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """All M examples in order, in batches of `batch_size`; the last is padded to full size.

  Padding repeats the first example and is marked invalid, so each example counts exactly once.

  Returns:
    `(indices, valid)`: `(ceil(M / batch_size), batch_size)` int32 example indices and bools,
    False on padding.
  """
  positions = np.arange(-(-num_examples // batch_size) * batch_size).reshape(-1, batch_size)
  valid = positions < num_examples
  return np.where(valid, positions, 0).astype(np.int32), valid


def gather(arrays: dict[str, jax.Array], indices: jax.Array,
           sharding: NamedSharding) -> dict[str, jax.Array]:
  """The batch of the examples `indices` (`(B,)`), on the device, split over the mesh of `sharding`."""
  batch = {key: jnp.take(array, indices, axis=0) for key, array in arrays.items()}
  return jax.lax.with_sharding_constraint(batch, sharding)
