"""`Mamba2ForCausalLM` checkpoints (mamba-codestral, the mamba2-*-hf conversions) as a `SequenceModel`.

Pre-norm residual blocks around `ssmkit.layers.Mamba2`, a final RMSNorm and a head, as
`transformers`' Mamba-2: its in-projection packs [z, x, B, C, dt] as ssmkit's does, its gated
RMSNorm normalises each of the `n_groups` groups of channels (`norm_per_group=True`) with the
config's epsilon, and its step size is clipped to `time_step_limit` (`dt_limit`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ssmkit._src.layers.mamba2 import Mamba2
from ssmkit._src.pretrained import mamba
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import embedding_and_head

ARCHITECTURE = "Mamba2ForCausalLM"
MODEL_TYPE = "mamba2"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (Mamba2,)
REQUIRED = mamba.REQUIRED


def fits(model: Any) -> bool:
  """Every Mamba-2 model of the required options is a Mamba2ForCausalLM."""
  del model
  return True


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Mamba-2 `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit's Mamba-2 cannot compute exactly.
  """
  fields.require("hidden_act", "silu")
  fields.require("use_bias", False)
  features, expand = fields.int("hidden_size"), fields.int("expand", 2)
  head_dim, heads = fields.int("head_dim", 64), fields.int("num_heads")
  if heads * head_dim != expand * features:
    raise CheckpointError(f"{fields.source}: `num_heads` x `head_dim` = {heads * head_dim} must be "
                          f"`expand` x `hidden_size` = {expand * features}.")
  limit = fields.get("time_step_limit", (0.0, math.inf))
  if not isinstance(limit, list | tuple) or len(limit) != 2:
    raise CheckpointError(f"{fields.source}: `time_step_limit` must be [low, high], got {limit!r}.")
  eps = fields.float("layer_norm_epsilon", 1e-5)
  layer = functools.partial(Mamba2, d_state=fields.int("state_size", 128),
                            d_conv=fields.int("conv_kernel", 4),
                            use_conv_bias=bool(fields.get("use_conv_bias", True)),
                            expand=expand, head_dim=head_dim,
                            n_groups=fields.int("n_groups", 1), dt_limit=tuple(map(float, limit)),
                            norm_eps=eps, norm_per_group=True)
  vocab = fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features,
              num_blocks=fields.int("num_hidden_layers"), layer=layer, pooling="none",
              block="mixer", norm="rms", norm_eps=eps, mlp="none",
              tie_embeddings=fields.get("tie_word_embeddings", False), decoder_bias=False)


def params(tensors: Tensors, fields: Fields, model: Any) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors."""
  features, layer = model.features, model.layer()
  inner = layer.expand * features
  heads, bc, k = inner // layer.head_dim, 2 * layer.n_groups * layer.d_state, layer.d_conv
  tree: dict[str, Any] = {}
  for i in range(model.num_blocks):
    prefix = f"backbone.layers.{i}"
    mixer = f"{prefix}.mixer"
    tree[f"block_{i}"] = {
        "norm": {"RMSNorm_0": {"scale": tensors.take(f"{prefix}.norm.weight", (features,))}},
        "mixer": {
            "in_proj": tensors.take(f"{mixer}.in_proj.weight",
                                    (2 * inner + bc + heads, features)).T,
            "conv_kernel": tensors.take(f"{mixer}.conv1d.weight", (inner + bc, 1, k))[:, 0, :].T,
            "dt_bias": tensors.take(f"{mixer}.dt_bias", (heads,)),
            "A_log": tensors.take(f"{mixer}.A_log", (heads,)),
            "D": tensors.take(f"{mixer}.D", (heads,)),
            "norm_scale": tensors.take(f"{mixer}.norm.weight", (inner,)),
            "out_proj": tensors.take(f"{mixer}.out_proj.weight", (features, inner)).T,
        },
    }
    if layer.use_conv_bias:
      tree[f"block_{i}"]["mixer"]["conv_bias"] = tensors.take(f"{mixer}.conv1d.bias", (inner + bc,))
  return {**tree, **embedding_and_head(tensors, model)}


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a Mamba-2 model: its blocks' parameters `blocks` and the
  rest of `params`.

  Raises:
    CheckpointError: when its gated norm is over the whole width with several groups, or has
      another epsilon than the model's norms: `transformers` has one, `layer_norm_epsilon`.
  """
  layer = model.layer()
  fields = mamba.head_fields(model)
  if layer.norm_eps != fields["layer_norm_epsilon"]:
    raise CheckpointError(f"`model.norm_eps`={model.norm_eps!r}: a Mamba2ForCausalLM has one "
                          "epsilon for its RMSNorms and its layers' gated norms; give the model "
                          f"the Mamba2 layers' norm_eps, {layer.norm_eps}.")
  if layer.n_groups > 1 and not layer.norm_per_group:
    raise CheckpointError("`model`: a Mamba2 layer with n_groups > 1 must normalise per group "
                          "(norm_per_group=True) to be a transformers Mamba2ForCausalLM.")
  inner = layer.expand * model.features
  low, high = layer.dt_limit
  return {"model_type": "mamba2", "hidden_size": model.features, "state_size": layer.d_state,
          "num_hidden_layers": model.num_blocks, "expand": layer.expand,
          "head_dim": layer.head_dim, "num_heads": inner // layer.head_dim,
          "n_groups": layer.n_groups, "conv_kernel": layer.d_conv, "time_step_limit": [low, high],
          "use_bias": False, "use_conv_bias": layer.use_conv_bias, "hidden_act": "silu",
          "residual_in_fp32": True, **fields}, {
              **_block_tensors(blocks), **mamba.head_tensors(model, params)}


def _block_tensors(blocks: list[dict[str, Any]]) -> dict[str, np.ndarray]:
  """The checkpoint's block tensors from ssmkit's parameters of each block."""
  tensors = {}
  for i, block in enumerate(blocks):
    prefix, mixer = f"backbone.layers.{i}", block["mixer"]
    tensors.update({
        f"{prefix}.norm.weight": block["norm"]["RMSNorm_0"]["scale"],
        f"{prefix}.mixer.in_proj.weight": mixer["in_proj"].T,
        f"{prefix}.mixer.conv1d.weight": mixer["conv_kernel"].T[:, None, :],
        f"{prefix}.mixer.dt_bias": mixer["dt_bias"],
        f"{prefix}.mixer.A_log": mixer["A_log"],
        f"{prefix}.mixer.D": mixer["D"],
        f"{prefix}.mixer.norm.weight": mixer["norm_scale"],
        f"{prefix}.mixer.out_proj.weight": mixer["out_proj"].T,
    })
    if "conv_bias" in mixer:
      tensors[f"{prefix}.mixer.conv1d.bias"] = mixer["conv_bias"]
  return tensors
