"""Supervised training in a workdir: `train_and_evaluate`, `evaluate` and `load`.

`train_and_evaluate` builds everything the config describes (the dataset, the devices, the model,
the optimizer, the initial state: every config error surfaces here, before anything is written),
opens the workdir (resuming from its latest checkpoint: the train state, the data order's
position; the dropout keys derive from the step), then trains in spans of steps that each run in
one jitted call on the resident data, logs, evaluates and saves as `core.loop` sets the rhythm,
and at the end writes `summary.json` and `curves.png`.
"""

from __future__ import annotations

import functools
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ssmkit import data, layers
from ssmkit._src.train.core import metrics, parallel, schema
from ssmkit._src.train.core import workdir as workdirs
from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.core.loop import Loop, Rhythm
from ssmkit._src.train.core.model import (
    TrainState,
    build_model,
    count_parameters,
    layer_names,
    variables,
)
from ssmkit._src.train.supervised.config import Config, DataConfig, TrainConfig, validate
from ssmkit._src.train.supervised.data import TrainOrder, eval_indices, split_arrays
from ssmkit._src.train.supervised.optim import learning_rate_schedule, make_optimizer
from ssmkit._src.train.supervised.steps import create_train_state, eval_steps, mean_metrics, train_steps

# What `curves.png` shows.
_PANELS = (
    metrics.Panel("loss", (("loss", "train"), ("test_loss", "test")), log_scale=True),
    metrics.Panel("accuracy", (("accuracy", "train"), ("test_accuracy", "test"))),
)


class Setup(NamedTuple):
  """What a config builds before the first step.

  Attributes:
    dataset: both splits, on the host.
    mesh: the devices.
    model: the model.
    order: the order of the train batches, at its start.
    total_steps: the run's number of steps.
    state: the initial train state, parameters and optimizer state sharded over `mesh` (or
      their shapes, dtypes and shardings, built `abstract`).
    shardings: the sharding of each part of `state`.
    dropout_key: the run's dropout key, replicated over `mesh`.
    layer_kinds: the registry names of the model's layers, in pattern order.
  """

  dataset: data.SequenceDataset
  mesh: Mesh
  model: layers.SequenceModel
  order: TrainOrder
  total_steps: int
  state: TrainState
  shardings: TrainState
  dropout_key: jax.Array
  layer_kinds: tuple[str, ...]


# A model, the registry names of its layers in pattern order, and its parameters (None: initialise).
Built = tuple[layers.SequenceModel, tuple[str, ...], Any]


def configured_model(config: Any, dataset: data.SequenceDataset, abstract: bool = False) -> Built:
  """The model of the config's `model` section for `dataset` (`build_model`), to initialise
  (so `abstract` changes nothing)."""
  del abstract
  return (build_model(config.model, dataset.num_classes, dataset.vocab_size),
          layer_names(config.model), None)


class Task(NamedTuple):
  """What a kind of run on a `SequenceDataset` adds to this trainer: its schema, its data, its results.

  Attributes:
    schema: the config dataclass, with the sections `data` (with `batch_size`), `model`,
      `optimizer`, `train` and `mesh`.
    validate: checks a filled config and returns it; raises `ConfigError`.
    dataset: the dataset of a checked config; raises `ConfigError` naming the key at fault.
    results: the test results from the dataset and the test split's mean "loss" and
      "accuracy" over its scored targets, the headline last.
    samples: `(config, setup, state) -> lines` that show the model at work, printed after
      each evaluation during training (a language model's continuations of held-out text);
      None for none.
    model: the model of a checked config and its dataset, `(config, dataset, abstract) ->
      (model, layer names, parameters)`: the parameters to start from or None to initialise
      them, with `abstract` their shapes and dtypes (`jax.ShapeDtypeStruct`s) where only those
      are needed; by default the model of the config's `model` section, initialised
      (`configured_model`).
  """

  schema: type
  validate: Callable[[Any], Any]
  dataset: Callable[[Any], data.SequenceDataset]
  results: Callable[[data.SequenceDataset, dict[str, float]], dict[str, float]]
  samples: Callable[[Any, Setup, TrainState], list[str]] | None = None
  model: Callable[[Any, data.SequenceDataset, bool], Built] = configured_model


def _load_dataset(config: DataConfig) -> data.SequenceDataset:
  try:
    return data.load(config.name, **config.kwargs)
  except (TypeError, ValueError) as error:
    raise ConfigError(
        f"cannot load `data.name`={config.name!r} with `data.kwargs`={config.kwargs}: {error}"
    ) from error


def _supervised_dataset(config: Config) -> data.SequenceDataset:
  """The dataset of `config.data`, checked against the model's pooling."""
  dataset = _load_dataset(config.data)
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
  return dataset


# Supervised runs: an `ssmkit.data` dataset by name, test loss and accuracy.
SUPERVISED = Task(
    schema=Config,
    validate=validate,
    dataset=_supervised_dataset,
    results=lambda dataset, result: {"test_loss": result["loss"], "test_accuracy": result["accuracy"]},
)


def total_steps(config: TrainConfig, steps_per_epoch: int) -> int:
  """The length of a run: `steps`, or `epochs` passes of `steps_per_epoch`."""
  return config.steps or config.epochs * steps_per_epoch


def setup(config: Any, task: Task = SUPERVISED, *, abstract: bool = False) -> Setup:
  """Builds the run of `config` (a config of `task`) up to its first step; writes nothing.

  Args:
    config: the run's config.
    task: the kind of run `config` is.
    abstract: make `state` of `jax.ShapeDtypeStruct`s with their shardings (nothing computed or
      placed on the devices), the template of a checkpoint to restore.

  Raises:
    ConfigError: for any value out of range or that does not fit the data or the devices.
  """
  task.validate(config)
  dataset = task.dataset(config)
  mesh = parallel.make_mesh(config.mesh, config.data.batch_size, "data.batch_size")
  model, names, params = task.model(config, dataset, abstract)
  order = TrainOrder(dataset.num_train, config.data.batch_size, config.train.seed)
  length = total_steps(config.train, order.steps_per_epoch)
  tx = make_optimizer(config.optimizer, names, length, model.head_blocks)
  params_key, dropout_key = jax.random.split(jax.random.key(config.train.seed))
  example = {key: array[:1] for key, array in split_arrays(dataset, "train").items()}
  _check_split_over_time(config, mesh, example["x"].shape[1])
  build = lambda params: create_train_state(model, tx, example, params_key, config.model.mode,
                                            params=params)
  state = jax.eval_shape(build, params) if abstract else build(params)
  state = state.replace(apply_fn=parallel.over_time(state.apply_fn, mesh, model.pooling == "none"))
  shardings = parallel.state_shardings(mesh, state)
  state = (parallel.shapes if abstract else parallel.place)(state, shardings)
  return Setup(dataset, mesh, model, order, length, state, shardings,
               parallel.place(dropout_key, parallel.replicated(mesh)), names)


def _check_split_over_time(config: Any, mesh: Mesh, length: int) -> None:
  """Refuses a "seq" axis that does not divide the sequences or meets BatchNorm's statistics."""
  seq = mesh.shape[parallel.SEQ_AXIS]
  if seq == 1:
    return
  if length % seq:
    raise ConfigError(f"`mesh.seq`={seq} must divide the sequence length, {length} steps.")
  if config.model.norm == "batch":
    raise ConfigError("`mesh.seq` splits the sequences over time, over which norm='batch' takes "
                      "its statistics: use `model.norm` 'layer' or 'rms'.")
  dtype = config.model.dtype
  if dtype is not None and jnp.dtype(dtype).itemsize < 4 and mesh.devices.flat[0].platform == "cpu":
    # A half-precision product differentiated inside `jax.shard_map` over part of the mesh
    # aborts the process (hlo_instruction.cc: "Invalid binary instruction opcode copy").
    raise ConfigError(f"`mesh.seq`={seq} with `model.dtype`={dtype!r} aborts XLA's CPU compiler "
                      "(jax 0.10); on CPU, split sequences over time in float32 "
                      "(`model.dtype`: null).")


class _TestSplit(NamedTuple):
  """The test split on the device and its eval batches, with the jitted `eval_steps`."""

  arrays: dict[str, jax.Array]
  indices: jax.Array
  valid: jax.Array
  eval_steps: Callable[..., dict[str, jax.Array]]


def _test_split(run: Setup, batch_size: int) -> _TestSplit:
  replicated = parallel.replicated(run.mesh)
  indices, valid = eval_indices(run.dataset.num_test, batch_size)
  arrays = split_arrays(run.dataset, "test")
  step = functools.partial(eval_steps, sharding=parallel.split(run.mesh))
  return _TestSplit(*parallel.place((arrays, indices, valid), replicated),
                    jax.jit(step, out_shardings=replicated))


def _evaluate(task: Task, run: Setup, test: _TestSplit, state: TrainState) -> dict[str, float]:
  result = mean_metrics(jax.device_get(test.eval_steps(state, test.arrays, test.indices, test.valid)))
  return task.results(run.dataset, result)


def train_and_evaluate(config: Any, workdir: str | pathlib.Path, *,
                       hooks: Sequence[Callable[[int], None]] = (),
                       task: Task = SUPERVISED) -> dict[str, Any]:
  """Trains the model of `config` in `workdir` and evaluates it on the whole test split.

  Logs train metrics every `train.log_every` steps and test metrics every `train.eval_every`
  steps and after the last one to `metrics.jsonl`; saves a checkpoint every
  `train.checkpoint_every` steps, after the last one and on SIGINT/SIGTERM (then raises
  `Interrupted`). The steps between two of these run in one jitted call. A workdir with
  checkpoints resumes from the latest one, dropping the metrics logged after it, and continues
  exactly as an uninterrupted run would. At the end writes `summary.json` and `curves.png`.

  Args:
    config: the run's config, e.g. from `load_config`.
    workdir: the run's directory; created if needed.
    hooks: functions called with the step reached after every jitted call of steps.
    task: the kind of run `config` is (its schema, data and results); supervised by default.

  Returns:
    The summary: the test results ("test_loss", "test_accuracy" for a supervised run),
    "steps", "wall_seconds" (over all sessions of the run), "params" (the number of
    parameters) and "config" (the config as a dict).

  Raises:
    ConfigError: for a config with values out of range or that does not fit the data, or a
      workdir holding another run, or this run with another length of its cosine schedule;
      raised before anything is written.
    Interrupted: after saving a checkpoint on SIGINT or SIGTERM.
  """
  started = time.perf_counter()
  previous = workdirs.previous_run(workdir, task.schema)
  # A resumed run restores its checkpoint into the state's shapes: nothing is initialised (or
  # read from a published checkpoint) only to be overwritten.
  run = setup(config, task, abstract=previous is not None)
  if previous is not None:
    workdirs.check_same_run(workdir, previous, config, ("data", "model"))
    if config.optimizer.schedule == "cosine":
      length = total_steps(previous.train, run.order.steps_per_epoch)
      workdirs.check_same_schedule(workdir, "cosine learning-rate schedule", length, run.total_steps,
                                   "steps", "`train.steps` (or `train.epochs`)")
  replicated, split = parallel.replicated(run.mesh), parallel.split(run.mesh)
  train_arrays = parallel.place(split_arrays(run.dataset, "train"), replicated)
  test = _test_split(run, config.data.batch_size)
  step_fn = jax.jit(functools.partial(train_steps, sharding=split),
                    out_shardings=(run.shardings, replicated))
  rhythm = Rhythm(run.total_steps, config.train.log_every, config.train.eval_every,
                  config.train.checkpoint_every)
  schedule = learning_rate_schedule(config.optimizer, config.optimizer.learning_rate, run.total_steps)
  batch_size = config.data.batch_size

  with workdirs.Workdir(workdir, config, started) as files:
    state, progress = files.restore(run.state)
    if progress:
      run.order.restore(progress["data"])
    num_params = count_parameters(state.params)
    header = (
        f"{'/'.join(run.layer_kinds)} model with {num_params:,} parameters, "
        f"{run.total_steps} steps of "
        f"{batch_size} sequences ({run.total_steps / run.order.steps_per_epoch:.1f} epochs) on "
        f"{parallel.describe(run.mesh)}"
    )
    evaluation = None
    shown = ("loss", "accuracy")
    with Loop(files, rhythm, header=header, unit="step", shown=shown, hooks=hooks) as loop:
      for span in loop.spans():
        indices = parallel.place(run.order.take(span.length, rhythm.max_span), replicated)
        state, sums = step_fn(state, train_arrays, indices, np.int32(span.length), run.dropout_key)
        loop.keep(sums, span.length)
        logged = None
        if span.log:
          rows, steps, seconds = loop.fetch()
          logged = {
              **mean_metrics(rows),
              "learning_rate": float(schedule(span.end - 1)),
              "examples_per_second": steps * batch_size / seconds,
              "tokens_per_second": steps * batch_size * run.dataset.sequence_length / seconds,
          }
        evaluated = _evaluate(task, run, test, state) if span.evaluate else None
        if evaluated and task.samples is not None:
          for line in task.samples(config, run, state):
            loop.write(line)
        evaluation = evaluated or evaluation
        loop.end(span, state, {"data": run.order.state()}, logged, evaluated)
      if evaluation is None:  # The run had already reached its last step.
        evaluation = _evaluate(task, run, test, state)
        loop.report(files.start, evaluation)
    summary = {
        **evaluation,
        "steps": int(state.step),
        "wall_seconds": files.wall_seconds(),
        "params": num_params,
        "config": schema.to_dict(config),
    }
    files.finish(summary, _PANELS)
  return summary


def _restore(workdir: str | pathlib.Path, step: int | None, task: Task
             ) -> tuple[Any, Setup, int, TrainState]:
  config = workdirs.saved_config(workdir, task.schema)
  run = setup(config, task, abstract=True)
  # The model's variables and step alone: the optimizer's moments, two thirds of the state
  # under AdamW, are neither read nor given memory.
  step, state = workdirs.restore(workdir, run.state, step,
                                 parts=[("params",), ("batch_stats",), ("step",)])
  return config, run, step, state.replace(opt_state=None)


def evaluate(workdir: str | pathlib.Path, step: int | None = None, *,
             task: Task = SUPERVISED) -> dict[str, Any]:
  """Evaluates a checkpoint of a `train_and_evaluate` workdir on the whole test split.

  The model and data come from the workdir's `config.yaml`.

  Args:
    workdir: the run's directory.
    step: the checkpoint's step; default the latest.
    task: the kind of run in `workdir`; supervised by default.

  Returns:
    {"step": the checkpoint's step, "test_examples", then the test results of `task`
    ("test_loss", "test_accuracy" for a supervised run)}.

  Raises:
    FileNotFoundError: if `workdir` has no config, or no checkpoint (of `step`).
    ConfigError: if `workdir` holds a run of another task kind.
  """
  config, run, step, state = _restore(workdir, step, task)
  test = _evaluate(task, run, _test_split(run, config.data.batch_size), state)
  return {"step": step, "test_examples": run.dataset.num_test, **test}


def load(workdir: str | pathlib.Path, step: int | None = None, *,
         task: Task = SUPERVISED) -> tuple[layers.SequenceModel, dict[str, Any], Any]:
  """The trained model of a `train_and_evaluate` workdir, its variables at a checkpoint, its config.

  Args:
    workdir: the run's directory.
    step: the checkpoint's step; default the latest.
    task: the kind of run in `workdir`; supervised by default.

  Returns:
    `(model, variables, config)`: `model.apply(variables, x, mask, reset)` runs in evaluation
    mode on the inputs of the config's dataset (e.g. `ssmkit.data.mnist1d(...).x_test`; the
    `reset_test` of a dataset that has them, as `text`).

  Raises:
    FileNotFoundError: if `workdir` has no config, or no checkpoint (of `step`).
    ConfigError: if `workdir` holds a run of another task kind.
  """
  config, run, _, state = _restore(workdir, step, task)
  return run.model, variables(state), config
