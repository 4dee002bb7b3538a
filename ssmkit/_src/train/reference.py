"""The config reference of docs/training.md, generated from the schemas so that it cannot drift.

Each field's text is the comment above it in its dataclass; its type and default come from the
field, its choices and minimum from the task kind's checks. `python -m ssmkit._src.train.reference
docs/training.md` rewrites the reference between the markers of that file; a test compares them.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re
import sys
from typing import Any

from omegaconf import MISSING

from ssmkit._src.train.registry import TASKS, TaskKind

BEGIN = "<!-- config reference: `python -m ssmkit._src.train.reference docs/training.md` writes it -->"
END = "<!-- end of config reference -->"

_FIELD = re.compile(r"^  (\w+): ")


def field_comments(cls: type) -> dict[str, str]:
  """The comment lines right above each field of a dataclass (and its bases), joined."""
  comments: dict[str, str] = {}
  for klass in reversed(cls.__mro__[:-1]):
    if not dataclasses.is_dataclass(klass):
      continue
    pending: list[str] = []
    for line in inspect.getsource(klass).splitlines():
      stripped = line.strip()
      if line.startswith("  #"):
        pending.append(stripped.removeprefix("#").strip())
      elif match := _FIELD.match(line):
        if pending:
          comments[match.group(1)] = " ".join(pending)
        pending = []
      elif stripped:
        pending = []
  return comments


def _default(field: dataclasses.Field) -> str:
  if field.default_factory is not dataclasses.MISSING:
    value: Any = field.default_factory()
  else:
    value = field.default
  if value == MISSING:
    return "required"
  if value is None:
    return "`null`"
  if isinstance(value, bool):
    return f"`{str(value).lower()}`"
  return f"`{value}`"


def _table(kind: TaskKind, cls: type, fields: list[dataclasses.Field], prefix: str) -> list[str]:
  comments = field_comments(cls)
  rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
  for field in fields:
    key = f"{prefix}{field.name}"
    text = comments[field.name]
    if key in kind.choices:
      text += " One of: " + ", ".join(f"`{choice}`" for choice in kind.choices[key]) + "."
    if key in kind.minimums:
      text += f" At least {kind.minimums[key]}."
    if key in kind.positive:
      text += " Greater than 0."
    type_name = field.type.replace("|", "\\|")  # A pipe in a table cell, even in code, is escaped.
    rows.append(f"| `{key}` | `{type_name}` | {_default(field)} | {text} |")
  return [*rows, ""]



def config_reference() -> str:
  """The reference of every task kind's config: one table per section, in Markdown."""
  lines = []
  for kind in TASKS.values():
    fields = dataclasses.fields(kind.schema)
    # The sections: the fields whose defaults are dataclasses.
    sections = {f.name: f.default_factory for f in fields
                if dataclasses.is_dataclass(f.default_factory) and isinstance(f.default_factory, type)}
    lines += [f"### `task: {kind.name}`: {kind.description}", ""]
    lines += _table(kind, kind.schema, [f for f in fields if f.name not in sections], "")
    for name, cls in sections.items():
      lines += [f"`{name}`: {inspect.getdoc(cls).splitlines()[0]}", ""]
      lines += _table(kind, cls, list(dataclasses.fields(cls)), f"{name}.")
  return "\n".join(lines)


def rewrite(path: pathlib.Path) -> None:
  """Replaces the text between `BEGIN` and `END` in `path` with `config_reference()`."""
  text = path.read_text()
  head, rest = text.split(BEGIN)
  _, tail = rest.split(END)
  path.write_text(f"{head}{BEGIN}\n\n{config_reference()}\n{END}{tail}")


if __name__ == "__main__":
  rewrite(pathlib.Path(sys.argv[1]))
