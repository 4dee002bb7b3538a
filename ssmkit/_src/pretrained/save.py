"""`save`: an ssmkit model written as a Hugging Face checkpoint that `transformers` loads."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np

from ssmkit._src.layers.mamba import Mamba
from ssmkit._src.layers.mamba2 import Mamba2
from ssmkit._src.layers.model import SequenceModel
from ssmkit._src.pretrained import mamba, mamba2
from ssmkit._src.pretrained.files import CONFIG, SINGLE, CheckpointError

# The architecture each layer's models are saved as.
BY_LAYER = {Mamba: mamba, Mamba2: mamba2}
# The options a model must have to be one of these architectures, as `transformers` builds them.
REQUIRED = {"block": "mixer", "norm": "rms", "mlp": "none", "prenorm": True, "pooling": "none",
            "scale_embeddings": False, "logit_cap": None}
# flax's RMSNorm epsilon, which a model with `norm_eps` None uses.
FLAX_RMS_EPS = 1e-6


def save(model: Any, variables: Any, directory: str | pathlib.Path) -> pathlib.Path:
  """Writes `model` as `config.json` and `model.safetensors` that `transformers` loads as the
  same architecture, and `ssmkit.pretrained.load` reads back bit for bit.

  Args:
    model: a linen `SequenceModel` of one layer kind that a published architecture has
      (`ssmkit.layers.Mamba`: `MambaForCausalLM`; `ssmkit.layers.Mamba2`:
      `Mamba2ForCausalLM`), with `block="mixer"`, `norm="rms"`, `mlp="none"`, token inputs and
      outputs, blocks unrolled or scanned; or its NNX twin (then `variables` is ignored).
    variables: the linen model's variables (`{"params": ...}`), e.g. of a trained `lm` run.
    directory: the folder to write; created if needed.

  Returns:
    The directory.

  Raises:
    CheckpointError: naming the model option that no architecture expresses (another layer, a
      layer pattern, an MLP, a decoder bias that is not zero...).
  """
  if not isinstance(model, SequenceModel):
    from ssmkit._src.nnx.convert import to_linen

    model, variables = to_linen(model)
  architecture = _architecture(model)
  params = jax.tree.map(lambda v: np.asarray(v, np.float32), variables["params"])
  if model.scan_blocks:
    stacked = params["blocks"]["block"]
    blocks = [jax.tree.map(lambda v, i=i: v[i], stacked) for i in range(model.num_blocks)]
  else:
    blocks = [params[f"block_{i}"] for i in range(model.num_blocks)]
  tensors = architecture.tensors_of(blocks)
  fields = architecture.config_of(model, tensors)
  tensors.update({"backbone.embeddings.weight": params["encoder"]["embedding"],
                  "backbone.norm_f.weight": params["final_norm"]["RMSNorm_0"]["scale"]})
  if not model.tie_embeddings:
    if np.any(params["decoder"]["bias"]):
      raise CheckpointError("`variables`: the decoder's bias is not zero, and transformers' "
                            "lm_head has none.")
    tensors["lm_head.weight"] = params["decoder"]["kernel"].T
  config = {"architectures": [architecture.ARCHITECTURE], **fields,
            "vocab_size": model.vocab_size,
            "layer_norm_epsilon": FLAX_RMS_EPS if model.norm_eps is None else model.norm_eps,
            "tie_word_embeddings": model.tie_embeddings, "dtype": "float32"}
  from safetensors.numpy import save_file

  folder = pathlib.Path(directory)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
  save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()},
            str(folder / SINGLE), metadata={"format": "pt"})
  return folder


def _architecture(model: SequenceModel) -> Any:
  """The architecture module of `model`, checked to express it exactly."""
  if not callable(model.layer):
    raise CheckpointError("`model`: save writes models of one layer kind (Mamba, Mamba2); a layer "
                          "pattern, RecurrentGemma's included, it does not write.")
  kind = type(model.layer())
  if kind not in BY_LAYER:
    raise CheckpointError(f"`model`: its layer {kind.__name__} has no published architecture "
                          f"here; ssmkit saves {', '.join(k.__name__ for k in BY_LAYER)} models.")
  for name, value in REQUIRED.items():
    if getattr(model, name) != value:
      raise CheckpointError(f"`model.{name}`={getattr(model, name)!r}: a "
                            f"{BY_LAYER[kind].ARCHITECTURE} has {name}={value!r}.")
  if model.vocab_size is None or model.num_outputs != model.vocab_size:
    raise CheckpointError("`model`: a causal language model reads tokens and predicts them: "
                          f"vocab_size={model.vocab_size!r}, num_outputs={model.num_outputs!r}.")
  return BY_LAYER[kind]
