"""A run's records: `metrics.jsonl` (one JSON object per logged step), `summary.json`, `curves.png`."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure


def read(path: pathlib.Path) -> list[dict[str, Any]]:
  """The records of a `metrics.jsonl` file, in order; [] if it does not exist."""
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate(path: pathlib.Path, step: int) -> None:
  """Drops the records after `step`, e.g. those logged after the checkpoint a run resumes from."""
  kept = [record for record in read(path) if record["step"] <= step]
  path.write_text("".join(json.dumps(record) + "\n" for record in kept))


def append(path: pathlib.Path, record: dict[str, Any]) -> None:
  """Adds one record (a dict with "step") as a line of `path`."""
  with path.open("a") as file:
    file.write(json.dumps(record) + "\n")


def write_summary(path: pathlib.Path, summary: dict[str, Any]) -> None:
  """Writes `summary` as indented JSON."""
  path.write_text(json.dumps(summary, indent=2) + "\n")


def plot_curves(records: Sequence[dict[str, Any]], path: pathlib.Path) -> None:
  """Plots train and test loss and accuracy against the step into a PNG file.

  Args:
    records: `metrics.jsonl` records; train ones have "loss" and "accuracy", eval ones
      "test_loss" and "test_accuracy".
    path: the image file to write.
  """
  # A bare Figure renders with Agg and leaves pyplot's global backend alone.
  figure = Figure(figsize=(10, 4), layout="constrained")
  for axes, name in zip(figure.subplots(1, 2), ("loss", "accuracy"), strict=True):
    for key, label in ((name, "train"), (f"test_{name}", "test")):
      points = [(record["step"], record[key]) for record in records if key in record]
      if points:
        steps, values = zip(*points, strict=True)
        axes.plot(steps, values, marker="o" if len(points) == 1 else None, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel(name)
    axes.grid(alpha=0.3)
    axes.legend()
  if any("loss" in record for record in records):
    figure.axes[0].set_yscale("log")
  figure.savefig(path, dpi=100)
