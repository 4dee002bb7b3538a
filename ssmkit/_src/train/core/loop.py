"""`train_and_evaluate` and `evaluate`: a training run in a workdir that survives interruption.

A workdir holds `config.yaml` (the resolved config), `checkpoints/`, `metrics.jsonl`,
`summary.json` and `curves.png`. Running again in the same workdir resumes from the latest
checkpoint: the train state and the data order's position are restored and the dropout keys are
derived from the step, so the resumed run continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ssmkit import data
from ssmkit._src.train import metrics, parallel
from ssmkit._src.train.batches import TrainBatches, eval_batches, split_arrays
from ssmkit._src.train.checkpoint import Checkpoints
from ssmkit._src.train.config import Config, DataConfig, to_dict, validate
from ssmkit._src.train.errors import ConfigError, Interrupted
from ssmkit._src.train.interrupt import stop_requests
from ssmkit._src.train.model import build_model, count_parameters
from ssmkit._src.train.optim import learning_rate_schedule, make_optimizer
from ssmkit._src.train.steps import TrainState, create_train_state, eval_step, mean_metrics, train_step
from ssmkit._src.train.workdir import (
  CURVES_FILE,
  METRICS_FILE,
  SUMMARY_FILE,
  restore_latest,
  start_or_resume,
)


@dataclasses.dataclass
class _Run:
  """What a config builds: the data, the devices, the initial state and the length of the run."""

  dataset: data.SequenceDataset
  mesh: Mesh
  train_batches: TrainBatches
  eval_batches: list[dict[str, np.ndarray]]
  total_steps: int
  state: TrainState
  dropout_key: jax.Array


def _load_dataset(config: DataConfig) -> data.SequenceDataset:
  try:
    return data.load(config.name, **config.kwargs)
  except (TypeError, ValueError) as error:
    raise ConfigError(
        f"cannot load `data.name`={config.name!r} with `data.kwargs`={config.kwargs}: {error}"
    ) from error


def _check_pooling(config: Config, dataset: data.SequenceDataset) -> None:
  pooling = config.model.pooling
  if dataset.per_step and pooling != "none":
    raise ConfigError(
        f"`model.pooling` must be 'none' for {config.data.name!r}, which has one target per step; "
        f"got {pooling!r}."
    )
  if not dataset.per_step and pooling == "none":
    raise ConfigError(
        f"`model.pooling` must be 'mean' or 'last' for {config.data.name!r}, which has one label per "
        "sequence; got 'none'."
    )


def _setup(config: Config) -> _Run:
  dataset = _load_dataset(config.data)
  _check_pooling(config, dataset)
  model = build_model(config.model, dataset.num_classes, dataset.vocab_size)
  arrays = split_arrays(dataset, "train")
  train_batches = TrainBatches(arrays, config.data.batch_size, config.train.seed)
  mesh = parallel.data_mesh(config.mesh, config.data.batch_size, "data.batch_size")
  total_steps = config.train.steps or config.train.epochs * train_batches.steps_per_epoch
  tx = make_optimizer(config.optimizer, config.model.layer, total_steps)
  params_key, dropout_key = jax.random.split(jax.random.key(config.train.seed))
  example = {key: array[:1] for key, array in arrays.items()}
  state = create_train_state(model, tx, example, params_key, config.model.mode)
  return _Run(
      dataset=dataset,
      mesh=mesh,
      train_batches=train_batches,
      eval_batches=eval_batches(split_arrays(dataset, "test"), config.data.batch_size),
      total_steps=total_steps,
      state=parallel.place(state, parallel.replicated(mesh)),
      dropout_key=parallel.place(dropout_key, parallel.replicated(mesh)),
  )


def _jit_steps(mesh: Mesh) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """`train_step` and `eval_step` compiled for batches split over `mesh`, their outputs replicated."""
  replicated = parallel.replicated(mesh)
  return jax.jit(train_step, out_shardings=replicated), jax.jit(eval_step, out_shardings=replicated)


def _evaluate(step_fn: Callable[..., Any], run: _Run, state: TrainState) -> dict[str, float]:
  split = parallel.split(run.mesh)
  sums = jax.device_get([step_fn(state, parallel.place(batch, split)) for batch in run.eval_batches])
  result = mean_metrics({key: sum(s[key] for s in sums) for key in sums[0]})
  return {"test_loss": result["loss"], "test_accuracy": result["accuracy"]}


def _line(step: int, values: dict[str, float]) -> str:
  return f"step {step}: " + " ".join(f"{key}={value:.4f}" for key, value in values.items())


def train_and_evaluate(config: Config, workdir: str | pathlib.Path, *,
                       hooks: Sequence[Callable[[int], None]] = ()) -> dict[str, Any]:
  """Trains the model of `config` in `workdir` and evaluates it on the whole test split.

  Logs train metrics every `train.log_every` steps and test metrics every `train.eval_every`
  steps and after the last one to `metrics.jsonl`; saves a checkpoint every
  `train.checkpoint_every` steps, after the last one and on SIGINT/SIGTERM (then raises
  `Interrupted`). A workdir with checkpoints resumes from the latest one, dropping the metrics
  logged after it. At the end writes `summary.json` and `curves.png`.

  Args:
    config: the run's config, e.g. from `load_config`.
    workdir: the run's directory; created if needed.
    hooks: functions called with the step number after every train step.

  Returns:
    The summary: "test_accuracy", "test_loss", "steps", "wall_seconds" (over all sessions of the
    run), "params" (the number of parameters) and "config" (the config as a dict).

  Raises:
    ConfigError: for a config with values out of range or that does not fit the data, or a
      workdir holding another run.
    Interrupted: after saving a checkpoint on SIGINT or SIGTERM.
  """
  validate(config)
  return start_or_resume(
      config, workdir, sections=("data", "model"), setup=_setup,
      train=lambda workdir, run, state, checkpoints, wall_seconds: _train(
          config, workdir, run, state, checkpoints, hooks, wall_seconds),
      restore=lambda run, progress: run.train_batches.restore(progress["data"]),
  )


def _train(config: Config, workdir: pathlib.Path, run: _Run, state: TrainState, checkpoints: Checkpoints,
           hooks: Sequence[Callable[[int], None]], wall_seconds: Callable[[], float]) -> dict[str, Any]:
  """The train loop from `state` to `run.total_steps`, then the summary."""
  schedule = learning_rate_schedule(config.optimizer, config.optimizer.learning_rate, run.total_steps)
  metrics_path = workdir / METRICS_FILE
  step = int(state.step)
  metrics.truncate(metrics_path, step)
  num_params = count_parameters(state.params)
  batch_size = config.data.batch_size
  bar, write = metrics.console(run.total_steps, step, "train", "step")
  write(
      f"{config.model.layer} model with {num_params:,} parameters, {run.total_steps} steps of "
      f"{batch_size} sequences ({run.total_steps / run.train_batches.steps_per_epoch:.1f} epochs) "
      f"on {run.mesh.size} {run.mesh.devices.flat[0].platform} device(s)"
      + (f", resuming from step {step}" if step else "")
  )
  train_step_fn, eval_step_fn = _jit_steps(run.mesh)
  split = parallel.split(run.mesh)
  test = None
  pending, log_step, log_time = [], step, time.perf_counter()
  with stop_requests() as stop, bar:
    while step < run.total_steps:
      batch = parallel.place(next(run.train_batches), split)
      state, sums = train_step_fn(state, batch, run.dropout_key)
      step += 1
      pending.append(sums)
      bar.update()
      last = step == run.total_steps
      record: dict[str, Any] = {}
      if step % config.train.log_every == 0 or last:
        pending = jax.device_get(pending)  # Waits for the steps, so `now` is when they ended.
        now = time.perf_counter()
        train = mean_metrics({key: sum(s[key] for s in pending) for key in pending[0]})
        record.update(
            loss=train["loss"],
            accuracy=train["accuracy"],
            learning_rate=float(schedule(step - 1)),
            examples_per_second=(step - log_step) * batch_size / (now - log_time),
        )
        bar.set_postfix(loss=f"{train['loss']:.4f}", accuracy=f"{train['accuracy']:.4f}")
        if bar.disable:
          write(_line(step, train))
        pending, log_step, log_time = [], step, now
      if (config.train.eval_every and step % config.train.eval_every == 0) or last:
        test = _evaluate(eval_step_fn, run, state)
        record.update(test)
        write(_line(step, test))
        log_time = time.perf_counter()  # Throughput counts training only.
      if record:
        metrics.append(metrics_path, {"step": step, **record})
      for hook in hooks:
        hook(step)
      stopping = bool(stop) and not last
      if step % config.train.checkpoint_every == 0 or last or stopping:
        progress = {"data": run.train_batches.state(), "wall_seconds": wall_seconds()}
        checkpoints.save(step, state, progress)
      if stopping:
        raise Interrupted(stop.signal_name, step, str(workdir))
  if test is None:  # The run had already reached its last step.
    test = _evaluate(eval_step_fn, run, state)
    write(_line(step, test))
  summary = {
      **test,
      "steps": step,
      "wall_seconds": wall_seconds(),
      "params": num_params,
      "config": to_dict(config),
  }
  metrics.write_summary(workdir / SUMMARY_FILE, summary)
  metrics.plot_curves(metrics.read(metrics_path), workdir / CURVES_FILE)
  return summary


def evaluate(workdir: str | pathlib.Path) -> dict[str, Any]:
  """Evaluates the latest checkpoint of a `train_and_evaluate` workdir on the whole test split.

  The model and data come from the workdir's `config.yaml`.

  Args:
    workdir: the run's directory.

  Returns:
    {"step": the checkpoint's step, "test_loss", "test_accuracy", "test_examples"}.

  Raises:
    FileNotFoundError: if `workdir` has no config or no checkpoint.
  """
  step, run, state = restore_latest(workdir, Config, _setup)
  test = _evaluate(_jit_steps(run.mesh)[1], run, state)
  return {"step": step, **test, "test_examples": run.dataset.num_test}
