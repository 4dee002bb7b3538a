"""A run's directory: the files it holds, the run it may hold already, and opening it to train.

A workdir holds `config.yaml` (the resolved config), `checkpoints/`, `metrics.jsonl`,
`summary.json` and `curves.png`. Training again in a workdir with checkpoints resumes the run
they hold, if the new config is that run's.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence
from typing import Any

from ssmkit._src.train.core import metrics, schema
from ssmkit._src.train.core.checkpoint import Checkpoints
from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.core.parallel import is_primary

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CURVES_FILE = "curves.png"


def saved_config(workdir: str | pathlib.Path, config_schema: type) -> Any:
  """The config in a workdir's `config.yaml`, read into `config_schema`.

  Raises:
    FileNotFoundError: if `workdir` has no `config.yaml`.
    ConfigError: if the saved config is of another task kind than `config_schema`.
  """
  path = pathlib.Path(workdir) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{workdir} has no {CONFIG_FILE}; is it the workdir of a training run?")
  content = schema.read_yaml(path)
  task = schema.declared_task(config_schema)
  saved_task = content.get(schema.TASK_KEY, task)
  try:
    if saved_task != task:
      raise ConfigError(f"its `task` is {saved_task!r}")
    return schema.merge(config_schema, content, ())
  except ConfigError as error:
    raise ConfigError(f"{workdir} holds a run of another kind than {task!r} ({error}).") from None


def previous_run(workdir: str | pathlib.Path, config_schema: type) -> Any | None:
  """The config of the run whose checkpoints `workdir` holds; None if it holds none.

  Raises:
    ConfigError: if the checkpoints are of a run of another task kind.
  """
  checkpoints = pathlib.Path(workdir) / CHECKPOINT_DIR
  if not checkpoints.is_dir() or not any(path.name.isdigit() for path in checkpoints.iterdir()):
    return None
  return saved_config(workdir, config_schema)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def check_same_run(workdir: str | pathlib.Path, previous: Any, config: Any,
                   sections: Sequence[str]) -> None:
  """Refuses to resume the checkpoints of a run with other `sections` values.

  Raises:
    ConfigError: naming the keys whose values differ.
  """
  old, new = (_flatten({key: schema.to_dict(c)[key] for key in sections}) for c in (previous, config))
  changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
  if changed:
    raise ConfigError(
        f"{workdir} holds checkpoints of a run with other values of {', '.join(changed)}; "
        "resume it with its own config or train in another workdir."
    )


def check_same_schedule(workdir: str | pathlib.Path, what: str, before: int, after: int, unit: str,
                        keys: str) -> None:
  """Refuses to resume a run whose learning rate decays to 0 over its length with another length.

  A schedule that reaches 0 at the last step is stretched by a longer run: resumed, the learning
  rate would jump back up from its last value (and a shorter one would jump down).

  Args:
    workdir: the run's directory.
    what: the schedule, e.g. "cosine learning-rate schedule".
    before: the length of the saved run.
    after: the length the new config asks for.
    unit: what the lengths count, e.g. "steps".
    keys: the config keys that set the length.

  Raises:
    ConfigError: if the lengths differ, saying how to train longer.
  """
  if before != after:
    raise ConfigError(
        f"{workdir} holds checkpoints of a run whose {what} reaches 0 after {before} {unit}; "
        f"resuming it with {after} {unit} would stretch the schedule and move the learning rate "
        f"away from where it stopped. Resume it with its own {keys}, or train for {after} {unit} "
        "in another workdir."
    )


class Workdir:
  """A run's directory opened for training: `config.yaml` written, its checkpoints, its wall time.

  Opening writes the resolved config to `config.yaml` and drops the records of `metrics.jsonl`
  logged after the latest checkpoint, which the run continues from. Check the config first
  (`previous_run`, `check_same_run`): nothing is written before.

  Args:
    path: the run's directory; created if needed.
    config: the run's validated config.
    started: when this session of the run started (`time.perf_counter()`), before it built its
      model and data; default now.

  Attributes:
    path: the run's directory.
    start: the step of the latest checkpoint, which `restore` restores; 0 for a new run.
  """

  def __init__(self, path: str | pathlib.Path, config: Any, started: float | None = None):
    self._session_start = time.perf_counter() if started is None else started
    self._wall_before = 0.0
    self.path = pathlib.Path(path)
    self.path.mkdir(parents=True, exist_ok=True)
    if is_primary():
      (self.path / CONFIG_FILE).write_text(schema.to_yaml(config))
    self.checkpoints = Checkpoints(self.path / CHECKPOINT_DIR, config.train.keep_checkpoints)
    self.start = self.checkpoints.latest_step() or 0
    metrics.truncate(self.metrics, self.start)

  @property
  def metrics(self) -> pathlib.Path:
    """The `metrics.jsonl` file."""
    return self.path / METRICS_FILE

  def restore(self, template: Any) -> tuple[Any, dict[str, Any]]:
    """The state and progress of the checkpoint at `start`; `(template, {})` for a new run.

    Args:
      template: the initial state, whose structure, shapes, dtypes and shardings the restored
        one takes.
    """
    if not self.start:
      return template, {}
    state, progress = self.checkpoints.restore(template, self.start)
    self._wall_before = progress["wall_seconds"]
    return state, progress

  def wall_seconds(self) -> float:
    """Seconds of training over every session of the run."""
    return self._wall_before + time.perf_counter() - self._session_start

  def save(self, step: int, state: Any, progress: dict[str, Any]) -> None:
    """Saves a checkpoint of `state` at `step`, with `progress` and the wall time so far."""
    self.checkpoints.save(step, state, {**progress, "wall_seconds": self.wall_seconds()})

  def finish(self, summary: dict[str, Any], panels: Sequence[metrics.Panel], *, x: str = "step",
             xlabel: str = "step") -> None:
    """Writes `summary.json`, and `curves.png` from `metrics.jsonl` (see `metrics.plot_curves`)."""
    metrics.write_summary(self.path / SUMMARY_FILE, summary)
    metrics.plot_curves(metrics.read(self.metrics), self.path / CURVES_FILE, panels, x=x, xlabel=xlabel)

  def close(self) -> None:
    """Waits for pending checkpoint saves."""
    self.checkpoints.close()

  def __enter__(self) -> Workdir:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()


def restore(workdir: str | pathlib.Path, template: Any, step: int | None = None, *,
            parts: Sequence[tuple[str, ...]] | None = None) -> tuple[int, Any]:
  """A checkpoint of a workdir, without opening it for training.

  Args:
    workdir: the run's directory.
    template: a state with the saved structure, shapes, dtypes and shardings.
    step: the checkpoint's step; default the latest.
    parts: read only these parts of the state (`Checkpoints.restore`), e.g. the model's
      variables without the optimizer's moments; None: the whole state.

  Returns:
    `(step, state)`.

  Raises:
    FileNotFoundError: if `workdir` holds no checkpoint, or none of `step`.
  """
  directory = pathlib.Path(workdir) / CHECKPOINT_DIR
  if not directory.is_dir():
    raise FileNotFoundError(f"{workdir} has no {CHECKPOINT_DIR}; is it the workdir of a training run?")
  checkpoints = Checkpoints(directory, keep=None)
  try:
    step = checkpoints.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"{directory} holds no checkpoint.")
    state, _ = checkpoints.restore(template, step, parts=parts)
  finally:
    checkpoints.close()
  return step, state
