"""Checkpoints of a run with orbax: its whole state, and a JSON dict of the rest of its progress."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpoints:
  """The checkpoints in `directory`, the `keep` most recent kept.

  Each checkpoint holds two items: "state", the run's state (a pytree of arrays: parameters,
  optimizer state, step, ...), and "progress", a JSON dict (e.g. the position of the data order
  and the wall time so far), which is all a run needs to continue as if it had not stopped.

  Args:
    directory: where the step folders go; created if needed.
    keep: number of most recent checkpoints kept; None keeps every one.
  """

  def __init__(self, directory: str | pathlib.Path, keep: int | None):
    self._manager = ocp.CheckpointManager(
        pathlib.Path(directory).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep)
    )

  def latest_step(self) -> int | None:
    """The step of the most recent checkpoint, None if there is none."""
    return self._manager.latest_step()

  def steps(self) -> list[int]:
    """The steps of the checkpoints kept, in order."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, progress: dict[str, Any]) -> None:
    """Saves a checkpoint for `step` (asynchronously; `close` waits for it)."""
    items = ocp.args.Composite(state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress))
    self._manager.save(step, args=items, force=True)

  def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The state and progress of checkpoint `step` (default: the latest).

    Args:
      template: a state with the saved structure, shapes, dtypes and shardings, e.g. a freshly
        built one.
      step: the checkpoint's step.

    Returns:
      (state, progress).

    Raises:
      FileNotFoundError: if there is no checkpoint of `step`; the message lists those kept.
    """
    step = self.latest_step() if step is None else step
    if step not in self.steps():
      kept = ", ".join(map(str, self.steps())) or "none"
      raise FileNotFoundError(
          f"no checkpoint of step {step} in {self._manager.directory}; the steps kept: {kept}.")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    items = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore())
    restored = self._manager.restore(step, args=items)
    return restored.state, restored.progress

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
