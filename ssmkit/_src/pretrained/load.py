"""`load`: a Hugging Face checkpoint as an ssmkit `SequenceModel` and its variables."""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import jax
import numpy as np
from flax import traverse_util

from ssmkit._src.layers.common import check_float_dtype
from ssmkit._src.layers.model import SequenceModel, scanned_place, with_scanned_blocks
from ssmkit._src.pretrained import (
  bamba,
  falcon_h1,
  falcon_mamba,
  granitemoehybrid,
  jamba,
  kimi_linear,
  lfm2,
  mamba,
  mamba2,
  nemotron_h,
  olmo_hybrid,
  qwen3_5,
  qwen3_5_moe,
  qwen3_next,
  recurrent_gemma,
)
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CONFIG, CheckpointError, Tensors, read_config, read_weights
from ssmkit._src.pretrained.quantized import dequantized

# The module of each architecture, in the order `save` prefers them where several express a
# model (Granite's before Bamba's, whose models it extends).
MODULES = (mamba, falcon_mamba, mamba2, recurrent_gemma, qwen3_5, qwen3_5_moe, qwen3_next,
           granitemoehybrid, bamba, jamba, nemotron_h, lfm2, falcon_h1, olmo_hybrid,
           kimi_linear)
# Each architecture ssmkit loads, by its `architectures` name in config.json, and by the
# `model_type` that `transformers` reads to choose it: its own, and those of the larger
# checkpoints that hold it (`WRAPPERS`, e.g. an image-text model's language model).
ARCHITECTURES = {module.ARCHITECTURE: module for module in MODULES}
MODEL_TYPES = {model_type: module for module in ARCHITECTURES.values()
               for model_type in (module.MODEL_TYPE, *getattr(module, "WRAPPERS", {}))}


def checkpoint_directory(path_or_repo_id: str | pathlib.Path, *, weights: bool = True
                         ) -> pathlib.Path:
  """A local checkpoint directory, or the hub snapshot of a repository id (needs a network and
  `pip install "ssmkit[hub]"`): its JSON files, and its weights unless `weights` is False.

  Raises:
    CheckpointError: naming the path when it is neither a directory nor a repository id that
      can be downloaded here.
  """
  directory = pathlib.Path(path_or_repo_id).expanduser()
  if directory.is_dir():
    return directory
  name = str(path_or_repo_id)
  # A repository id is owner/name, never a path from the root, the home or the current folder.
  if directory.exists() or name.count("/") != 1 or name.startswith(("/", "~", ".")):
    raise CheckpointError(f"`path_or_repo_id` {name!r} is neither a checkpoint directory nor a "
                          "Hugging Face repository id (owner/name).")
  try:
    from huggingface_hub import snapshot_download
  except ImportError:
    raise CheckpointError(f"`path_or_repo_id` {name!r} is not a directory here; to download it from "
                          'the Hugging Face hub, `pip install "ssmkit[hub]"`, or download the '
                          "directory elsewhere and give its path.") from None
  try:
    patterns = ["*.json", "*.safetensors"] if weights else ["*.json"]
    return pathlib.Path(snapshot_download(name, allow_patterns=patterns))
  except Exception as error:  # the hub's errors: no network, no such repository, gated access
    raise CheckpointError(f"`path_or_repo_id` {name!r} could not be downloaded: {error}") from None


@functools.lru_cache(maxsize=16)
def variable_shapes(model: SequenceModel) -> Any:
  """The shapes and dtypes of `model`'s variables, traced once per configuration: loading the
  same checkpoint again (linen, then NNX) or another of the same configuration (a fine-tuned
  copy) skips the trace."""
  return jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 1), np.int32)))


def load(path_or_repo_id: str | pathlib.Path, *, dtype: Any = None, nnx: bool = False,
         abstract: bool = False, scan_blocks: bool = False) -> tuple[Any, Any, dict[str, Any]]:
  """A published checkpoint as an ssmkit language model: `(model, variables, config)`.

  Reads `config.json` and the safetensors weights (one file or the shards of an index) of a
  `transformers` checkpoint and builds the `SequenceModel` that computes what the checkpoint's
  own implementation computes, with float32 parameters (bfloat16 checkpoints widen exactly).
  An architecture, config field or tensor that ssmkit cannot express exactly is an error
  naming it, never an approximation.

  Args:
    path_or_repo_id: a local directory, or a hub repository id such as
      "state-spaces/mamba-130m-hf" (downloaded with `huggingface_hub`, the `hub` extra).
    dtype: the model's computation dtype (e.g. `jnp.bfloat16`); None: float32.
    nnx: return the NNX twin (`ssmkit.nnx.SequenceModel`) instead of the linen model.
    abstract: read config.json alone: the variables are `jax.ShapeDtypeStruct`s of the
      checkpoint's shapes and float32 (e.g. the template of a checkpoint of a fine-tuning run,
      or a model of the same architecture to initialise afresh), and no weights are read or
      downloaded.
    scan_blocks: run the blocks under `nn.scan`, the layers' pattern cut to its shortest period
      (Qwen3.5's three Gated DeltaNet blocks and one attention block, Jamba's eight, one for
      Mamba), each place's parameters stacked over the repeats: the model computes the same
      logits, and compiling it (its forward, `generate`, a fine-tuning step) takes one period
      of blocks, not every layer. Distinct first blocks (Kimi Linear's first layer, whose MLP is
      dense) run first as a head (`head_blocks`) where that compiles fewer blocks; a pattern
      without a shorter period is scanned once. `save` writes such a model back block by block.

  Returns:
    `(model, variables, config)`: the linen model and `{"params": ...}`, or with `nnx` the NNX
    model and its `nnx.state` (with `abstract`, an NNX model of `jax.ShapeDtypeStruct`s, as
    `nnx.eval_shape` builds it); and the checkpoint's config.json as a dict. Tokens in, logits
    out: `model.apply(variables, ids)` (linen) or `model(ids)` (NNX), and
    `ssmkit.layers.generate` continues a prompt.

  Raises:
    CheckpointError: naming the file, field or tensor that does not fit (a `ValueError`).

  Examples:
    >>> import ssmkit.pretrained
    >>> sorted(ssmkit.pretrained.ARCHITECTURES)
    ['BambaForCausalLM', 'FalconH1ForCausalLM', 'FalconMambaForCausalLM',
     'GraniteMoeHybridForCausalLM', 'JambaForCausalLM', 'KimiLinearForCausalLM',
     'Lfm2ForCausalLM', 'Mamba2ForCausalLM', 'MambaForCausalLM', 'NemotronHForCausalLM',
     'OlmoHybridForCausalLM',
     'Qwen3NextForCausalLM', 'Qwen3_5ForCausalLM', 'Qwen3_5MoeForCausalLM',
     'RecurrentGemmaForCausalLM']
  """
  check_float_dtype(dtype, "dtype")
  directory = checkpoint_directory(path_or_repo_id, weights=not abstract)
  values = read_config(directory)
  fields = Fields(values, directory / CONFIG)
  architecture = _architecture(fields)
  wrapper = getattr(architecture, "WRAPPERS", {}).get(values["model_type"])
  ignored, renamed = getattr(architecture, "IGNORED", ()), None
  if wrapper is not None:
    fields = _language_model(fields)
    ignored, renamed = (*ignored, *wrapper.ignored), (wrapper.prefix, "model.")
  unrolled = SequenceModel(**_canonical(architecture.options(fields)), dtype=dtype)
  model = with_scanned_blocks(unrolled) if scan_blocks else unrolled
  try:
    shapes = variable_shapes(model)
  except ValueError as error:
    raise CheckpointError(f"{fields.source} gives a model ssmkit cannot build: {error}") from None
  if abstract:
    variables = {"params": shapes["params"]}
  else:
    tensors = Tensors(dequantized(read_weights(directory), values, directory), directory,
                      ignored=ignored, renamed=renamed)
    params = architecture.params(tensors, fields, unrolled)
    tensors.finish()
    if scan_blocks:
      params = _stacked(model, params)
    check_tree(shapes["params"], params, f"{directory}: the weights")
    variables = {"params": jax.tree.map(np.asarray, params)}
  if nnx:
    from flax import nnx as flax_nnx

    from ssmkit._src.nnx.convert import from_linen

    convert = lambda variables: from_linen(model, variables)
    twin = flax_nnx.eval_shape(convert, variables) if abstract else convert(variables)
    return twin, flax_nnx.state(twin), values
  return model, variables, values


def _stacked(model: SequenceModel, params: dict[str, Any]) -> dict[str, Any]:
  """Parameters of blocks `block_0`, `block_1`, ... restacked for `model`'s `nn.scan`."""
  stacked = {name: value for name, value in params.items() if not name.startswith("block_")}
  groups: dict[tuple[str, str], list[Any]] = {}
  for i in range(model.num_blocks):  # each group's blocks in the order of its stacked axis
    groups.setdefault(scanned_place(model, i)[:2], []).append(params[f"block_{i}"])
  for (scan, name), blocks in groups.items():
    stacked.setdefault(scan, {})[name] = jax.tree.map(lambda *leaves: np.stack(leaves), *blocks)
  return stacked


@functools.cache
def _partial(func: Any, args: tuple, keywords: tuple, types: tuple) -> functools.partial:
  """One partial per function, arguments and their types (1 == 1.0 == True as keys)."""
  del types
  return functools.partial(func, *args, **dict(keywords))


def _canonical(x: Any) -> Any:
  """`x` with each `functools.partial` in it (nested in others, tuples and dicts) made one object
  per function and arguments.

  A partial compares by identity: two loads of one checkpoint would build unequal models, and
  what `jax.jit` traced and compiled for one (a module as a static argument) would not serve
  the other. A partial with an unhashable argument stays as it is.
  """
  if isinstance(x, tuple):
    return tuple(map(_canonical, x))
  if isinstance(x, dict):
    return {key: _canonical(value) for key, value in x.items()}
  if not isinstance(x, functools.partial):
    return x
  args = tuple(map(_canonical, x.args))
  keywords = tuple(sorted((key, _canonical(value)) for key, value in x.keywords.items()))
  try:
    return _partial(_canonical(x.func), args, keywords,
                    tuple(type(a) for a in (*args, *dict(keywords).values())))
  except TypeError:
    return functools.partial(x.func, *args, **dict(keywords))


def _architecture(fields: Fields) -> Any:
  """The architecture module of a config.json: by its `model_type`, as `transformers`' Auto
  classes choose it, with `architectures`, where given, naming the same model.

  Raises:
    CheckpointError: naming `model_type` when it is missing or not one ssmkit loads, and both
      fields when they contradict each other.
  """
  types = ", ".join(sorted(MODEL_TYPES))
  if "model_type" not in fields.values:
    raise CheckpointError(f"{fields.source}: the field `model_type` is missing; transformers "
                          f"reads it to choose the architecture (ssmkit loads {types}).")
  model_type = fields.values["model_type"]
  if model_type not in MODEL_TYPES:
    raise CheckpointError(f"{fields.source}: `model_type` {model_type!r} is not one ssmkit loads "
                          f"({types}).")
  module = MODEL_TYPES[model_type]
  wrapper = getattr(module, "WRAPPERS", {}).get(model_type)
  name = module.ARCHITECTURE if wrapper is None else wrapper.architecture
  names = fields.get("architectures", [name])
  own = {name, module.ARCHITECTURE.replace("ForCausalLM", "Model")} if wrapper is None else {name}
  if not isinstance(names, list) or not names or not set(names) <= own:
    raise CheckpointError(f"{fields.source}: `architectures` {names!r} contradicts `model_type` "
                          f"{model_type!r}, whose model is a {name}.")
  return module


def _language_model(fields: Fields) -> Fields:
  """The fields of the language model inside a larger checkpoint: its `text_config`, with the
  larger model's tied head and special tokens where it gives them.

  Raises:
    CheckpointError: naming `text_config` when it is missing or not an object.
  """
  text = fields.get("text_config")
  if not isinstance(text, dict):
    raise CheckpointError(f"{fields.source}: `text_config` must be an object, got {text!r}.")
  outer = {name: fields.values[name] for name in (
      "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
      if fields.values.get(name) is not None}
  return Fields({**text, **outer}, f"{fields.source} (text_config)")


def check_tree(expected: dict[str, Any], params: dict[str, Any], what: str) -> None:
  """Checks that `params` (named `what` in the error) has every parameter of the model's
  `expected` shapes.

  Raises:
    CheckpointError: naming the parameters missing, extra or of another shape.
  """
  want = {"/".join(k): v.shape for k, v in traverse_util.flatten_dict(expected).items()}
  got = {"/".join(k): np.shape(v) for k, v in traverse_util.flatten_dict(params).items()}
  if want != got:
    wrong = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    raise CheckpointError(f"{what} do not fill ssmkit's model: missing {missing}, extra {extra}, "
                          f"of another shape {wrong}.")
