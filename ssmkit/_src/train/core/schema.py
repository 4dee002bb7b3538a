"""Config files: reading YAML (a path or a shipped config), filling a schema, checking values.

A schema is a tree of dataclasses whose sections hold typed, commented fields; every task kind
has one. This module knows none of them: it fills any schema from YAML and `key=value`
overrides, and checks fields against the choices and ranges a task kind gives it.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.resources
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ssmkit._src.train.core.errors import ConfigError

_Schema = TypeVar("_Schema")

# The field of every schema that declares its task kind.
TASK_KEY = "task"


def shipped_directory() -> importlib.resources.abc.Traversable:
  """The folder of the configs shipped inside the package (`configs/` links to it)."""
  return importlib.resources.files("ssmkit") / "configs"


def shipped_names() -> list[str]:
  """The names of the shipped configs, sorted, without ".yaml"."""
  return sorted(
      entry.name.removesuffix(".yaml") for entry in shipped_directory().iterdir()
      if entry.name.endswith(".yaml")
  )


def read_yaml(path: str | pathlib.Path) -> dict[str, Any]:
  """The mapping a YAML config file holds; `path` may also name a shipped config.

  Raises:
    FileNotFoundError: if `path` is neither a file nor a shipped config; the message lists them.
    ConfigError: if the file is not YAML or does not hold a mapping.
  """
  file = pathlib.Path(path)
  if not file.is_file():
    if str(path) not in shipped_names():
      raise FileNotFoundError(
          f"config {str(path)!r} is neither a file nor a shipped config; the shipped configs are "
          f"{', '.join(shipped_names())} (`ssmkit configs` describes them)."
      )
    file = shipped_directory() / f"{path}.yaml"
  try:
    content = yaml.safe_load(file.read_text())
  except yaml.YAMLError as error:
    raise ConfigError(f"config file {str(path)!r} is not valid YAML: {error}") from None
  if not isinstance(content, dict | None):
    raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(content).__name__}.")
  return content or {}


def declared_task(schema: type) -> str:
  """The task kind a schema is for: the default of its `task` field."""
  return next(f.default for f in dataclasses.fields(schema) if f.name == TASK_KEY)


def _config_error(error: OmegaConfBaseException) -> ConfigError:
  key = getattr(error, "full_key", None)
  message = str(error).splitlines()[0]
  return ConfigError(f"config key `{key}`: {message}" if key else f"config: {message}")


def check_overrides(overrides: Sequence[str]) -> None:
  """Raises a ConfigError naming an override that is not of the form key=value."""
  for override in overrides:
    if "=" not in override:
      raise ConfigError(f"override {override!r} must have the form key=value.")


def merge(schema: type[_Schema], content: Mapping[str, Any], overrides: Sequence[str]) -> _Schema:
  """An instance of the dataclass `schema` filled from `content`, then from `key=value` overrides.

  Override values are parsed as YAML ("null", "true", "1e-3"); dict fields are merged key by key.

  Raises:
    ConfigError: for a malformed override, an unknown key, a value of the wrong type or a
      missing mandatory value; the message names the key.
  """
  check_overrides(overrides)
  try:
    structured = OmegaConf.structured(schema)
    content, overrides = _replacing(structured, content, overrides)
    dotlist = OmegaConf.from_dotlist(list(overrides))
    return OmegaConf.to_object(OmegaConf.merge(structured, content, dotlist))
  except OmegaConfBaseException as error:
    raise _config_error(error) from None


def _kwargs_of(field: str) -> str:
  """The dict field of a section that holds the keyword arguments of the choice in `field`."""
  return "kwargs" if field == "name" else f"{field}_kwargs"


def _replacing(structured: DictConfig, content: Mapping[str, Any], overrides: Sequence[str]
               ) -> tuple[dict[str, Any], list[str]]:
  """`content` and `overrides` where an override replaces a dict instead of merging into it.

  Dict fields merge key by key, with two exceptions. An override that sets one whole
  (`model.layer_kwargs={}` or `=null`) replaces the content's. An override that changes the
  choice such a dict belongs to (`model.layer` for `model.layer_kwargs`, a section's `name`
  for its `kwargs`) drops the content's arguments, which were the old choice's: the new layer
  or dataset starts from its own defaults, plus the arguments overridden with it.
  """
  content = copy.deepcopy(dict(content))
  kept = []
  for override in overrides:
    key, _, text = override.partition("=")
    *path, field = key.split(".")
    section = content
    for name in path:
      section = section.get(name) if isinstance(section, dict) else None
    value = yaml.safe_load(text) if text else None
    if isinstance(OmegaConf.select(structured, key, default=None), DictConfig):
      if isinstance(section, dict) and isinstance(value, dict | None):
        section.pop(field, None)
      if value is None:
        override = f"{key}={{}}"
    elif isinstance(section, dict) and _kwargs_of(field) in section:
      before = section.get(field, OmegaConf.select(structured, key, default=None))
      if value != before:
        section.pop(_kwargs_of(field))
    kept.append(override)
  return content, kept


def get_field(config: Any, key: str) -> Any:
  """The value of the field `key` ("section.name", or "name" at the top) of a config."""
  for name in key.split("."):
    config = getattr(config, name)
  return config


def check_values(config: Any, choices: Mapping[str, Sequence[Any]], minimums: Mapping[str, float],
                 positive: Sequence[str] = ()) -> None:
  """Checks fields against their choices, their minimums and (`positive`) > 0; None passes a range.

  A field typed to hold a list (as `model.layer` may) passes its choices with a non-empty list
  of them.

  Raises:
    ConfigError: naming the first field (or list entry) with a value outside its choices or range.
  """
  for key, allowed in choices.items():
    value = get_field(config, key)
    if isinstance(value, list):
      if not value:
        raise ConfigError(f"`{key}` must be one of {tuple(allowed)} or a non-empty list of them, "
                          "got [].")
      for i, entry in enumerate(value):
        if entry not in allowed:
          raise ConfigError(f"`{key}[{i}]` must be one of {tuple(allowed)}, got {entry!r}.")
    elif value not in allowed:
      raise ConfigError(f"`{key}` must be one of {tuple(allowed)}, got {value!r}.")
  for key, minimum in minimums.items():
    value = get_field(config, key)
    if value is not None and value < minimum:
      raise ConfigError(f"`{key}` must be >= {minimum}, got {value}.")
  for key in positive:
    value = get_field(config, key)
    if value is not None and value <= 0:
      raise ConfigError(f"`{key}` must be > 0, got {value}.")


def to_dict(config: Any) -> dict[str, Any]:
  """`config` as nested plain dicts, e.g. for JSON."""
  return dataclasses.asdict(config)


def to_yaml(config: Any) -> str:
  """`config` as YAML text that reads back into the same config."""
  return OmegaConf.to_yaml(OmegaConf.structured(config))
