"""A Hugging Face checkpoint directory: its `config.json` and its safetensors weights.

A directory holds `config.json` and either one `model.safetensors` or shards listed by
`model.safetensors.index.json`. Weights are read by `safetensors` into NumPy arrays (bfloat16
ones included; float8 ones, which its NumPy reader does not know, from the file's header and
bytes), each named by its tensor name; every error names the file and tensor.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# The float8 dtypes of safetensors, by the names its header gives them.
FLOAT8 = {"F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2, "F8_E8M0": jnp.float8_e8m0fnu}


class CheckpointError(ValueError):
  """A checkpoint that ssmkit cannot load exactly: the message names the file, tensor or field."""


def read_config(directory: pathlib.Path) -> dict[str, Any]:
  """The `config.json` of `directory`.

  Raises:
    CheckpointError: naming the file when it is missing or not a JSON object.
  """
  path = directory / CONFIG
  if not path.is_file():
    raise CheckpointError(f"{path} does not exist: a Hugging Face checkpoint directory holds "
                          f"{CONFIG} beside its weights.")
  try:
    config = json.loads(path.read_text())
  except json.JSONDecodeError as error:
    raise CheckpointError(f"{path} is not JSON: {error}.") from None
  if not isinstance(config, dict):
    raise CheckpointError(f"{path} must hold a JSON object, got {type(config).__name__}.")
  return config


def read_weights(directory: pathlib.Path) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint in `directory`, by name: one file or the shards of an index.

  Raises:
    CheckpointError: naming the file when there are no weights, an index names a missing
      shard, or a file is not safetensors.
  """
  index = directory / INDEX
  if index.is_file():
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, Mapping):
      raise CheckpointError(f"{index} has no `weight_map` object.")
    files = sorted(set(weight_map.values()))
  elif (directory / SINGLE).is_file():
    files = [SINGLE]
  else:
    raise CheckpointError(f"{directory} holds neither {SINGLE} nor {INDEX}: no weights to load "
                          "(ssmkit reads safetensors, not PyTorch .bin files).")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    path = directory / name
    if not path.is_file():
      raise CheckpointError(f"{index} lists the shard {name}, which {directory} does not hold.")
    try:
      tensors.update(_read(path))
    except Exception as error:  # safetensors raises its own error types for bad files
      raise CheckpointError(f"{path} cannot be read as safetensors: {error}.") from None
  return tensors


def _read(path: pathlib.Path) -> dict[str, np.ndarray]:
  """The tensors of one safetensors file."""
  from safetensors import safe_open

  with safe_open(str(path), framework="numpy") as file:
    names = list(file.keys())
    float8 = {name for name in names if file.get_slice(name).get_dtype() in FLOAT8}
    tensors = {name: file.get_tensor(name) for name in names if name not in float8}
  if float8:
    with path.open("rb") as file:  # 8 bytes of header size, the JSON header, then the data
      size = int.from_bytes(file.read(8), "little")
      header = json.loads(file.read(size))
      for name in float8:
        start, stop = header[name]["data_offsets"]
        file.seek(8 + size + start)
        tensors[name] = np.frombuffer(file.read(stop - start), FLOAT8[header[name]["dtype"]]
                                      ).reshape(header[name]["shape"])
  return tensors


class Tensors:
  """The tensors of one checkpoint, taken one by one with their expected shapes.

  Attributes:
    source: the directory, for error messages.
  """

  def __init__(self, tensors: dict[str, Any], source: pathlib.Path, *,
               ignored: tuple[str, ...] = (), renamed: tuple[str, str] | None = None):
    """Holds `tensors` but those named with a prefix of `ignored`, each renamed by `renamed`,
    (old prefix, new prefix), where its name starts with the old one."""
    self._renamed = renamed or ("", "")
    kept = [name for name in tensors if not (ignored and name.startswith(ignored))]
    self._names = {_swap(name, *self._renamed): name for name in kept}
    self._tensors = {new: tensors[name] for new, name in self._names.items()}
    self.source = source

  def _stored(self, name: str) -> str:
    """The name under which the checkpoint stores (or would store) the tensor `name`."""
    old, new = self._renamed
    return self._names.get(name, _swap(name, new, old))

  def take(self, name: str, shape: tuple[int, ...] | None) -> np.ndarray:
    """The tensor `name` as float32, checked to have `shape` (None: the caller checks it).

    Raises:
      CheckpointError: naming the tensor when it is missing or of another shape.
    """
    if name not in self._tensors:
      raise CheckpointError(f"{self.source}: the weight {self._stored(name)!r} is missing.")
    value = self._tensors.pop(name)
    if shape is not None and tuple(value.shape) != tuple(shape):
      raise CheckpointError(f"{self.source}: the weight {self._stored(name)!r} has shape "
                            f"{tuple(value.shape)}, expected {tuple(shape)}.")
    return np.asarray(value, np.float32)

  def has(self, name: str) -> bool:
    return name in self._tensors

  def finish(self) -> None:
    """Raises `CheckpointError` naming the tensors that no parameter took."""
    if self._tensors:
      raise CheckpointError(f"{self.source}: weights that ssmkit's model has no place for: "
                            f"{sorted(map(self._stored, self._tensors))}.")


def _swap(name: str, old: str, new: str) -> str:
  """`name` with its prefix `old` replaced by `new` (unchanged without that prefix)."""
  return new + name[len(old):] if old and name.startswith(old) else name
