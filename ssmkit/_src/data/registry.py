"""`load`: every dataset of `ssmkit.data` by name."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ssmkit._src.data.dataset import SequenceDataset
from ssmkit._src.data.digits import sequential_digits
from ssmkit._src.data.induction_heads import induction_heads
from ssmkit._src.data.listops import listops
from ssmkit._src.data.mnist1d import mnist1d
from ssmkit._src.data.mqar import mqar
from ssmkit._src.data.selective_copying import selective_copying
from ssmkit._src.data.text import text

_DATASETS: dict[str, Callable[..., SequenceDataset]] = {
    "induction_heads": induction_heads,
    "listops": listops,
    "mnist1d": mnist1d,
    "mqar": mqar,
    "selective_copying": selective_copying,
    "sequential_digits": sequential_digits,
    "text": text,
}


def load(name: str, **kwargs: Any) -> SequenceDataset:
  """Builds the dataset called `name` with the keyword arguments of its function.

  Args:
    name: one of "induction_heads", "listops", "mnist1d", "mqar", "selective_copying",
      "sequential_digits", "text", the names of the functions of `ssmkit.data` that build them.
    **kwargs: keyword arguments of that function.

  Returns:
    The `SequenceDataset` that `ssmkit.data.<name>(**kwargs)` returns.

  Raises:
    ValueError: for an unknown `name`; the message lists the known names.
    TypeError: for a keyword argument that the dataset does not take; the message names it.

  Examples:
    >>> from ssmkit.data import load
    >>> ds = load("induction_heads", num_train=4, num_test=2, length=16)
    >>> ds.x_train.shape, ds.per_step
    ((4, 16), True)
  """
  if name not in _DATASETS:
    raise ValueError(f"Unknown dataset {name!r}; known datasets: {', '.join(_DATASETS)}.")
  build = _DATASETS[name]
  accepted = inspect.signature(build).parameters
  unknown = [key for key in kwargs if key not in accepted]
  if unknown:
    raise TypeError(
        f"Dataset {name!r} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
        f"it takes: {', '.join(accepted)}."
    )
  return build(**kwargs)
