"""Checks of the generators' size and fraction arguments; every failure names the argument."""

from __future__ import annotations

import numpy as np


def check_int(value: int, name: str, *, minimum: int) -> int:
  """Returns `value` as an int, or raises unless it is an integer >= `minimum`."""
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
    raise TypeError(f"`{name}` must be an int, got {value!r}.")
  if value < minimum:
    raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
  return int(value)


def check_fraction(value: float, name: str) -> float:
  """Returns `value` as a float, or raises unless it lies strictly between 0 and 1."""
  if not isinstance(value, (float, int, np.floating, np.integer)) or isinstance(value, bool):
    raise TypeError(f"`{name}` must be a float, got {value!r}.")
  if not 0 < value < 1:
    raise ValueError(f"`{name}` must lie strictly between 0 and 1, got {value}.")
  return float(value)
