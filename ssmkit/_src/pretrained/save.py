"""`save`: an ssmkit model written as a Hugging Face checkpoint that `transformers` loads."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ssmkit._src.layers.common import check_positive_int
from ssmkit._src.layers.model import SequenceModel, layer_pattern, scanned_place, with_unrolled_blocks
from ssmkit._src.pretrained.files import CONFIG, INDEX, SINGLE, CheckpointError, read_config
from ssmkit._src.pretrained.load import (
  MODEL_TYPES,
  MODULES,
  check_tree,
  checkpoint_directory,
  variable_shapes,
)

# The architectures `save` writes, each with the layers its models are made of, in the order
# it prefers them.
WRITTEN = MODULES
# Model options at the values that most architectures have; an architecture writes others only
# where its `WRITES` names the option (Granite 4.0's and Falcon-H1's multipliers, OLMo
# Hybrid's norms after their branches).
_PLAIN = {"residual_scale": 1.0, "logits_scaling": 1.0, "mlp_scales": (1.0, 1.0),
          "norm_position": "input"}
# What `save` carries over from the checkpoint a model came from: its tokenizer's files, its
# generation settings, and the special tokens its config.json names.
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                 "generation_config.json")
CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# The most bytes of tensors `save` writes to one file, as `save_pretrained`'s default
# `max_shard_size` ("5GB"); a larger checkpoint is written in shards with an index.
SHARD_BYTES = 5 * 10**9
# The dtypes `save` writes tensors in, by the name config.json gives them.
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}


def save(model: Any, variables: Any, directory: str | pathlib.Path, *,
         source: str | pathlib.Path | None = None, architecture: str | None = None,
         dtype: Any = None, shard_bytes: int = SHARD_BYTES) -> pathlib.Path:
  """Writes `model` as `config.json` and `model.safetensors` that `transformers` loads as the
  same architecture, and `ssmkit.pretrained.load` reads back bit for bit.

  Args:
    model: a linen `SequenceModel` that an architecture of `ARCHITECTURES` expresses, as
      `ssmkit.pretrained.load` builds it (e.g. `ssmkit.layers.Mamba` blocks with
      `block="mixer"`, `norm="rms"`, `mlp="none"`: a `MambaForCausalLM`; docs/pretrained.md
      lists each); token inputs and outputs, blocks unrolled or scanned. Or its NNX twin
      (then `variables` is ignored).
    variables: the linen model's variables (`{"params": ...}`), e.g. of a trained `lm` run.
    directory: the folder to write; created if needed.
    source: where the model came from, whose tokenizer goes with it: a checkpoint folder or hub
      id (its `CARRIED_FILES` that exist are copied, e.g. `tokenizer.json` and
      `generation_config.json`, and its config.json's special token ids written), or a
      `tokenizer.json` file. `ssmkit export` passes a fine-tuning run's `model.pretrained`.
      Where more than one architecture expresses the model, the source's own is written.
    architecture: the architecture to write (an `ARCHITECTURES` name) where more than one
      expresses the model; None: the source's, else the first of `WRITTEN`.
    dtype: the tensors' dtype, a name of `DTYPES` or a NumPy / JAX dtype; None: float32, which
      `load` reads back bit for bit. bfloat16 and float16 round to nearest (even), as
      `torch.Tensor.to` does, but for the tensors that `transformers` keeps in float32 for
      this architecture (Kimi Linear's and Nemotron-H's routers, their correction biases, Kimi
      Linear's `dt_bias`), which stay float32 as its `save_pretrained` writes them.
    shard_bytes: the most bytes of tensors in one file (a larger tensor gets one to itself):
      a checkpoint of more is written as `model-00001-of-0000N.safetensors` ... with
      `model.safetensors.index.json`, as `save_pretrained` shards it. The weight files of an
      earlier checkpoint in `directory` are removed, so that none outlives the new one.

  Returns:
    The directory.

  Raises:
    CheckpointError: naming the model option that no architecture expresses (another layer,
      an MLP where the architecture has none, a decoder bias that is not zero...), the
      parameters of `variables` missing, extra or of another shape than `model`'s, an
      `architecture` that does not express it, a `dtype` not in `DTYPES`, or a `shard_bytes`
      that is not a positive int.
  """
  written = "float32" if dtype is None else _dtype_name(dtype)
  try:
    check_positive_int(shard_bytes, "shard_bytes")
  except ValueError as error:
    raise CheckpointError(str(error)) from None
  if not isinstance(model, SequenceModel):
    from ssmkit._src.nnx.convert import to_linen

    model, variables = to_linen(model)
  chosen = _architecture(model, architecture or _source_architecture(source))
  if architecture is not None and architecture != chosen.ARCHITECTURE:
    raise CheckpointError(f"`architecture` {architecture!r} does not express `model`, which saves "
                          f"as a {chosen.ARCHITECTURE}.")
  architecture = chosen
  if not isinstance(variables, Mapping) or not isinstance(variables.get("params"), Mapping):
    raise CheckpointError("`variables` must be the model's variables, `{\"params\": ...}`, got "
                          f"{type(variables).__name__}.")
  check_tree(variable_shapes(model)["params"], variables["params"], "`variables['params']`")
  params = jax.tree.map(lambda v: np.asarray(v, np.float32), variables["params"])
  fields, tensors = architecture.checkpoint(with_unrolled_blocks(model), _blocks(model, params),
                                            params)
  # Special tokens unknown without a source, rather than the architecture's defaults, which
  # need not lie in this model's vocabulary.
  config = {"architectures": [architecture.ARCHITECTURE], **fields,
            "vocab_size": model.vocab_size, "dtype": written,
            **dict.fromkeys(CARRIED_FIELDS)}
  # `copy=False`: in float32 the tensors are written as they are, not copied once more.
  kept = getattr(architecture, "FLOAT32_TENSORS", ())
  tensors = {name: value if any(part in name for part in kept)
             else value.astype(DTYPES[written], copy=False) for name, value in tensors.items()}

  folder = pathlib.Path(directory)
  folder.mkdir(parents=True, exist_ok=True)
  if source is not None:
    config.update(_carry(source, folder))
  (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
  _write_weights(folder, tensors, shard_bytes)
  return folder


def _write_weights(folder: pathlib.Path, tensors: dict[str, np.ndarray], shard_bytes: int) -> None:
  """`tensors` as `SINGLE`, or as shards of at most `shard_bytes` bytes each with `INDEX`."""
  from safetensors.numpy import save_file

  for stale in [folder / SINGLE, folder / INDEX, *folder.glob("model-*-of-*.safetensors")]:
    stale.unlink(missing_ok=True)
  shards, size = [[]], 0
  for name, value in tensors.items():
    if shards[-1] and size + value.nbytes > shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += value.nbytes
  files = [SINGLE] if len(shards) == 1 else [
      f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
  for file, names in zip(files, shards, strict=True):
    save_file({name: np.ascontiguousarray(tensors[name]) for name in names}, str(folder / file),
              metadata={"format": "pt"})
  if len(files) > 1:
    index = {"metadata": {"total_size": sum(value.nbytes for value in tensors.values())},
             "weight_map": {name: file for file, names in zip(files, shards, strict=True)
                            for name in names}}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _dtype_name(dtype: Any) -> str:
  """The `DTYPES` name of `dtype`."""
  try:
    name = np.dtype(dtype).name
  except TypeError:
    name = None
  if name not in DTYPES:
    raise CheckpointError(f"`dtype` must be one of {tuple(DTYPES)}, got {dtype!r}.")
  return name


def _source_architecture(source: str | pathlib.Path | None) -> str | None:
  """The architecture a source checkpoint folder's config.json names by its `model_type`."""
  path = None if source is None else pathlib.Path(source).expanduser()
  if path is None or not (path / CONFIG).is_file():
    return None
  module = MODEL_TYPES.get(read_config(path).get("model_type"))
  return None if module is None else module.ARCHITECTURE


def _fits(architecture: Any, model: SequenceModel) -> bool:
  """Whether `model` is a candidate of `architecture`: its `fits(model)`, where the module has
  one (every pattern of its layers is, where it has none; `checkpoint` names what does not
  fit)."""
  fits = getattr(architecture, "fits", None)
  return fits is None or fits(model)


def _required(architecture: Any) -> dict[str, Any]:
  """The model options `architecture` needs: its `REQUIRED`, and those of `_PLAIN` that it
  does not write (its `WRITES`)."""
  written = getattr(architecture, "WRITES", ())
  return {**{k: v for k, v in _PLAIN.items() if k not in written}, **architecture.REQUIRED}


def _option(model: SequenceModel, name: str) -> Any:
  """The model option `name`; one norm position for every block where they are the same."""
  value = getattr(model, name)
  value = tuple(value) if isinstance(value, list) else value
  if name == "norm_position" and not isinstance(value, str) and len(set(value)) == 1:
    return value[0]
  return value


def _architecture(model: SequenceModel, preferred: str | None) -> Any:
  """The architecture module of `model`, checked to express it exactly: `preferred` (an
  architecture name) among those that do, where it is one.

  Raises:
    CheckpointError: naming the option that the architecture does not have.
  """
  kinds = {type(make()) for make in layer_pattern(model.layer)}
  found = [a for a in WRITTEN if kinds <= set(a.LAYERS) and _fits(a, model) and (
      len(a.LAYERS) > 1 or not isinstance(model.layer, tuple))]
  if not found:
    names = ", ".join(sorted(kind.__name__ for kind in kinds))
    by_layers: dict[str, list[str]] = {}
    for written in WRITTEN:
      layers = " + ".join(kind.__name__ for kind in written.LAYERS)
      by_layers.setdefault(layers, []).append(written.ARCHITECTURE)
    known = "; ".join(f"{layers}: {', '.join(architectures)}"
                      for layers, architectures in by_layers.items())
    raise CheckpointError(f"`model`: its layers ({names}) make no architecture that save writes "
                          f"({known}).")
  exact = [a for a in found if all(_option(model, k) == v for k, v in _required(a).items())]
  architecture = next((a for a in exact if preferred == a.ARCHITECTURE), (exact or found)[0])
  for name, value in _required(architecture).items():
    if _option(model, name) != value:
      raise CheckpointError(f"`model.{name}`={getattr(model, name)!r}: a "
                            f"{architecture.ARCHITECTURE} has {name}={value!r}.")
  if model.vocab_size is None or model.num_outputs != model.vocab_size:
    raise CheckpointError("`model`: a causal language model reads tokens and predicts them: "
                          f"vocab_size={model.vocab_size!r}, num_outputs={model.num_outputs!r}.")
  return architecture


def _blocks(model: SequenceModel, params: dict[str, Any]) -> list[dict[str, Any]]:
  """The parameters of each block in order, unstacked where the blocks run under `nn.scan`."""
  if not model.scan_blocks:
    return [params[f"block_{i}"] for i in range(model.num_blocks)]
  places = (scanned_place(model, i) for i in range(model.num_blocks))
  return [jax.tree.map(lambda v, at=at: v[at], params[scan][name]) for scan, name, at in places]


def _carry(source: str | pathlib.Path, folder: pathlib.Path) -> dict[str, Any]:
  """Copies the tokenizer files of `source` (a checkpoint or a tokenizer.json) into `folder`, and
  returns the special token ids of its config.json.

  Raises:
    CheckpointError: naming `source` when it is neither.
  """
  path = pathlib.Path(source).expanduser()
  if path.is_file():
    if path.name != "tokenizer.json":
      raise CheckpointError(f"`source` {str(source)!r} is a file but no tokenizer.json; give the "
                            "checkpoint folder the model came from, or its tokenizer.json.")
    if path.resolve() != (folder / path.name).resolve():
      shutil.copyfile(path, folder / path.name)
    return {}
  origin = checkpoint_directory(source)
  for name in CARRIED_FILES:
    if (origin / name).is_file() and (origin / name).resolve() != (folder / name).resolve():
      shutil.copyfile(origin / name, folder / name)
  if not (origin / CONFIG).is_file():
    return {}
  values = read_config(origin)
  # An image-text checkpoint gives them for its language model (`text_config`), or outside it.
  text = values.get("text_config") if isinstance(values.get("text_config"), dict) else {}
  return {name: text.get(name) if values.get(name) is None else values[name]
          for name in CARRIED_FIELDS}
