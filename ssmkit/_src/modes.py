"""Execution modes of a scan, and the rule `auto` uses to pick one.

The `auto` rule is chosen per backend from measurements of `ssmkit bench scan` and
`ssmkit bench rl` (float32; full tables in docs/benchmarks.md), never from a guess:

* CPU (2-core Xeon, jax 0.10): `lax.scan` beat `lax.associative_scan` and every chunked
  variant at every shape measured (T from 1024 to 65536, D from 1 to 1024), forward and
  forward+backward, so `auto` runs the sequential mode there.
* GPU (one H100, jax 0.11.2, CUDA 13): the parallel mode was the fastest ssmkit mode at
  every length measured, and the chunked mode (the previous rule) the slowest. Medians in
  ms, forward / forward+backward:

  | (T, D)       | `lax.associative_scan` | chunked      | parallel      |
  |--------------|------------------------|--------------|---------------|
  | 1024 x 1024  | 0.273 / 0.483          | 0.995 / 1.66 | 0.146 / 0.252 |
  | 65536 x 1    | 0.160 / 0.344          | 4.34 / 9.36  | 0.338 / 0.298 |
  | 16384 x 4096 | 1.10 / 3.19            | 3.94 / 8.14  | 1.15 / 2.23   |

  GAE over 1024 environments x 2048 steps: chunked 0.66-0.84 ms, parallel 0.14-0.15 ms.
  So `auto` runs the parallel mode on GPUs, at every length. The sequential mode issues
  one step after another and was 0.5-1.5 s per call at T = 65536 there.
* Other accelerators (TPU) have not been measured; `auto` takes the GPU rule for them,
  the nearest evidence, until a TPU table says otherwise.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import jax


class Mode(str, enum.Enum):
  """How a scan is executed. All modes compute the same result.

  A member equals its string value (`Mode.AUTO == "auto"`); functions parse either once,
  with `parse_mode`.
  """

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


def _parse(kind: type[enum.Enum], value, name: str):
  """`value` as a member of `kind`, or a `ValueError` naming the argument `name` and the
  members."""
  try:
    return kind(value)
  except ValueError:
    names = ", ".join(repr(m.value) for m in kind)
    raise ValueError(f"`{name}` must be one of {names}, got {value!r}.") from None


def parse_mode(mode: str | Mode) -> Mode:
  """Validates a user-given mode once, at the public boundary."""
  return _parse(Mode, mode, "mode")


class Impl(str, enum.Enum):
  """What computes a chunked matrix-state recurrence: XLA's compiled program of its chunked
  form, ssmkit's Pallas kernels (`matrix_state.kernels`; compiled for NVIDIA GPUs, run by
  Pallas' interpreter elsewhere), or `AUTO`, the measured faster of the two (`resolve_impl`)."""

  XLA = "xla"
  PALLAS = "pallas"
  AUTO = "auto"


def parse_impl(impl: str | Impl) -> Impl:
  """Validates a user-given `impl` once, at the public boundary."""
  return _parse(Impl, impl, "impl")


def resolve_impl(impl: Impl) -> Impl:
  """Replaces `Impl.AUTO` by the faster implementation on this backend: the XLA forms on every
  backend until the kernels have been timed against them on a GPU (on CPU the kernels only
  run interpreted, for tests)."""
  return Impl.XLA if impl is Impl.AUTO else impl


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


def resolve_mode(mode: Mode, backend: str | None = None) -> Mode:
  """Replaces `Mode.AUTO` by the measured best mode of `backend` (see the module docstring)."""
  if mode is not Mode.AUTO:
    return mode
  backend = backend or jax.default_backend()
  return Mode.SEQUENTIAL if backend == "cpu" else Mode.PARALLEL


def default_chunk_size(length: int) -> int:
  """A power of two near sqrt(length), in [16, 1024]: balances in-chunk and carry depth."""
  if length <= 16:
    return max(length, 1)
  return int(min(1024, max(16, 2 ** round(math.log2(math.sqrt(length))))))


def default_inner(backend: str | None = None) -> Inner:
  backend = backend or jax.default_backend()
  return Inner.SEQUENTIAL if backend == "cpu" else Inner.PARALLEL


_SHORT_MATRIX_STATE = 64
# From this many (batch row, head, step) triples on, the delta rules' chunks computed values
# faster than the step loop on CPU, below it slower (medians side by side, K=V=64: B=2 H=4
# T=4096 24.7 against 31.2 ms, KDA 26.8 against 35.0; B=8 H=4 T=1024 26.5 against 35.6;
# B=2 H=4 T=2048 13.3 against 12.5, T=256 2.6 against 1.8). The delta product's interleaved
# steps count one by one: with its chunks carried at low rank (`matrix_state.low_rank`), two
# steps a token at B=2 H=4 took 39.6 against 51.1 ms for T=4096 tokens (2^16 triples), 20.4
# against 20.6 for T=2048 (2^15) and 11.6 against 10.0 for T=1024.
DELTA_VALUES_CHUNKED_FROM = 1 << 15
# From this many (batch row, head) sequences on, whatever their length, the delta rules' chunks
# of 32 steps computed values faster than the step loop on CPU: its states stop fitting the
# cache. Side by side (medians of 25, K=V=64), the gated delta rule took 2.78 against 4.22 ms at
# B=4 H=4 T=128, 5.16 against 8.19 at T=256, 8.40 against 11.33 at B=16 H=4 T=128; KDA 2.86
# against 4.79 at B=4 H=4 T=128; the delta product (two steps a token) 7.55 against 14.59 at
# B=4 H=4 T=256. At 8 sequences the two were within 10% below 2^15 triples.
DELTA_VALUES_CHUNKED_ROWS = 16


# From this many (batch row, head) sequences on, linear attention's values come from the chunked
# loop on CPU, below it from the step loop: with the step loop reading its inputs in place
# (`matrix_state.steps.run`), the chunks took 1.26-1.53x its time for SSD at B=2 H=4 from 256 to
# 4096 steps, 1.13x at B=4 H=4, 1.10-1.21x at B=8 H=4, and 0.95x at B=16 H=4 T=1024 (GLA the same
# within 0.2x; medians side by side, CPU). The loop is the fastest way to Mamba-2's SSD forward
# where the batch is small: one plain `lax.scan` over the state, as ejkernel's XLA
# `state_space_v2` is, took 8.35 ms at B=2 T=2048 H=4 K=V=64, the chunks 10.4 ms
# (scripts/bench_ejkernel.py), the loop 7.4 ms.
LINEAR_VALUES_CHUNKED_ROWS = 32


class MatrixPlan(NamedTuple):
  """How `linear_attention` and `delta_rule` evaluate a sequence.

  Attributes:
    forward: the mode that computes the values.
    derivatives: the mode whose JVP computes the derivatives (forward and reverse mode).
  """

  forward: Mode
  derivatives: Mode


# On accelerators (one H200, jax 0.11.2, CUDA 13, bfloat16, K=V=128, B=8 T=2048 H=16;
# docs/benchmarks.md), fwd / fwd+bwd ms and temporary MiB of the parallel and chunked forms:
#
#   | function                    | parallel                  | chunked                   |
#   |-----------------------------|---------------------------|---------------------------|
#   | linear attention (per head) | 1.62 / 2.96, 1058 MiB     | 2.15 / 5.09, 1106 MiB     |
#   | gated delta rule            | 5.22 / 9.98, 4467 MiB     | 4.97 / 10.18, 1146 MiB    |
#   | KDA (per-key decay)         | 7.49 / 16.59, 8152 MiB    | 5.95 / 13.56, 1232 MiB    |
#
# The tree combines the chunks' maps, row decays for linear attention but `(K, K)` matrices for
# the delta rules: for those it held 4-7x the memory of the chunked loop for no speed.


def resolve_matrix_mode(mode: Mode, length: int, backend: str | None = None,
                        chunked_values_from: float = math.inf, rows: int = 1,
                        matrix: bool = False,
                        chunked_values_rows: float = math.inf) -> MatrixPlan:
  """The plan for `mode` over `length` steps of `rows` (batch rows times heads) sequences;
  `Mode.AUTO` is chosen per backend, and on accelerators by whether the chunks' maps are
  `(K, K)` matrices (`matrix`: the delta rules) or row decays.

  A single step always runs sequentially (decoding). On CPU, the step-by-step loop streams
  the state through the cache, while its gradient keeps T states; `auto` there differentiates
  the chunked form (one state per chunk) and computes values step by step, or chunked too
  from `rows * length >= chunked_values_from` or `rows >= chunked_values_rows` on: linear
  attention passes `LINEAR_VALUES_CHUNKED_ROWS` rows, the delta rules, whose chunks solve a
  system each, `DELTA_VALUES_CHUNKED_FROM` triples and `DELTA_VALUES_CHUNKED_ROWS` rows.
  On accelerators, T steps would be T small kernels: `auto` runs every chunk at once with the
  chunk maps combined as a tree where they are row decays, and the chunked loop where they
  are matrices (the table above).
  """
  if mode is not Mode.AUTO:
    return MatrixPlan(mode, mode)
  backend = backend or jax.default_backend()
  if length == 1 or (backend == "cpu" and length < _SHORT_MATRIX_STATE):
    return MatrixPlan(Mode.SEQUENTIAL, Mode.SEQUENTIAL)
  if backend == "cpu":
    chunked = rows * length >= chunked_values_from or rows >= chunked_values_rows
    return MatrixPlan(Mode.CHUNKED if chunked else Mode.SEQUENTIAL, Mode.CHUNKED)
  accelerated = Mode.CHUNKED if matrix else Mode.PARALLEL
  return MatrixPlan(accelerated, accelerated)
