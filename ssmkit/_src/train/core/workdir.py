"""A run's directory: the files it holds, and starting a run there or resuming it."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from ssmkit._src.train.checkpoint import Checkpoints
from ssmkit._src.train.config import load_config, to_dict, to_yaml
from ssmkit._src.train.errors import ConfigError
from ssmkit._src.train.parallel import is_primary

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CURVES_FILE = "curves.png"


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def check_same_run(workdir: pathlib.Path, config: Any, sections: Sequence[str]) -> None:
  """Refuses to resume the checkpoints of another kind of run, or of other `sections` values.

  Raises:
    ConfigError: naming the kind of run, or the keys whose values differ.
  """
  saved = load_config(workdir / CONFIG_FILE)
  if type(saved) is not type(config):
    raise ConfigError(
        f"{workdir} holds checkpoints of another kind of run ({type(saved).__name__}, not "
        f"{type(config).__name__}); train in another workdir."
    )
  old, new = (_flatten({key: to_dict(c)[key] for key in sections}) for c in (saved, config))
  changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
  if changed:
    raise ConfigError(
        f"{workdir} holds checkpoints of a run with other values of {', '.join(changed)}; "
        "resume it with its own config or train in another workdir."
    )


def start_or_resume(
    config: Any,
    workdir: str | pathlib.Path,
    *,
    sections: Sequence[str],
    setup: Callable[[Any], Any],
    train: Callable[[pathlib.Path, Any, Any, Checkpoints, Callable[[], float]], dict[str, Any]],
    restore: Callable[[Any, dict[str, Any]], None] = lambda run, progress: None,
) -> dict[str, Any]:
  """Runs `train` in `workdir`, from the latest checkpoint there if there is one.

  Writes the resolved config to `config.yaml`, builds the run with `setup(config)` (its
  `state` attribute is the starting train state), and when a checkpoint exists restores the
  state and hands the checkpoint's progress dict to `restore`. The wall time counts every
  session of the run.

  Args:
    config: a validated config.
    workdir: the run's directory; created if needed.
    sections: the config sections a resumed run must share with the saved one.
    setup: builds the run from the config.
    train: `train(workdir, run, state, checkpoints, wall_seconds)` trains from `state` and
      returns the summary.
    restore: puts the rest of a checkpoint's progress (e.g. the data position) into the run.

  Returns:
    What `train` returns.
  """
  session_start = time.perf_counter()
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  checkpoints = Checkpoints(workdir / CHECKPOINT_DIR, config.train.keep_checkpoints)
  try:
    start = checkpoints.latest_step()
    if start is not None:
      check_same_run(workdir, config, sections)
    if is_primary():
      (workdir / CONFIG_FILE).write_text(to_yaml(config))
    run = setup(config)
    state, wall_before = run.state, 0.0
    if start is not None:
      state, progress = checkpoints.restore(run.state, start)
      restore(run, progress)
      wall_before = progress["wall_seconds"]
    return train(workdir, run, state, checkpoints,
                 lambda: wall_before + time.perf_counter() - session_start)
  finally:
    checkpoints.close()


def restore_latest(workdir: str | pathlib.Path, config_type: type, setup: Callable[[Any], Any]
                   ) -> tuple[int, Any, Any]:
  """The run of a workdir at its latest checkpoint, built from the config saved there.

  Args:
    workdir: the run's directory.
    config_type: the kind of config the caller evaluates (`Config`, `PPOConfig`).
    setup: builds the run from the config; its `state` attribute is the state template.

  Returns:
    (step, run, state) of the latest checkpoint.

  Raises:
    FileNotFoundError: if `workdir` has no config or no checkpoint.
    ConfigError: if `workdir` holds another kind of run.
  """
  workdir = pathlib.Path(workdir)
  for name in (CONFIG_FILE, CHECKPOINT_DIR):
    if not (workdir / name).exists():
      raise FileNotFoundError(f"{workdir} has no {name}; is it the workdir of a training run?")
  config = load_config(workdir / CONFIG_FILE)
  if not isinstance(config, config_type):
    raise ConfigError(
        f"{workdir} holds a {type(config).__name__} run, not a {config_type.__name__} one."
    )
  checkpoints = Checkpoints(workdir / CHECKPOINT_DIR, config.train.keep_checkpoints)
  try:
    step = checkpoints.latest_step()
    if step is None:
      raise FileNotFoundError(f"{workdir / CHECKPOINT_DIR} holds no checkpoint.")
    run = setup(config)
    state, _ = checkpoints.restore(run.state, step)
  finally:
    checkpoints.close()
  return step, run, state
