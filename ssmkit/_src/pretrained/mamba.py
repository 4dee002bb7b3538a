"""`MambaForCausalLM` checkpoints (state-spaces/mamba-*-hf, `transformers`' Mamba) as a `SequenceModel`.

The model is pre-norm residual blocks `x + mixer(RMSNorm(x))` around `ssmkit.layers.Mamba`, a
final RMSNorm and the embedding's transpose as the head: `SequenceModel(block="mixer",
norm="rms", mlp="none")`. Torch's linear weights are `(out, in)`, ssmkit's `(in, out)`; the
depthwise convolution's `(D, 1, K)` weight is ssmkit's `(K, D)` kernel, taps in the same order.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ssmkit._src.layers.mamba import Mamba
from ssmkit._src.pretrained import parts
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors

ARCHITECTURE = "MambaForCausalLM"
MODEL_TYPE = "mamba"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (Mamba,)
REQUIRED = {"block": "mixer", "norm": "rms", "mlp": "none", "prenorm": True, "pooling": "none",
            "scale_embeddings": False, "logit_cap": None}
# flax's RMSNorm epsilon, which a model with `norm_eps` None uses.
FLAX_RMS_EPS = 1e-6


def fits(model: Any) -> bool:
  """Whether `model`'s Mamba layers are Mamba's own (not Falcon-Mamba's normalised ones)."""
  return model.layer().selective_norm_eps is None


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Mamba `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit's Mamba cannot compute exactly.
  """
  fields.require("hidden_act", "silu")
  features, expand = fields.int("hidden_size"), fields.int("expand", 2)
  fields.require("intermediate_size", expand * features)
  rank = fields.get("time_step_rank", "auto")
  layer = functools.partial(Mamba, d_state=fields.int("state_size", 16),
                            d_conv=fields.int("conv_kernel", 4), expand=expand,
                            use_bias=bool(fields.get("use_bias", False)),
                            use_conv_bias=bool(fields.get("use_conv_bias", True)),
                            dt_rank=math.ceil(features / 16) if rank == "auto" else fields.int(
                                "time_step_rank"))
  vocab = fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features,
              num_blocks=fields.int("num_hidden_layers"), layer=layer, pooling="none",
              block="mixer", norm="rms", norm_eps=fields.float("layer_norm_epsilon", 1e-5),
              mlp="none", tie_embeddings=fields.get("tie_word_embeddings", True),
              decoder_bias=False)


def params(tensors: Tensors, fields: Fields, model: Any) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors."""
  features, layer = model.features, model.layer()
  tree: dict[str, Any] = {}
  for i in range(model.num_blocks):
    prefix = f"backbone.layers.{i}"
    tree[f"block_{i}"] = {
        "norm": {"RMSNorm_0": {"scale": tensors.take(f"{prefix}.norm.weight", (features,))}},
        "mixer": mixer_params(tensors, f"{prefix}.mixer", layer, features),
    }
  return {**tree, **embedding_and_head(tensors, model)}


def mixer_params(tensors: Tensors, where: str, layer: Mamba, features: int) -> dict[str, Any]:
  """A Mamba mixer's parameters from `transformers`' tensors under `where` (Mamba's, Falcon-
  Mamba's, and Jamba's with the scales of its selective norms)."""
  inner, n, k = layer.expand * features, layer.d_state, layer.d_conv
  rank = layer.dt_rank or math.ceil(features / 16)
  take = lambda name, shape: tensors.take(f"{where}.{name}", shape)
  mixer = {"in_proj": take("in_proj.weight", (2 * inner, features)).T,
           "conv_kernel": take("conv1d.weight", (inner, 1, k))[:, 0, :].T,
           "x_proj": take("x_proj.weight", (rank + 2 * n, inner)).T,
           "dt_proj": take("dt_proj.weight", (inner, rank)).T,
           "dt_bias": take("dt_proj.bias", (inner,)), "A_log": take("A_log", (inner, n)),
           "D": take("D", (inner,)), "out_proj": take("out_proj.weight", (features, inner)).T}
  if layer.use_conv_bias:
    mixer["conv_bias"] = take("conv1d.bias", (inner,))
  if layer.use_bias:
    mixer.update(in_proj_bias=take("in_proj.bias", (2 * inner,)),
                 out_proj_bias=take("out_proj.bias", (features,)))
  if layer.selective_norm_scale:
    mixer.update({f"{name}_norm_scale": take(f"{name}_layernorm.weight", (width,))
                  for name, width in (("dt", rank), ("b", n), ("c", n))})
  return mixer


def embedding_and_head(tensors: Tensors, model: Any) -> dict[str, Any]:
  """The embedding, final norm and head of a Mamba or Mamba-2 checkpoint (`backbone.embeddings`,
  `backbone.norm_f`, `lm_head`): a tied head is the embedding (and a saved copy of it is read
  and dropped); an untied one is ssmkit's decoder, without a bias."""
  vocab, features = model.vocab_size, model.features
  tree: dict[str, Any] = {
      "encoder": {"embedding": tensors.take("backbone.embeddings.weight", (vocab, features))},
      "final_norm": {"RMSNorm_0": {"scale": tensors.take("backbone.norm_f.weight", (features,))}},
  }
  return {**tree, **head(tensors, model)}


def head(tensors: Tensors, model: Any) -> dict[str, Any]:
  """The decoder of an untied `lm_head` (`decoder_bias=False`), or nothing for a tied one,
  whose saved copy of the embedding is read and dropped."""
  vocab, features = model.vocab_size, model.features
  if not model.tie_embeddings:
    return {"decoder": {"kernel": tensors.take("lm_head.weight", (vocab, features)).T}}
  if tensors.has("lm_head.weight"):
    tensors.take("lm_head.weight", (vocab, features))
  return {}


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a Mamba model: its blocks' parameters `blocks` and the
  rest of `params`."""
  tensors = {**block_tensors(blocks, mixer_tensors), **head_tensors(model, params)}
  layer = model.layer()
  return {"model_type": "mamba", "hidden_size": model.features, "state_size": layer.d_state,
          "num_hidden_layers": model.num_blocks, "expand": layer.expand,
          "intermediate_size": layer.expand * model.features, "conv_kernel": layer.d_conv,
          "time_step_rank": layer.dt_rank or math.ceil(model.features / 16),
          "use_bias": layer.use_bias, "use_conv_bias": layer.use_conv_bias, "hidden_act": "silu",
          "residual_in_fp32": True, **head_fields(model)}, tensors


def head_fields(model: Any) -> dict[str, Any]:
  """The config.json fields of a Mamba or Mamba-2 model's norms and head."""
  return {"layer_norm_epsilon": FLAX_RMS_EPS if model.norm_eps is None else model.norm_eps,
          "tie_word_embeddings": model.tie_embeddings}


def head_tensors(model: Any, params: dict[str, Any]) -> dict[str, np.ndarray]:
  """The embedding, final norm and head tensors of a Mamba or Mamba-2 model.

  Raises:
    CheckpointError: when the untied decoder has a bias that is not zero: `lm_head` has none.
  """
  tensors = {"backbone.embeddings.weight": params["encoder"]["embedding"],
             "backbone.norm_f.weight": params["final_norm"]["RMSNorm_0"]["scale"]}
  if not model.tie_embeddings:
    if np.any(params["decoder"].get("bias", 0)):
      raise CheckpointError("`variables`: the untied decoder has a bias that is not zero, and "
                            "transformers' lm_head has none (`decoder_bias=False` leaves it out).")
    tensors["lm_head.weight"] = params["decoder"]["kernel"].T
  return tensors


def block_tensors(blocks: list[dict[str, Any]], mixer: Any) -> dict[str, np.ndarray]:
  """The checkpoint's block tensors of Mamba's layout (`backbone.layers.{i}.norm`, `.mixer.*`)
  from ssmkit's parameters of each block, `mixer(params)` naming the mixer's tensors."""
  tensors = {}
  for i, block in enumerate(blocks):
    prefix = f"backbone.layers.{i}"
    tensors[f"{prefix}.norm.weight"] = block["norm"]["RMSNorm_0"]["scale"]
    tensors.update(parts.scoped(f"{prefix}.mixer", mixer(block["mixer"])))
  return tensors


def mixer_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  """The tensors of `mixer_params`, by `transformers`' names inside the mixer's scope."""
  tensors = {f"{name}.weight": mixer[name].T for name in ("in_proj", "x_proj", "dt_proj", "out_proj")}
  tensors.update({"conv1d.weight": mixer["conv_kernel"].T[:, None, :],
                  "dt_proj.bias": mixer["dt_bias"], "A_log": mixer["A_log"], "D": mixer["D"]})
  if "conv_bias" in mixer:
    tensors["conv1d.bias"] = mixer["conv_bias"]
  if "in_proj_bias" in mixer:
    tensors.update({"in_proj.bias": mixer["in_proj_bias"], "out_proj.bias": mixer["out_proj_bias"]})
  tensors.update({f"{name}_layernorm.weight": mixer[f"{name}_norm_scale"]
                  for name in ("dt", "b", "c") if f"{name}_norm_scale" in mixer})
  return tensors
