"""The fields of a checkpoint's `config.json`, read with checks that name the field."""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

from ssmkit._src.pretrained.files import CheckpointError

_MISSING = object()


class Fields:
  """A `config.json`'s fields; each read names the field (and the file) when it does not fit.

  Attributes:
    values: the parsed config.
    source: the file, for error messages.
  """

  def __init__(self, values: dict[str, Any], source: pathlib.Path | str):
    self.values = values
    self.source = source

  def get(self, name: str, default: Any = _MISSING) -> Any:
    """The field `name`, or `default` when absent (an error without a default)."""
    if name in self.values and self.values[name] is not None:
      return self.values[name]
    if default is _MISSING:
      raise CheckpointError(f"{self.source}: the field `{name}` is missing.")
    return default

  def int(self, name: str, default: Any = _MISSING) -> int:
    value = self.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise CheckpointError(f"{self.source}: `{name}` must be a positive integer for ssmkit, "
                            f"got {value!r}.")
    return value

  def float(self, name: str, default: Any = _MISSING) -> float:
    value = self.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
      raise CheckpointError(f"{self.source}: `{name}` must be a positive number, got {value!r}.")
    return float(value)

  def require(self, name: str, expected: Any) -> None:
    """Checks that the field `name`, when present, is `expected`, the only value ssmkit computes
    exactly."""
    value = self.get(name, expected)
    if value != expected:
      raise CheckpointError(f"{self.source}: `{name}`={value!r} is not supported: ssmkit computes "
                            f"this architecture exactly only with {name}={expected!r}.")


class Wrapper(NamedTuple):
  """A checkpoint that holds a language model inside a larger one (an image-text model): its
  config.json's `text_config` is the language model's, whose weights are named with `prefix`
  in place of "model.", beside weights under `ignored` prefixes that ssmkit leaves out.

  Attributes:
    architecture: the `architectures` name of the larger model.
    prefix: what the language model's "model." weights are named with.
    ignored: name prefixes of the weights of the rest (e.g. a vision tower).
  """

  architecture: str
  prefix: str
  ignored: tuple[str, ...]
