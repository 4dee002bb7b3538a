"""`SequenceDataset`: a supervised sequence task as NumPy arrays, checked once on construction."""

from __future__ import annotations

import dataclasses

import numpy as np

from ssmkit._src.data.arguments import check_int


# `eq=False`: fields are arrays, whose `==` is elementwise, so datasets compare and hash by identity.
@dataclasses.dataclass(frozen=True, eq=False)
class SequenceDataset:
  """A supervised sequence task as NumPy arrays, split into train and test.

  Inputs are either real-valued features `(N, T, F)` float32 or tokens `(N, T)` int32 in
  `[0, vocab_size)`; `vocab_size` is set exactly for token inputs. Targets are either one class
  per sequence `(N,)` int32 in `[0, num_classes)`, or one target per step `(N, T)` int32 in
  `[-1, num_classes)` where -1 marks a step that carries no loss. Both splits share `T`, `F` and
  the kind of target.

  Attributes:
    x_train: `(N, T, F)` float32 inputs, or `(N, T)` int32 tokens.
    y_train: `(N,)` int32 class labels, or `(N, T)` int32 per-step targets (-1 = no loss).
    x_test: `(M, T, F)` float32 inputs, or `(M, T)` int32 tokens.
    y_test: `(M,)` or `(M, T)` int32 targets, like `y_train`.
    num_classes: number of output classes (for per-step targets, the output vocabulary).
    vocab_size: number of input tokens for token inputs; None for real-valued inputs.
    mask_train: optional `(N, T)` bool, True on real steps; padding only at the end and every
      sequence has a real first step. None means every step is real. Per-step targets must be -1
      on padding.
    mask_test: optional `(M, T)` bool, like `mask_train`.
    reset_train: optional `(N, T)` bool, True where a new document starts inside a sequence
      (packed documents): the model's state is cleared before that step. None: no resets.
    reset_test: optional `(M, T)` bool, like `reset_train`.

  Examples:
    >>> import numpy as np
    >>> from ssmkit.data import SequenceDataset
    >>> ds = SequenceDataset(
    ...     x_train=np.zeros((4, 5, 2), np.float32), y_train=np.zeros(4, np.int32),
    ...     x_test=np.zeros((3, 5, 2), np.float32), y_test=np.ones(3, np.int32), num_classes=2)
    >>> ds.sequence_length, ds.num_features, ds.per_step, ds.num_train, ds.num_test
    (5, 2, False, 4, 3)
  """

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  vocab_size: int | None = None
  mask_train: np.ndarray | None = None
  mask_test: np.ndarray | None = None
  reset_train: np.ndarray | None = None
  reset_test: np.ndarray | None = None

  @classmethod
  def split(cls, x: np.ndarray, y: np.ndarray, num_train: int, *, num_classes: int,
            vocab_size: int | None = None, mask: np.ndarray | None = None) -> SequenceDataset:
    """The first `num_train` sequences of `x`, `y` (and `mask`) for training, the rest for testing."""
    return cls(
        x_train=x[:num_train],
        y_train=y[:num_train],
        x_test=x[num_train:],
        y_test=y[num_train:],
        num_classes=num_classes,
        vocab_size=vocab_size,
        mask_train=None if mask is None else mask[:num_train],
        mask_test=None if mask is None else mask[num_train:],
    )

  def __post_init__(self) -> None:
    check_int(self.num_classes, "num_classes", minimum=1)
    if self.vocab_size is not None:
      check_int(self.vocab_size, "vocab_size", minimum=1)
    for split in ("train", "test"):
      self._check_split(split)
    if self.x_test.shape[1:] != self.x_train.shape[1:]:
      raise ValueError(
          f"`x_test` steps and features {self.x_test.shape[1:]} must match those of `x_train` "
          f"{self.x_train.shape[1:]}."
      )
    if self.y_test.ndim != self.y_train.ndim:
      raise ValueError(
          f"`y_test` has rank {self.y_test.ndim} and `y_train` rank {self.y_train.ndim}: both splits "
          "must have one label per sequence or both one target per step."
      )

  def _check_split(self, split: str) -> None:
    x_name, y_name, mask_name = f"x_{split}", f"y_{split}", f"mask_{split}"
    x, y, mask = getattr(self, x_name), getattr(self, y_name), getattr(self, mask_name)
    reset = getattr(self, f"reset_{split}")
    for name, array in ((x_name, x), (y_name, y), (mask_name, mask), (f"reset_{split}", reset)):
      if array is not None and not isinstance(array, np.ndarray):
        raise TypeError(f"`{name}` must be a NumPy array, got {type(array).__name__}.")
    if self.vocab_size is None:
      if x.dtype != np.float32 or x.ndim != 3:
        raise ValueError(
            f"`{x_name}` must be (N, T, F) float32 when `vocab_size` is None, got {x.shape} {x.dtype}."
        )
    else:
      if x.dtype != np.int32 or x.ndim != 2:
        raise ValueError(f"`{x_name}` must be (N, T) int32 tokens, got {x.shape} {x.dtype}.")
      if np.any((x < 0) | (x >= self.vocab_size)):
        raise ValueError(f"`{x_name}` has tokens outside [0, vocab_size={self.vocab_size}).")
    num, length = x.shape[:2]
    if length == 0:
      raise ValueError(f"`{x_name}` must have at least one step, got shape {x.shape}.")
    if y.dtype != np.int32 or y.shape not in ((num,), (num, length)):
      raise ValueError(
          f"`{y_name}` must be ({num},) or ({num}, {length}) int32, got {y.shape} {y.dtype}."
      )
    lowest = -1 if y.ndim == 2 else 0
    if np.any((y < lowest) | (y >= self.num_classes)):
      raise ValueError(f"`{y_name}` has targets outside [{lowest}, num_classes={self.num_classes}).")
    if reset is not None and (reset.dtype != np.bool_ or reset.shape != (num, length)):
      raise ValueError(f"`reset_{split}` must be ({num}, {length}) bool, got {reset.shape} "
                       f"{reset.dtype}.")
    if mask is None:
      return
    if mask.dtype != np.bool_ or mask.shape != (num, length):
      raise ValueError(f"`{mask_name}` must be ({num}, {length}) bool, got {mask.shape} {mask.dtype}.")
    if not np.all(mask[:, 0]):
      raise ValueError(f"`{mask_name}` must mark the first step of every sequence as real.")
    if np.any(mask[:, 1:] & ~mask[:, :-1]):
      raise ValueError(f"`{mask_name}` must have padding only at the end of each sequence.")
    if y.ndim == 2 and np.any(y[~mask] != -1):
      raise ValueError(f"`{y_name}` must be -1 on the padding steps of `{mask_name}`.")

  @property
  def per_step(self) -> bool:
    """Whether the targets are one per step `(N, T)` rather than one per sequence `(N,)`."""
    return self.y_train.ndim == 2

  @property
  def sequence_length(self) -> int:
    """The number of steps T, padding included."""
    return self.x_train.shape[1]

  @property
  def num_features(self) -> int | None:
    """F for real-valued inputs `(N, T, F)`; None for token inputs."""
    return None if self.vocab_size is not None else self.x_train.shape[2]

  @property
  def num_train(self) -> int:
    """The number of training sequences N."""
    return self.x_train.shape[0]

  @property
  def num_test(self) -> int:
    """The number of test sequences M."""
    return self.x_test.shape[0]
