"""Checkpoints of a run with orbax: its whole state, and a JSON dict of the rest of its progress."""

from __future__ import annotations

import functools
import operator
import pathlib
from collections.abc import Sequence
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

  def restore(self, template: Any, step: int | None = None, *,
              parts: Sequence[tuple[str, ...]] | None = None) -> tuple[Any, dict[str, Any]]:
    """The state and progress of checkpoint `step` (default: the latest).

    Args:
      template: a state with the saved structure, shapes, dtypes and shardings, e.g. a freshly
        built one.
      step: the checkpoint's step.
      parts: read only these parts of the state, each a path of dataclass fields (e.g.
        `("params",)` of a `TrainState`, `("train_state", "params")` of a `PPOState`); the rest
        of the returned state is `template`'s. None: the whole state.

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
    if parts is None:
      state = ocp.args.StandardRestore(abstract)
    else:
      # Empty parts (a model without batch statistics) have no array to read.
      parts = [path for path in parts if jax.tree.leaves(_get(abstract, path))]
      item: dict[str, Any] = {}  # the parts as orbax names them: nested dicts of field names
      for path in parts:
        node = item
        for name in path[:-1]:
          node = node.setdefault(name, {})
        node[path[-1]] = _get(abstract, path)
      state = ocp.args.PyTreeRestore(item, ocp.checkpoint_utils.construct_restore_args(item),
                                     partial_restore=True)
    restored = self._manager.restore(step, args=ocp.args.Composite(state=state,
                                                                   progress=ocp.args.JsonRestore()))
    if parts is None:
      return restored.state, restored.progress
    state = template
    for path in parts:
      state = _put(state, path, functools.reduce(operator.getitem, path, restored.state))
    return state, restored.progress

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()


def _get(state: Any, path: tuple[str, ...]) -> Any:
  return functools.reduce(getattr, path, state)


def _put(state: Any, path: tuple[str, ...], value: Any) -> Any:
  """`state` (a dataclass with `replace`, as flax's) with the field at `path` set to `value`."""
  if not path:
    return value
  return state.replace(**{path[0]: _put(getattr(state, path[0]), path[1:], value)})
