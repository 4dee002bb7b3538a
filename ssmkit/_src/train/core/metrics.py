"""A run's records: `metrics.jsonl` (one JSON object per logged step), `summary.json`, `curves.png`.

In a multi-process run the processes share the workdir and only process 0 writes or prints.
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, ParamSpec

import tqdm
from matplotlib.figure import Figure

from ssmkit._src.train.core.parallel import is_primary

_Args = ParamSpec("_Args")


def primary_only(write: Callable[_Args, None]) -> Callable[_Args, None]:
  """`write` that runs on process 0 only."""

  @functools.wraps(write)
  def wrapper(*args: _Args.args, **kwargs: _Args.kwargs) -> None:
    if is_primary():
      write(*args, **kwargs)

  return wrapper


def console(total: int, initial: int, desc: str, unit: str) -> tuple[tqdm.tqdm, Callable[[str], None]]:
  """A tqdm progress bar from `initial` to `total` and a function that prints a line above it.

  Both are silent on processes other than 0, and the bar is off when the output is not a terminal.
  """
  primary = is_primary()
  bar = tqdm.tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=None if primary else True,
                  dynamic_ncols=True)
  return bar, tqdm.tqdm.write if primary else lambda line: None


def read(path: pathlib.Path) -> list[dict[str, Any]]:
  """The records of a `metrics.jsonl` file, in order; [] if it does not exist."""
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@primary_only
def truncate(path: pathlib.Path, step: int) -> None:
  """Drops the records after `step`, e.g. those logged after the checkpoint a run resumes from."""
  kept = [record for record in read(path) if record["step"] <= step]
  path.write_text("".join(json.dumps(record) + "\n" for record in kept))


@primary_only
def append(path: pathlib.Path, record: dict[str, Any]) -> None:
  """Adds one record (a dict with "step") as a line of `path`."""
  with path.open("a") as file:
    file.write(json.dumps(record) + "\n")


@primary_only
def write_summary(path: pathlib.Path, summary: dict[str, Any]) -> None:
  """Writes `summary` as indented JSON."""
  path.write_text(json.dumps(summary, indent=2) + "\n")


class Panel(NamedTuple):
  """One plot of `plot_curves`: some record keys against the x key.

  Attributes:
    ylabel: the y axis label.
    curves: (record key, legend label) of every curve.
    log_scale: a logarithmic y axis.
  """

  ylabel: str
  curves: tuple[tuple[str, str], ...]
  log_scale: bool = False


@primary_only
def plot_curves(records: Sequence[dict[str, Any]], path: pathlib.Path, panels: Sequence[Panel], *,
                x: str = "step", xlabel: str = "step") -> None:
  """Plots record values against `x`, one panel beside the other, into a PNG file.

  Args:
    records: `metrics.jsonl` records; a curve takes the records in which its key is not None.
    path: the image file to write.
    panels: what each panel shows.
    x: the record key of the x axis.
    xlabel: the x axis label.
  """
  # A bare Figure renders with Agg and leaves pyplot's global backend alone. Its margins are set
  # in inches, room for tick labels of seven characters (-123000): a layout engine measuring
  # every label took half of the drawing's time (0.36 against 0.17 s for two panels).
  width = 5 * len(panels)
  figure = Figure(figsize=(width, 4))
  figure.subplots_adjust(left=1 / width, right=1 - 0.2 / width, bottom=0.12, top=0.96,
                         wspace=0.3)
  for axes, panel in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
    for key, label in panel.curves:
      points = [(record[x], record[key]) for record in records if record.get(key) is not None]
      if points:
        xs, ys = zip(*points, strict=True)
        axes.plot(xs, ys, marker="o" if len(points) == 1 else None, label=label)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(panel.ylabel)
    axes.grid(alpha=0.3)
    if axes.lines:
      axes.legend()
      if panel.log_scale:
        axes.set_yscale("log")
  figure.savefig(path, dpi=100)
