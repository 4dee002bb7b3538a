"""Task kinds: what a config's declared `task` means, and the entry points that dispatch on it.

Every config declares its task kind (`task: ppo`; a config that declares none is supervised). A
kind is one `TaskKind` in `TASKS`: its schema and checks, and its train, evaluate and load
functions, all from its own package (`supervised/`, `ppo/`). `load_config`, `train_and_evaluate`,
`evaluate`, `load` and the command line look the kind up here, and nowhere else.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import yaml

from ssmkit._src.train.core import schema
from ssmkit._src.train.core import workdir as workdirs
from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.lm import config as lm_config
from ssmkit._src.train.lm import train as lm_train
from ssmkit._src.train.ppo import config as ppo_config
from ssmkit._src.train.ppo import train as ppo_train
from ssmkit._src.train.supervised import config as supervised_config
from ssmkit._src.train.supervised import train as supervised_train


@dataclasses.dataclass(frozen=True)
class TaskKind:
  """A kind of training run: its config schema and the functions that run it.

  Attributes:
    name: what a config declares as `task`.
    description: one line on what it trains.
    schema: the config dataclass; its `task` field defaults to `name`.
    validate: checks a filled config and returns it; raises `ConfigError`.
    choices: each string field with the values it may take (for the config reference).
    minimums: each numeric field with its smallest value (for the config reference).
    positive: each numeric field that must be > 0 (for the config reference).
    train_and_evaluate: `(config, workdir, *, hooks=()) -> summary`.
    evaluate: `(workdir, step=None) -> results`: "step", then counts, then `metric`.
    load: `(workdir, step=None) -> (model, variables, config)`.
    metric: the headline result of a summary and of an evaluation, which `ssmkit train` and
      `ssmkit eval` print last.
    check_overrides: `(config, keys)`: refuses, as a `ConfigError`, override keys that the
      validated config ignores (an lm run's `model` fields that `model.pretrained` replaces).
  """

  name: str
  description: str
  schema: type
  validate: Callable[[Any], Any]
  choices: Mapping[str, Sequence[str]]
  minimums: Mapping[str, float]
  positive: Sequence[str]
  train_and_evaluate: Callable[..., dict[str, Any]]
  evaluate: Callable[..., dict[str, Any]]
  load: Callable[..., tuple[Any, Any, Any]]
  metric: str
  check_overrides: Callable[[Any, Sequence[str]], None] = lambda config, keys: None


TASKS: dict[str, TaskKind] = {
    kind.name: kind
    for kind in (
        TaskKind(
            name="supervised",
            description="a SequenceModel on an ssmkit.data dataset, cross-entropy on its labels",
            schema=supervised_config.Config,
            validate=supervised_config.validate,
            choices=supervised_config.CHOICES,
            minimums=supervised_config.MINIMUMS,
            positive=supervised_config.POSITIVE,
            train_and_evaluate=supervised_train.train_and_evaluate,
            evaluate=supervised_train.evaluate,
            load=supervised_train.load,
            metric="test_accuracy",
        ),
        TaskKind(
            name="lm",
            description="a SequenceModel language model on packed documents of text, in bits per byte",
            schema=lm_config.LMConfig,
            validate=lm_config.validate,
            choices=lm_config.CHOICES,
            minimums=lm_config.MINIMUMS,
            positive=lm_config.POSITIVE,
            train_and_evaluate=lm_train.train_and_evaluate,
            evaluate=lm_train.evaluate,
            load=lm_train.load,
            metric="test_bits_per_byte",
            check_overrides=lm_config.check_overrides,
        ),
        TaskKind(
            name="ppo",
            description="a recurrent SequenceModel policy with PPO on a gymnax environment",
            schema=ppo_config.PPOConfig,
            validate=ppo_config.validate,
            choices=ppo_config.CHOICES,
            minimums=ppo_config.MINIMUMS,
            positive=ppo_config.POSITIVE,
            train_and_evaluate=ppo_train.train_and_evaluate,
            evaluate=ppo_train.evaluate,
            load=ppo_train.load,
            metric="mean_episode_return",
        ),
    )
}
# The kind of a config that declares none.
DEFAULT_TASK = "supervised"


def _kind(name: Any) -> TaskKind:
  if name not in TASKS:
    raise ConfigError(f"`task` must be one of {tuple(TASKS)}, got {name!r}.")
  return TASKS[name]


def task_kind(config: Any) -> TaskKind:
  """The task kind whose schema `config` is an instance of.

  Raises:
    TypeError: if `config` is no task kind's config.
  """
  for kind in TASKS.values():
    if type(config) is kind.schema:
      return kind
  schemas = ", ".join(kind.schema.__name__ for kind in TASKS.values())
  raise TypeError(f"`config` must be a task kind's config ({schemas}), got {type(config).__name__}.")


def _declared_task(content: Mapping[str, Any], overrides: Sequence[str]) -> Any:
  """The `task` that `overrides` set last, else the one `content` declares, else the default."""
  task = content.get(schema.TASK_KEY, DEFAULT_TASK)
  for override in overrides:
    key, _, value = override.partition("=")
    if key == schema.TASK_KEY:
      task = yaml.safe_load(value)
  return task


def _check_sections(kind: TaskKind, content: Mapping[str, Any], keys: Sequence[str]) -> None:
  """Names the task kind of a section that belongs to another kind's schema than `kind`'s."""
  own = {field.name for field in dataclasses.fields(kind.schema)}
  sections = set(content) | {key.split(".")[0] for key in keys}
  for section in sorted(sections - own):
    owner = next((other.name for other in TASKS.values()
                  if section in {field.name for field in dataclasses.fields(other.schema)}), None)
    if owner is not None:
      raise ConfigError(
          f"config key `{section}` is a section of `task: {owner}` configs, and this config's task is "
          f"{kind.name!r}; declare `task: {owner}` to train that kind."
      )


def load_config(path: str | pathlib.Path | None = None, overrides: Sequence[str] = ()) -> Any:
  """The config of a YAML file, with dotted `key=value` overrides applied on top.

  The config's declared `task` picks the schema: "supervised" (the default) makes a
  `ssmkit.train.Config`, "ppo" a `ssmkit.train.ppo.PPOConfig`.

  Args:
    path: a YAML file with the sections of its task's schema, or the name of a shipped config
      (`shipped_configs()`, e.g. "mnist1d_lru"); None starts from the defaults.
    overrides: strings like "train.steps=100" or "model.layer_kwargs.d_state=32", applied in order;
      values are parsed as YAML ("null", "true", "1e-3"); the dict fields (`data.kwargs`,
      `env.kwargs`, `model.layer_kwargs`) are merged key by key, except that one set whole
      replaces the file's, and one whose choice changes (`model.layer=mamba`, `data.name`)
      drops the file's arguments of the old choice.

  Returns:
    The merged and validated config.

  Raises:
    FileNotFoundError: if `path` is neither a file nor a shipped config.
    ConfigError: for an unknown task or key, a value of the wrong type, a missing mandatory value
      (`data.name`, `env.name`), a value out of range, or an override that the config ignores
      (with `model.pretrained`, the `model` fields its checkpoint replaces); the message names
      the key.

  Examples:
    >>> config = load_config(None, ["data.name=mnist1d", "train.steps=100"])
    >>> config.train.steps, config.model.layer
    (100, 'lru')
  """
  content = schema.read_yaml(path) if path is not None else {}
  schema.check_overrides(overrides)
  kind = _kind(_declared_task(content, overrides))
  keys = [override.partition("=")[0] for override in overrides]
  _check_sections(kind, content, keys)
  config = kind.validate(schema.merge(kind.schema, content, overrides))
  kind.check_overrides(config, keys)
  return config


def shipped_configs(task: str | None = None) -> list[str]:
  """The names of the configs shipped with ssmkit, which `load_config` accepts in place of a path.

  Args:
    task: a task kind (a key of `TASKS`) for the configs of that kind only; None for all.
  """
  names = schema.shipped_names()
  if task is None:
    return names
  _kind(task)
  return [name for name in names if _declared_task(schema.read_yaml(name), ()) == task]


def describe_config(name: str) -> str:
  """The first line of a shipped config's opening comment: what it trains."""
  text = (schema.shipped_directory() / f"{name}.yaml").read_text()
  return text.splitlines()[0].removeprefix("#").strip() if text.startswith("#") else ""


def workdir_task(workdir: str | pathlib.Path) -> TaskKind:
  """The task kind of the run in `workdir`, as its `config.yaml` declares it.

  Raises:
    FileNotFoundError: if `workdir` has no `config.yaml`.
    ConfigError: if it declares an unknown task.
  """
  path = pathlib.Path(workdir) / workdirs.CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{workdir} has no {path.name}; is it the workdir of a training run?")
  return _kind(_declared_task(schema.read_yaml(path), ()))


def train_and_evaluate(config: Any, workdir: str | pathlib.Path, *,
                       hooks: Sequence[Callable[[int], None]] = ()) -> dict[str, Any]:
  """Trains the run `config` describes in `workdir`, resuming there, and evaluates it.

  The config's task kind does the work: `ssmkit.train.supervised.train_and_evaluate` or
  `ssmkit.train.ppo.train_and_evaluate`, whose docstrings list the workdir's files and the
  summary's keys.

  Args:
    config: a config from `load_config` (or a task kind's schema, filled in).
    workdir: the run's directory; created if needed.
    hooks: functions called with the step reached after every jitted call of steps.

  Returns:
    The summary written to `summary.json`.

  Raises:
    ConfigError: for a config that does not fit its data, environment or devices, or a workdir
      that is a file or holds another run; raised before anything is written.
    Interrupted: after saving a checkpoint on SIGINT or SIGTERM; the same call resumes.
  """
  kind = task_kind(config)
  if pathlib.Path(workdir).exists() and not pathlib.Path(workdir).is_dir():
    raise ConfigError(f"the workdir {str(workdir)!r} is a file; name a directory (new or of this run).")
  return kind.train_and_evaluate(config, workdir, hooks=hooks)


def evaluate(workdir: str | pathlib.Path, step: int | None = None) -> dict[str, Any]:
  """Evaluates a checkpoint of a workdir as its run's final evaluation does.

  Args:
    workdir: the directory of a `train_and_evaluate` run.
    step: the checkpoint's step; default the latest.

  Returns:
    "step" and the results of the run's task kind, its headline metric last (e.g. supervised:
    "test_examples", "test_loss", "test_accuracy").

  Raises:
    FileNotFoundError: if `workdir` has no config, or no checkpoint (of `step`).
  """
  return workdir_task(workdir).evaluate(workdir, step)


def load(workdir: str | pathlib.Path, step: int | None = None) -> tuple[Any, dict[str, Any], Any]:
  """The trained model of a workdir: `(model, variables, config)`.

  `model` is the `ssmkit.layers.SequenceModel` the run trained, `variables` its variables at the
  checkpoint (`{"params"}`, and "batch_stats" with BatchNorm), `config` the run's config.
  `model.apply(variables, x)` runs it in evaluation mode (dropout off, BatchNorm on its running
  averages) on inputs like the dataset's, e.g. `ssmkit.data.mnist1d().x_test`.

  Args:
    workdir: the directory of a `train_and_evaluate` run.
    step: the checkpoint's step; default the latest.

  Raises:
    FileNotFoundError: if `workdir` has no config, or no checkpoint (of `step`).
  """
  return workdir_task(workdir).load(workdir, step)
