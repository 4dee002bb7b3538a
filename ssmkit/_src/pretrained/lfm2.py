"""`Lfm2ForCausalLM` checkpoints (LiquidAI/LFM2-350M, -700M, -1.2B, -2.6B) as a `SequenceModel`.

LFM2 interleaves gated short convolutions (`ssmkit.layers.ShortConv`) with grouped-query
attention whose queries and keys pass an RMSNorm per head (`Attention(qk_norm="rms")`), by
`layer_types` ("conv", "full_attention"; or `full_attn_idxs`), each in a pre-norm mixer block
(`operator_norm`, `ffn_norm`) with a SwiGLU MLP (`w1` gate, `w3` up, `w2` down, its width
`intermediate_size` adjusted as `block_auto_adjust_ff_dim` says), then the final norm
(`embedding_norm`) and the tied head. Every norm is an RMSNorm of `norm_eps`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.block import mlp_width
from ssmkit._src.layers.short_conv import ShortConv
from ssmkit._src.pretrained import parts
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import head

ARCHITECTURE = "Lfm2ForCausalLM"
MODEL_TYPE = "lfm2"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (ShortConv, Attention)
REQUIRED = {"block": "mixer", "norm": "rms", "mlp": "swiglu", "mlp_bias": False, "prenorm": True,
            "pooling": "none", "decoder_bias": False, "scale_embeddings": False, "logit_cap": None}
_MLP = {"gate": "w1", "up": "w3", "down": "w2"}



def _width(fields: Fields) -> int:
  """The MLP's hidden width, as `transformers`' `Lfm2MLP` computes it."""
  width = fields.int("intermediate_size")
  if fields.get("block_auto_adjust_ff_dim", True):
    width = int(2 * width / 3)
    multiplier = fields.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
      multiple = fields.int("block_multiple_of", 256)
      width = int(multiplier * width)
      width = multiple * ((width + multiple - 1) // multiple)
  return width


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of an LFM2 `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  features, blocks = fields.int("hidden_size"), fields.int("num_hidden_layers")
  eps = fields.float("norm_eps", 1e-5)
  kinds = fields.get("layer_types", None)
  if kinds is None:
    attending = fields.get("full_attn_idxs", list(range(blocks)))
    kinds = ["full_attention" if i in attending else "conv" for i in range(blocks)]
  if len(kinds) != blocks or set(kinds) - {"conv", "full_attention"}:
    raise CheckpointError(f"{fields.source}: `layer_types` must give 'conv' or 'full_attention' "
                          f"for each of the {blocks} layers, got {kinds!r}.")
  rope = fields.get("rope_parameters", {})
  if rope.get("rope_type", "default") != "default":
    raise CheckpointError(f"{fields.source}: `rope_parameters.rope_type`={rope['rope_type']!r} is "
                          "not supported: ssmkit's rotary embedding is the default one.")
  heads = fields.int("num_attention_heads")
  attention = functools.partial(
      Attention, num_heads=heads, num_kv_heads=fields.int("num_key_value_heads", heads),
      head_dim=features // heads, rope_base=float(rope.get("rope_theta", 1_000_000.0)),
      qk_norm="rms", qk_norm_eps=eps)
  conv = functools.partial(ShortConv, d_conv=fields.int("conv_L_cache", 3),
                           use_bias=bool(fields.get("conv_bias", False)))
  vocab = fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features, num_blocks=blocks,
              layer=tuple(conv if kind == "conv" else attention for kind in kinds),
              pooling="none", block="mixer", norm="rms", norm_eps=eps, mlp="swiglu",
              mlp_expansion=_width(fields) / features,
              tie_embeddings=bool(fields.get("tie_word_embeddings", True)), decoder_bias=False)


def params(tensors: Tensors, fields: Fields, model: Any) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors."""
  del fields
  features = model.features
  norm = parts.norm_reader(tensors, features)
  width = mlp_width(features, model.mlp_expansion)
  tree = parts.embedding_and_final_norm(tensors, model, "model.embedding_norm.weight")
  for i in range(model.num_blocks):
    prefix = f"model.layers.{i}"
    layer = model.layer[i % len(model.layer)]()
    take = lambda name, shape, prefix=prefix: tensors.take(f"{prefix}.{name}", shape)
    tree[f"block_{i}"] = {
        "norm": norm(f"{prefix}.operator_norm.weight"),
        "mlp_norm": norm(f"{prefix}.ffn_norm.weight"),
        **{f"mlp_{n}": {"kernel": take(f"feed_forward.{w}.weight", (
            (features, width) if n == "down" else (width, features))).T} for n, w in _MLP.items()},
        "mixer": (_conv_params(take, layer, features) if isinstance(layer, ShortConv)
                  else _attention_params(tensors, f"{prefix}.self_attn", layer, features)),
    }
  return {**tree, **head(tensors, model)}


def _conv_params(take: Any, layer: ShortConv, features: int) -> dict[str, Any]:
  tree = {"in_proj": take("conv.in_proj.weight", (3 * features, features)).T,
          "conv_kernel": take("conv.conv.weight", (features, 1, layer.d_conv))[:, 0, :].T,
          "out_proj": take("conv.out_proj.weight", (features, features)).T}
  if layer.use_bias:
    tree.update(in_bias=take("conv.in_proj.bias", (3 * features,)),
                conv_bias=take("conv.conv.bias", (features,)),
                out_bias=take("conv.out_proj.bias", (features,)))
  return tree


def _attention_params(tensors: Tensors, where: str, layer: Attention, features: int
                      ) -> dict[str, Any]:
  """Attention's projections (its output one named `out_proj`) and per-head norms."""
  tree = parts.attention_params(tensors, where, layer, features, out="out_proj")
  return {**tree, "q_norm": tensors.take(f"{where}.q_layernorm.weight", (layer.head_dim,)),
          "k_norm": tensors.take(f"{where}.k_layernorm.weight", (layer.head_dim,))}


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a pattern of short convolutions and attention.

  Raises:
    CheckpointError: naming the option that `transformers`' LFM2 does not have.
  """
  features = model.features
  made = parts.pattern_layers(model)
  eps = 1e-6 if model.norm_eps is None else model.norm_eps
  order = [made[i % len(made)] for i in range(model.num_blocks)]
  convs = [layer for layer in made if isinstance(layer, ShortConv)]
  attentions = [layer for layer in made if isinstance(layer, Attention)]
  fields: dict[str, Any] = {
      "model_type": MODEL_TYPE, "hidden_size": features, "num_hidden_layers": model.num_blocks,
      "norm_eps": eps, "tie_word_embeddings": model.tie_embeddings,
      "intermediate_size": mlp_width(features, model.mlp_expansion),
      "block_auto_adjust_ff_dim": False,
      "layer_types": ["conv" if isinstance(layer, ShortConv) else "full_attention"
                      for layer in order]}
  if convs:
    _expect(len({(c.d_conv, c.use_bias) for c in convs}) == 1, "ShortConv options",
            "the same in every layer")
    fields.update(conv_L_cache=convs[0].d_conv, conv_bias=convs[0].use_bias)
  if attentions:
    layer = attentions[0]
    heads = layer.num_heads
    _expect(layer.qk_norm in (True, "rms") and layer.qk_norm_scope == "head"
            and layer.qk_norm_eps == eps and layer.window is None
            and not layer.use_bias and not layer.out_bias and not layer.output_gate
            and layer.logit_cap is None and layer.scale is None and layer.rope_fraction == 1.0
            and layer.head_dim in (None, features // heads), "Attention",
            f"global with q/k RMSNorms of epsilon {eps}, full rotary, no biases, gate, cap or "
            "scale, head_dim features / num_heads")
    fields.update(num_attention_heads=heads, num_key_value_heads=layer.num_kv_heads or heads,
                  rope_parameters={"rope_type": "default", "rope_theta": layer.rope_base})
  tensors = parts.embedding_norm_and_head_tensors(model, params, "model.embedding_norm.weight")
  for i, block in enumerate(blocks):
    prefix, mixer = f"model.layers.{i}", block["mixer"]
    tensors[f"{prefix}.operator_norm.weight"] = block["norm"]["RMSNorm_0"]["scale"]
    tensors[f"{prefix}.ffn_norm.weight"] = block["mlp_norm"]["RMSNorm_0"]["scale"]
    for n, w in _MLP.items():
      tensors[f"{prefix}.feed_forward.{w}.weight"] = block[f"mlp_{n}"]["kernel"].T
    if "conv_kernel" in mixer:
      tensors.update({f"{prefix}.conv.in_proj.weight": mixer["in_proj"].T,
                      f"{prefix}.conv.conv.weight": mixer["conv_kernel"].T[:, None, :],
                      f"{prefix}.conv.out_proj.weight": mixer["out_proj"].T})
      tensors.update({f"{prefix}.conv.{name}.bias": mixer[key] for name, key in (
          ("in_proj", "in_bias"), ("conv", "conv_bias"), ("out_proj", "out_bias")) if key in mixer})
    else:
      named = parts.attention_tensors(mixer, out="out_proj")
      named.update({"q_layernorm.weight": mixer["q_norm"], "k_layernorm.weight": mixer["k_norm"]})
      tensors.update(parts.scoped(f"{prefix}.self_attn", named))
  return fields, tensors


_expect = functools.partial(parts.expect, ARCHITECTURE)
