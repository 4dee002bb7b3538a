"""Execution modes of a scan, and the rule `auto` uses to pick one.

The `auto` rule comes from `ssmkit bench scan` (tables in docs/benchmarks.md):

* On CPU, `lax.scan` beat `lax.associative_scan` and every chunked variant at every shape
  measured, forward and backward, so `auto` runs the sequential mode there.
* On accelerators, a scan of T steps issues T small kernels when sequential; `auto` runs
  the sequential mode only for short sequences (T <= 64) and the chunked mode (parallel
  inside chunks of about sqrt(T) steps) otherwise.
"""

from __future__ import annotations

import enum
import math

import jax


class Mode(enum.Enum):
  """How a scan is executed. All modes compute the same result."""

  SEQUENTIAL = "sequential"
  PARALLEL = "parallel"
  CHUNKED = "chunked"
  AUTO = "auto"


class Inner(enum.Enum):
  """How the chunked mode scans inside each chunk.

  `SEQUENTIAL` runs one `lax.scan` over the chunk positions, vectorised over chunks;
  `PARALLEL` runs `lax.associative_scan` inside every chunk; `CUMSUM` (linear recurrences
  only) uses the closed form h = P * cumsum(b / P) with P the running product of `a`, which
  is exact in exact arithmetic but overflows once P underflows (see `linear_recurrence`).
  """

  SEQUENTIAL = "sequential"
  PARALLEL = "parallel"
  CUMSUM = "cumsum"


_SHORT_ON_ACCELERATOR = 64


def parse_mode(mode: str | Mode) -> Mode:
  """Validates a user-given mode once, at the public boundary."""
  try:
    return Mode(mode)
  except ValueError:
    names = ", ".join(repr(m.value) for m in Mode)
    raise ValueError(f"`mode` must be one of {names}, got {mode!r}.") from None


def parse_inner(inner: str | Inner | None, allowed: tuple[Inner, ...], mode: Mode) -> Inner | None:
  """Validates a chunk-inner strategy against the ones the caller supports and `mode`.

  `inner` belongs to the chunked mode, so it is refused with a mode that never chunks; with
  "auto" it applies when the rule picks the chunked mode.
  """
  if inner is None:
    return None
  if mode in (Mode.SEQUENTIAL, Mode.PARALLEL):
    raise ValueError(
        f"`inner` chooses how the chunked mode scans inside a chunk; it has no meaning with "
        f"mode={mode.value!r}: leave it out, or use mode='chunked' or 'auto'."
    )
  names = ", ".join(repr(i.value) for i in allowed)
  try:
    value = Inner(inner)
  except ValueError:
    raise ValueError(f"`inner` must be one of {names}, got {inner!r}.") from None
  if value not in allowed:
    raise ValueError(f"`inner` must be one of {names} here, got {value.value!r}.")
  return value


def resolve_mode(mode: Mode, length: int, backend: str | None = None) -> Mode:
  """Replaces `Mode.AUTO` by a concrete mode for a scan of `length` steps."""
  if mode is not Mode.AUTO:
    return mode
  backend = backend or jax.default_backend()
  if backend == "cpu" or length <= _SHORT_ON_ACCELERATOR:
    return Mode.SEQUENTIAL
  return Mode.CHUNKED


def default_chunk_size(length: int) -> int:
  """A power of two near sqrt(length), in [16, 1024]: balances in-chunk and carry depth."""
  if length <= 16:
    return max(length, 1)
  return int(min(1024, max(16, 2 ** round(math.log2(math.sqrt(length))))))


def default_inner(backend: str | None = None) -> Inner:
  backend = backend or jax.default_backend()
  return Inner.SEQUENTIAL if backend == "cpu" else Inner.PARALLEL
