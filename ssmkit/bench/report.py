"""`ssmkit bench all`: every benchmark of the command line in one run, and one report.

Each benchmark prints its tables as it measures them; everything printed also goes to the
report file as it comes, so an interrupted run still leaves the tables it finished. With a
time budget, a benchmark starts a shape only while the time left is at least the longest
shape it has run so far (see `_timing.within_budget`), and no benchmark starts once the
budget is spent; the report lists what was skipped.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import pathlib
import sys
import time
import traceback
from collections.abc import Mapping

import jax

from ssmkit.bench import _timing


class _Tee(io.TextIOBase):
  """Writes to every stream it holds, flushing each write."""

  def __init__(self, *streams: io.TextIOBase):
    self.streams = streams

  def write(self, text: str) -> int:
    for stream in self.streams:
      stream.write(text)
      stream.flush()
    return len(text)


def run_all(
    benchmarks: Mapping[str, str],
    *,
    shapes: str,
    repeats: int,
    markdown: bool,
    budget_s: float | None,
    output: pathlib.Path,
) -> int:
  """Runs the benchmarks in order and writes their output to `output` as well.

  Args:
    benchmarks: benchmark name -> module with a `run(*, shapes, repeats, markdown)`.
    shapes: "full" or "small", passed to every benchmark.
    repeats: timed samples per cell, passed to every benchmark.
    markdown: markdown tables, and markdown section titles in the report.
    budget_s: seconds the whole run may take, or None for no limit.
    output: the report file, written from the start.

  Returns:
    0, or 1 when a benchmark raised (its error is in the report and the others still run).
  """
  device = jax.devices()[0]
  title = "# " if markdown else ""
  section = "## " if markdown else "== "
  status = 0
  started = time.monotonic()
  output.parent.mkdir(parents=True, exist_ok=True)
  with output.open("w") as report, contextlib.redirect_stdout(_Tee(sys.stdout, report)):
    print(f"{title}ssmkit benchmarks")
    print()
    print(
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; jax {jax.__version__}; "
        f"{len(jax.devices())} {device.platform} device(s) ({device.device_kind}); "
        f"--shapes {shapes} --repeats {repeats}"
        + ("" if budget_s is None else f" --budget-s {budget_s:g}")
        + "."
    )
    budget = _timing.budget(float("inf") if budget_s is None else budget_s)
    with budget as spent:
      for name, module_name in benchmarks.items():
        print()
        print(f"{section}{name}")
        print()
        if spent.left() <= 0:
          print("(budget spent: not started)")
          spent.skipped.append(f"{name}: all of it")
          continue
        start = time.monotonic()
        try:
          module = importlib.import_module(module_name)
          status = max(status, module.run(shapes=shapes, repeats=repeats, markdown=markdown))
        except Exception:  # reported; the other benchmarks still run
          fence = ["```"] if markdown else []
          print("\n".join([f"ssmkit bench {name} failed:", *fence,
                           traceback.format_exc().rstrip(), *fence]))
          status = 1
        print()
        print(f"({name}: {time.monotonic() - start:.0f} s)")
      print()
      print(f"{section}Summary")
      print()
      print(f"{len(benchmarks)} benchmarks in {time.monotonic() - started:.0f} s.")
      if spent.skipped:
        print("Skipped to stay within the budget:")
        for item in spent.skipped:
          print(f"- {item}")
  print(f"report written to {output}", file=sys.stderr)
  return status
