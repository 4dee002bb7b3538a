"""`GraniteMoeHybridForCausalLM` checkpoints (ibm-granite/granite-4.0-h-*) as a `SequenceModel`.

Granite 4.0's hybrids are Bamba's pattern (`bamba`: Mamba-2 and attention by `layer_types`,
pre-norm mixer blocks, RMSNorms of `rms_norm_eps`) with a mixture of experts and a shared
SwiGLU expert in every block, and four multipliers, each an option of ssmkit's model:
`embedding_multiplier` (`SequenceModel(scale_embeddings=...)`), `residual_multiplier` (the
factor on every branch before the residual stream, `residual_scale`), `attention_multiplier`
(attention's logit factor in place of 1/sqrt(head_dim), `Attention(scale=...)`) and
`logits_scaling` (the outputs divided by it, `logits_scaling`). Its router takes the softmax of
the top k logits, which is the top k of the softmax renormalised: `Experts(normalize=True)`.
With `num_local_experts` 0 the shared expert is the block's SwiGLU MLP.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.block import mlp_width
from ssmkit._src.layers.experts import Experts
from ssmkit._src.layers.mamba2 import Mamba2
from ssmkit._src.pretrained import bamba, parts
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
MODEL_TYPE = "granitemoehybrid"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (Mamba2, Attention)
REQUIRED = {"block": "mixer", "norm": "rms", "prenorm": True, "pooling": "none",
            "decoder_bias": False, "logit_cap": None, "mlp_bias": False}
WRITES = ("residual_scale", "logits_scaling")  # its options beyond the usual
_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
          "attention": "attention"}


def fits(model: Any) -> bool:
  """A Granite model has a multiplier of its own or experts (others are Bamba's)."""
  return (model.mlp == "experts" or model.residual_scale != 1.0 or model.logits_scaling != 1.0
          or not isinstance(model.scale_embeddings, bool))


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Granite 4.0 hybrid `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  features = fields.int("hidden_size")
  positions = fields.get("position_embedding_type", None)
  if positions not in (None, "rope"):
    raise CheckpointError(f"{fields.source}: `position_embedding_type`={positions!r} is not "
                          "supported: ssmkit computes 'rope' or none (null).")
  attention = functools.partial(
      Attention, **{**bamba.attention_options(fields),
                    "rope_fraction": float(fields.get("rope_parameters", {}).get(
                        "partial_rotary_factor", 1.0)) if positions else 0.0,
                    "scale": float(fields.get("attention_multiplier", 1.0))})
  mamba = bamba.mamba_layer(fields)
  kinds = [_KINDS.get(kind) for kind in fields.get("layer_types")]
  if None in kinds:
    raise CheckpointError(f"{fields.source}: `layer_types` must give 'linear_attention' or "
                          f"'full_attention' for each layer, got {fields.get('layer_types')!r}.")
  shared = fields.int("shared_intermediate_size")
  if fields.get("num_local_experts", 0):
    weight = fields.get("router_aux_loss_coef", 0.001)
    try:
      experts = Experts(num_experts=fields.int("num_local_experts"),
                        top_k=fields.int("num_experts_per_tok"),
                        width=fields.int("intermediate_size"), shared_width=shared,
                        balance_weight=float(weight) if fields.get("output_router_logits", False)
                        else 0.0)
    except ValueError as error:
      raise CheckpointError(f"{fields.source} gives experts ssmkit cannot build: {error}") from None
    mlp = {"mlp": "experts", "experts": experts}
  else:
    mlp = {"mlp": "swiglu", "mlp_expansion": shared / features}
  scale, vocab = float(fields.get("embedding_multiplier", 1.0)), fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features, num_blocks=len(kinds),
              layer=tuple(mamba if kind == "mamba" else attention for kind in kinds),
              pooling="none", block="mixer", norm="rms",
              norm_eps=fields.float("rms_norm_eps", 1e-6), **mlp,
              tie_embeddings=bool(fields.get("tie_word_embeddings", False)), decoder_bias=False,
              scale_embeddings=scale if scale != 1.0 else False,
              residual_scale=float(fields.get("residual_multiplier", 1.0)),
              logits_scaling=float(fields.get("logits_scaling", 1.0)))


def _mlp_params(tensors: Tensors, prefix: str, model: Any) -> dict[str, Any]:
  """A block's shared SwiGLU (`shared_mlp`, [gate | up] in `input_linear`) and experts."""
  features = model.features
  config = model.experts
  shared = config.shared_width if config else mlp_width(features, model.mlp_expansion)
  gate, up = np.split(tensors.take(f"{prefix}.shared_mlp.input_linear.weight",
                                   (2 * shared, features)).T, 2, axis=1)
  down = tensors.take(f"{prefix}.shared_mlp.output_linear.weight", (features, shared)).T
  if config is None:
    return {"mlp_gate": {"kernel": gate}, "mlp_up": {"kernel": up}, "mlp_down": {"kernel": down}}
  where, count, width = f"{prefix}.block_sparse_moe", config.num_experts, config.width
  fused = tensors.take(f"{where}.input_linear.weight", (count, 2 * width, features))
  return {"mlp_experts": {
      "router": tensors.take(f"{where}.router.layer.weight", (count, features)).T,
      "gate": fused[:, :width].transpose(0, 2, 1), "up": fused[:, width:].transpose(0, 2, 1),
      "down": tensors.take(f"{where}.output_linear.weight",
                           (count, features, width)).transpose(0, 2, 1),
      "shared_gate": gate, "shared_up": up, "shared_down": down}}


params = functools.partial(bamba.params, final_norm="model.norm.weight",
                           mlp_norm="post_attention_layernorm", mlp=_mlp_params)


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a Granite 4.0 hybrid.

  Raises:
    CheckpointError: naming the option that `transformers`' Granite 4.0 hybrid does not have.
  """
  config = model.experts
  if config is not None and ((config.scoring, config.normalize, config.routed_scale,
                              config.score_bias, config.groups, config.shared_gate,
                              config.activation) != ("softmax", True, 1.0, False, 1, False,
                                                     "swiglu") or not config.shared_width):
    raise CheckpointError(f"`model.experts`={config!r}: a {ARCHITECTURE} routes by a softmax of "
                          "its top k, without scaling, bias or groups, beside an ungated shared "
                          "SwiGLU expert (shared_width > 0).")
  if model.mlp not in ("experts", "swiglu"):
    raise CheckpointError(f"`model.mlp`={model.mlp!r}: a {ARCHITECTURE} has experts or a SwiGLU "
                          "MLP.")
  features = model.features
  attentions = [make() for make in model.layer if make.func is Attention] if isinstance(
      model.layer, tuple) else []
  fields = {
      "model_type": MODEL_TYPE, "hidden_size": features, "hidden_act": "silu",
      "num_hidden_layers": model.num_blocks, "tie_word_embeddings": model.tie_embeddings,
      "layer_types": [{"mamba": "linear_attention", "attention": "full_attention"}[kind]
                      for kind in bamba.mixer_kinds(model)],
      "embedding_multiplier": parts.embedding_multiplier(model),
      "residual_multiplier": model.residual_scale, "logits_scaling": model.logits_scaling,
      "num_local_experts": config.num_experts if config else 0,
      "shared_intermediate_size": (config.shared_width if config
                                   else mlp_width(features, model.mlp_expansion)),
      **bamba.mixer_fields(model, ARCHITECTURE)}
  if config:
    fields.update(num_experts_per_tok=config.top_k, intermediate_size=config.width,
                  router_aux_loss_coef=config.balance_weight or 0.001,
                  output_router_logits=bool(config.balance_weight))
  if attentions:
    layer = attentions[0]
    fields.update(attention_multiplier=layer.scale or (layer.head_dim or features // layer.num_heads)
                  ** -0.5, position_embedding_type="rope" if layer.rope_fraction else None)
  tensors = parts.embedding_norm_and_head_tensors(model, params, "model.norm.weight")
  for i, block in enumerate(blocks):
    prefix = f"model.layers.{i}"
    tensors[f"{prefix}.post_attention_layernorm.weight"] = block["mlp_norm"]["RMSNorm_0"]["scale"]
    tensors.update({**bamba.mixer_tensors(prefix, block), **_mlp_tensors(prefix, block)})
  return fields, tensors


def _mlp_tensors(prefix: str, block: dict[str, Any]) -> dict[str, np.ndarray]:
  """A block's shared expert and experts by Granite's names."""
  experts = block.get("mlp_experts")
  kernels = ({n: experts[f"shared_{n}"] for n in ("gate", "up", "down")} if experts else
             {n: block[f"mlp_{n}"]["kernel"] for n in ("gate", "up", "down")})
  tensors = {
      f"{prefix}.shared_mlp.input_linear.weight":
          np.concatenate([kernels["gate"], kernels["up"]], axis=1).T,
      f"{prefix}.shared_mlp.output_linear.weight": kernels["down"].T}
  if experts:
    where = f"{prefix}.block_sparse_moe"
    tensors.update({
        f"{where}.router.layer.weight": experts["router"].T,
        f"{where}.input_linear.weight":
            np.concatenate([experts["gate"], experts["up"]], axis=2).transpose(0, 2, 1),
        f"{where}.output_linear.weight": experts["down"].transpose(0, 2, 1)})
  return tensors
