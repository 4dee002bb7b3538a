"""Wall time, compile time, XLA memory, time budgets and tables shared by the benchmarks."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

K = TypeVar("K")
T = TypeVar("T")

# The longest a cell's timed samples may take together: a method at 1 s per call (a
# sequential scan of 65536 steps on a GPU) gets 2 samples instead of `repeats`.
CELL_BUDGET_S = 2.0

# Printed instead of the criteria by a `--shapes small` run, whose timings are microseconds.
SMALL_SHAPES_NOTE = "Criteria: judged on the full suite only (--shapes full), not on microseconds."


def device_line() -> str:
  """"jax <version>, <platform> (<device kind>)": what a benchmark ran on, for its header."""
  device = jax.devices()[0]
  return f"jax {jax.__version__}, {device.platform} ({device.device_kind})"


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


def forward_and_gradient(methods: Mapping[K, Callable[..., Any]], args: Sequence[Any],
                         loss: Callable[..., Any], extra: Sequence[Any] = (), *, reference: K,
                         rtol: float, repeats: int) -> dict[K, tuple[float, float, int | None]]:
  """Times methods computing one function side by side, forward and gradient.

  Each method's forward on `args` and gradient of `loss(method(*args), *extra)` with respect to
  every one of `args` are compiled; the forwards' outputs are checked against `reference`'s
  (relative to its largest magnitude); then the forwards, and the gradients, take turns
  (`interleaved_medians`).

  Returns:
    `{name: (forward seconds, gradient seconds, the gradient's temporary bytes or None)}`.

  Raises:
    RuntimeError: naming the method whose outputs are more than `rtol` off `reference`'s.
  """
  count = len(args)
  compiled, outputs = {}, {}
  for name, method in methods.items():
    forward, _ = compile_timed(method, *args)
    objective = lambda *a, method=method: loss(method(*a[:count]), *a[count:])
    gradient, _ = compile_timed(jax.grad(objective, argnums=tuple(range(count))), *args, *extra)
    compiled[name] = (forward, gradient)
    outputs[name] = np.asarray(forward(*args))
  want = outputs[reference]
  for name, out in outputs.items():
    if not np.abs(out - want).max() <= rtol * np.abs(want).max():
      raise RuntimeError(f"{name!r} disagrees with {reference!r}.")
  inputs = (args, (*args, *extra))  # the forwards', the gradients'
  seconds = [interleaved_medians({name: functools.partial(fns[i], *inputs[i])
                                  for name, fns in compiled.items()}, repeats=repeats)
             for i in (0, 1)]
  return {name: (seconds[0][name], seconds[1][name], temp_bytes(fns[1]))
          for name, fns in compiled.items()}


def _call_seconds(thunk: Callable[[], Any], calls: int) -> float:
  """Mean wall time of `calls` calls of `thunk`, each waited for with `block_until_ready`."""
  start = time.perf_counter()
  for _ in range(calls):
    jax.block_until_ready(thunk())
  return (time.perf_counter() - start) / calls


def interleaved_medians(
    thunks: Mapping[K, Callable[[], Any]],
    *,
    repeats: int,
    min_sample_s: float = 0.01,
    cell_budget_s: float = CELL_BUDGET_S,
) -> dict[K, float]:
  """Median wall time of one call of each thunk, the thunks taking turns.

  Each thunk is called once to warm up and once to estimate its time; then `repeats`
  rounds time every thunk in turn, so a slow drift of the machine (other load) reaches all
  of them alike, each round in a new random order (seeded). Each sample follows one untimed
  call of its own thunk, which pays for what the thunk before it left behind (gigabytes of
  freed buffers, evicted caches): the sample is the thunk's time when called again and
  again, as a training step is. Without that call, linear attention's gradient (B=2 T=4096
  H=4 K=V=64, CPU) took 88.9 ms right after the quadratic form's 2.5 GB and the chunkwise
  baseline's, against 45.7 ms for the same program right after itself. A sample of a fast
  thunk averages enough calls to last about `min_sample_s`, above the timer's and the
  dispatcher's noise; a slow thunk takes part in only as many rounds as fit in
  `cell_budget_s` (at least one). Every call is waited for with `jax.block_until_ready`, so
  the time covers the computation and not only its dispatch.

  Args:
    thunks: the functions to time, called without arguments, by name.
    repeats: timed samples per thunk; the median is returned.
    min_sample_s: the shortest sample, in seconds.
    cell_budget_s: the most seconds the samples of one thunk may take together.

  Returns:
    Seconds per call, by name.
  """
  calls, rounds = {}, {}
  for name, thunk in thunks.items():
    _call_seconds(thunk, 1)
    estimate = _call_seconds(thunk, 1)
    calls[name] = max(1, math.ceil(min_sample_s / estimate))
    rounds[name] = max(1, min(repeats, int(cell_budget_s // (estimate * calls[name]))))
  samples = {name: [] for name in thunks}
  order = random.Random(0)
  for _ in range(repeats):
    for name in order.sample(list(thunks), len(thunks)):
      if len(samples[name]) < rounds[name]:
        _call_seconds(thunks[name], 1)
        samples[name].append(_call_seconds(thunks[name], calls[name]))
  return {name: statistics.median(times) for name, times in samples.items()}


class Budget:
  """The wall-clock budget of `ssmkit bench all --budget-s`, and what it made skip."""

  def __init__(self, seconds: float):
    self.deadline = time.monotonic() + seconds
    self.skipped: list[str] = []

  def left(self) -> float:
    return self.deadline - time.monotonic()


_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("budget", default=None)


@contextlib.contextmanager
def budget(seconds: float) -> Iterator[Budget]:
  """Runs the benchmarks inside under a budget of `seconds` (see `within_budget`)."""
  token = _BUDGET.set(Budget(seconds))
  try:
    yield _BUDGET.get()
  finally:
    _BUDGET.reset(token)


def current_budget() -> Budget | None:
  return _BUDGET.get()


def within_budget(items: Sequence[T], benchmark: str) -> Iterator[T]:
  """Yields `items` (a benchmark's shapes), each announced on stderr, until the budget ends.

  Outside `budget` every item is yielded. Inside, an item is started only while the time
  left is at least the longest item of this benchmark so far (any time for the first):
  the rest are listed in the budget's `skipped`, and said to be skipped on stdout.
  """
  spent = current_budget()
  longest = 0.0
  for i, item in enumerate(items):
    if spent is not None and (spent.left() <= 0 or spent.left() < longest):
      left = [f"{benchmark}: {x}" for x in items[i:]]
      spent.skipped.extend(left)
      print(f"(budget spent: skipped {len(left)} of {len(items)}: {', '.join(map(str, items[i:]))})",
            flush=True)
      return
    print(f"[{i + 1}/{len(items)}] {item}", file=sys.stderr, flush=True)
    start = time.monotonic()
    yield item
    longest = max(longest, time.monotonic() - start)


def significant(x: float, digits: int = 3) -> str:
  """`x` with about `digits` significant digits and no exponent: 1234, 12.3, 0.0123."""
  if x == 0 or not math.isfinite(x):
    return str(x)
  decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
  return f"{x:.{decimals}f}"


def _line(cells: Sequence[str], widths: Sequence[int], markdown: bool, labels: int) -> str:
  padded = [
      c.ljust(w) if i < labels else c.rjust(w)
      for i, (c, w) in enumerate(zip(cells, widths, strict=True))
  ]
  return f"| {' | '.join(padded)} |" if markdown else "  ".join(padded).rstrip()


def _rules(widths: Sequence[int], markdown: bool, labels: int) -> list[str]:
  if markdown:
    return [("-" * w if i < labels else "-" * (w - 1) + ":") for i, w in enumerate(widths)]
  return ["-" * w for w in widths]


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
  lines = [headers, _rules(widths, markdown, labels), *rows]
  return "\n".join(_line(cells, widths, markdown, labels) for cells in lines)


class StreamedTable:
  """A table printed a few rows at a time, as they are measured.

  Label columns are as wide as the longest label known beforehand (`label_values`), number
  columns as their header or `number_width`; a wider number shifts its row, in plain text
  only.
  """

  def __init__(self, headers: Sequence[str], label_values: Sequence[Iterable[str]], *,
               markdown: bool, number_width: int = 8):
    self.labels = len(label_values)
    self.widths = [
        max([len(h), *map(len, label_values[i])]) if i < self.labels else max(len(h), number_width)
        for i, h in enumerate(headers)
    ]
    self.markdown = markdown
    self._print(headers)
    self._print(_rules(self.widths, markdown, self.labels))

  def _print(self, cells: Sequence[str]) -> None:
    print(_line(cells, self.widths, self.markdown, self.labels), flush=True)

  def add(self, rows: Iterable[Sequence[str]]) -> None:
    for row in rows:
      self._print(row)
