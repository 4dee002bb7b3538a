"""Checkpoints of a run with orbax: the train state and the position of the data order."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from ssmkit._src.train.steps import TrainState


class Checkpoints:
  """The checkpoints in `directory`, the `keep` most recent kept.

  Each checkpoint holds two items: "state", the `TrainState` (params, optimizer state, BatchNorm
  statistics, step), and "progress", a JSON dict (the train iterator's position and the wall
  time so far), which is all a run needs to continue as if it had not stopped.

  Args:
    directory: where the step folders go; created if needed.
    keep: number of most recent checkpoints kept.
  """

  def __init__(self, directory: str | pathlib.Path, keep: int):
    self._manager = ocp.CheckpointManager(
        pathlib.Path(directory).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep)
    )

  def latest_step(self) -> int | None:
    """The step of the most recent checkpoint, None if there is none."""
    return self._manager.latest_step()

  def save(self, step: int, state: TrainState, progress: dict[str, Any]) -> None:
    """Saves a checkpoint for `step` (asynchronously; `close` waits for it)."""
    items = ocp.args.Composite(state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress))
    self._manager.save(step, args=items, force=True)

  def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
    """The state and progress of checkpoint `step` (default: the latest).

    Args:
      template: a state with the saved structure, shapes and dtypes, e.g. a freshly built one.
      step: the checkpoint's step.

    Returns:
      (state, progress).
    """
    step = self.latest_step() if step is None else step
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    items = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore())
    restored = self._manager.restore(step, args=items)
    return restored.state, restored.progress

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
