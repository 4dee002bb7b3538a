"""Wall time, compile time, XLA memory and table formatting shared by the benchmarks."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax

K = TypeVar("K")

# Printed instead of the criteria by a `--shapes small` run, whose timings are microseconds.
SMALL_SHAPES_NOTE = "Criteria: judged on the full suite only (--shapes full), not on microseconds."


def compile_timed(fn: Callable[..., Any], *args: Any) -> tuple[jax.stages.Compiled, float]:
  """Traces, lowers and compiles `jax.jit(fn)` for `args`.

  Args:
    fn: the function to compile; pass a fresh callable so no JAX cache is hit.
    *args: example arguments (arrays), fixing shapes and dtypes.

  Returns:
    The compiled executable and the seconds that tracing, lowering and compiling took.
  """
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - start


def temp_bytes(compiled: jax.stages.Compiled) -> int | None:
  """XLA's temporary buffer size of `compiled` (arguments and outputs excluded), if known."""
  analysis = compiled.memory_analysis()
  return None if analysis is None else int(analysis.temp_size_in_bytes)


def _call_seconds(thunk: Callable[[], Any], calls: int) -> float:
  """Mean wall time of `calls` calls of `thunk`, each waited for with `block_until_ready`."""
  start = time.perf_counter()
  for _ in range(calls):
    jax.block_until_ready(thunk())
  return (time.perf_counter() - start) / calls


def interleaved_medians(
    thunks: Mapping[K, Callable[[], Any]], *, repeats: int, min_sample_s: float = 0.01
) -> dict[K, float]:
  """Median wall time of one call of each thunk, the thunks taking turns.

  Each thunk is called once to warm up and once to estimate its time; then `repeats`
  rounds time every thunk in turn, so a slow drift of the machine (other load, memory
  state) reaches all of them alike; the order rotates from round to round, so what a
  thunk leaves behind (freed buffers, evicted caches) does not always fall on the same
  next one. A sample of a fast thunk averages enough calls to last about `min_sample_s`,
  above the timer's and the dispatcher's noise. Every call is waited for with
  `jax.block_until_ready`, so the time covers the computation and not only its dispatch.

  Args:
    thunks: the functions to time, called without arguments, by name.
    repeats: timed samples per thunk; the median is returned.
    min_sample_s: the shortest sample, in seconds.

  Returns:
    Seconds per call, by name.
  """
  calls = {}
  for name, thunk in thunks.items():
    _call_seconds(thunk, 1)
    calls[name] = max(1, math.ceil(min_sample_s / _call_seconds(thunk, 1)))
  samples = {name: [] for name in thunks}
  names = list(thunks)
  for round_ in range(repeats):
    # Each round starts one thunk later, so no thunk always runs right after the same one.
    for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
      samples[name].append(_call_seconds(thunks[name], calls[name]))
  return {name: statistics.median(times) for name, times in samples.items()}


def significant(x: float, digits: int = 3) -> str:
  """`x` with about `digits` significant digits and no exponent: 1234, 12.3, 0.0123."""
  if x == 0 or not math.isfinite(x):
    return str(x)
  decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
  return f"{x:.{decimals}f}"


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, markdown: bool, labels: int = 1
) -> str:
  """Aligns `rows` under `headers` as plain text or as a GitHub markdown table.

  Args:
    headers: column titles.
    rows: one sequence of already formatted cells per row, as long as `headers`.
    markdown: emit `| a | b |` rows with a `|---|---:|` separator instead of plain text.
    labels: how many leading columns hold labels (left-aligned); the rest are numbers
      (right-aligned).

  Returns:
    The table, one line per row, without a trailing newline.
  """
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

  def line(cells: Sequence[str]) -> str:
    padded = [
        c.ljust(w) if i < labels else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    ]
    return f"| {' | '.join(padded)} |" if markdown else "  ".join(padded).rstrip()

  if markdown:
    rules = [("-" * w if i < labels else "-" * (w - 1) + ":") for i, w in enumerate(widths)]
  else:
    rules = ["-" * w for w in widths]
  return "\n".join([line(headers), line(rules), *(line(r) for r in rows)])
