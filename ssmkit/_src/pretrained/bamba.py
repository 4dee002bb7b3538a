"""`BambaForCausalLM` checkpoints (ibm-ai-platform/Bamba-9B) as a `SequenceModel`.

Bamba interleaves Mamba-2 with attention (at `attn_layer_indices`), each in a pre-norm mixer
block with a SwiGLU MLP (`feed_forward`), then a final RMSNorm and a head. Every norm is an
RMSNorm of `rms_norm_eps`.

- Mamba-2 is `ssmkit.layers.Mamba2(expand=mamba_expand, head_dim=mamba_d_head,
  n_groups=mamba_n_groups, d_state=mamba_d_state, d_conv=mamba_d_conv,
  use_conv_bias=mamba_conv_bias, dt_limit=time_step_limit, norm_eps=rms_norm_eps,
  norm_per_group=True)`, its tensors named as Mamba-2's (`mamba.in_proj`, `mamba.conv1d`, ...).
- Attention is `ssmkit.layers.Attention` over hidden_size / num_attention_heads channels per
  head, the first half of each rotating (`partial_rotary_factor` 0.5, rotate-half layout).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.block import mlp_width
from ssmkit._src.layers.mamba2 import Mamba2
from ssmkit._src.pretrained import mamba2, parts
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import head

ARCHITECTURE = "BambaForCausalLM"
MODEL_TYPE = "bamba"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (Mamba2, Attention)
REQUIRED = {"block": "mixer", "norm": "rms", "mlp": "swiglu", "prenorm": True, "pooling": "none",
            "decoder_bias": False, "scale_embeddings": False, "logit_cap": None}



def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Bamba `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  features, blocks = fields.int("hidden_size"), fields.int("num_hidden_layers")
  eps = fields.float("rms_norm_eps", 1e-5)
  mamba = mamba_layer(fields)
  attention = functools.partial(Attention, **attention_options(fields))
  indices = fields.get("attn_layer_indices", [])
  if not isinstance(indices, list) or not set(indices) <= set(range(blocks)):
    raise CheckpointError(f"{fields.source}: `attn_layer_indices` must list layers of the "
                          f"{blocks}, got {indices!r}.")
  vocab = fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features, num_blocks=blocks,
              layer=tuple(attention if i in indices else mamba for i in range(blocks)),
              pooling="none", block="mixer", norm="rms", norm_eps=eps, mlp="swiglu",
              mlp_expansion=fields.int("intermediate_size") / features,
              mlp_bias=bool(fields.get("mlp_bias", False)),
              tie_embeddings=bool(fields.get("tie_word_embeddings", False)), decoder_bias=False)


def mamba_layer(fields: Fields, inner_field: str | None = None) -> Any:
  """The Mamba-2 layer of the `mamba_*` fields of Bamba, Granite 4.0 and Falcon-H1.

  Its inner width is `mamba_expand` x `hidden_size`, or the field `inner_field` where the
  architecture has one and the config gives it (Falcon-H1's `mamba_d_ssm`; the layer is then
  sized by its heads, `num_heads`).

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  fields.require("hidden_act", "silu")
  fields.require("mamba_proj_bias", False)
  features = fields.int("hidden_size")
  heads, expand = fields.int("mamba_n_heads", 128), fields.int("mamba_expand", 2)
  given = inner_field is not None and fields.get(inner_field, None) is not None
  inner = fields.int(inner_field) if given else expand * features
  head_dim = fields.get("mamba_d_head", "auto")
  head_dim = inner // heads if head_dim == "auto" else fields.int("mamba_d_head")
  if heads * head_dim != inner:
    width = "`mamba_expand` x `hidden_size`"
    width = f"the inner width `{inner_field}` (or {width})" if inner_field else width
    raise CheckpointError(f"{fields.source}: `mamba_n_heads` x `mamba_d_head` = {heads * head_dim} "
                          f"must be {width} = {inner}.")
  size = {"num_heads": heads} if inner_field else {"expand": expand}
  return functools.partial(
      Mamba2, d_state=fields.int("mamba_d_state", 256), d_conv=fields.int("mamba_d_conv", 4),
      use_conv_bias=bool(fields.get("mamba_conv_bias", True)), head_dim=head_dim, **size,
      n_groups=fields.int("mamba_n_groups", 1),
      dt_limit=mamba2.step_limit(fields, "time_step_limit"),
      norm_eps=fields.float("rms_norm_eps", 1e-5), norm_per_group=True)


def attention_options(fields: Fields) -> dict[str, Any]:
  """The `Attention` options of Bamba's attention (also the other Mamba-2 hybrids').

  Raises:
    CheckpointError: naming `rope_parameters` when they are not the default rotary embedding.
  """
  heads = fields.int("num_attention_heads")
  rope = fields.get("rope_parameters", {})
  if rope.get("rope_type", "default") != "default":
    raise CheckpointError(f"{fields.source}: `rope_parameters.rope_type`={rope['rope_type']!r} is "
                          "not supported: ssmkit's rotary embedding is the default one.")
  return dict(num_heads=heads, num_kv_heads=fields.int("num_key_value_heads", heads),
              head_dim=fields.int("head_dim", fields.int("hidden_size") // heads),
              rope_base=float(rope.get("rope_theta", 10_000.0)),
              rope_fraction=float(rope.get("partial_rotary_factor", 0.5)),
              use_bias=bool(fields.get("attention_bias", False)))


def params(tensors: Tensors, fields: Fields, model: Any, *,
           final_norm: str = "model.final_layernorm.weight", mlp_norm: str = "pre_ff_layernorm",
           mlp: Any = None) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors.

  `final_norm`, `mlp_norm` and `mlp(tensors, prefix, model)` name the final norm, the norm
  before the MLP and read a block's MLP (Granite 4.0's differ); None: Bamba's.
  """
  del fields
  features = model.features
  norm = parts.norm_reader(tensors, features)
  width = mlp_width(features, model.mlp_expansion)
  mlp = mlp or (lambda tensors, prefix, model: parts.swiglu_params(
      tensors, f"{prefix}.feed_forward", width, features, model.mlp_bias))
  tree = parts.embedding_and_final_norm(tensors, model, final_norm)
  for i in range(model.num_blocks):
    prefix = f"model.layers.{i}"
    layer = model.layer[i % len(model.layer)]()
    tree[f"block_{i}"] = {
        "norm": norm(f"{prefix}.input_layernorm.weight"),
        "mlp_norm": norm(f"{prefix}.{mlp_norm}.weight"),
        **mlp(tensors, prefix, model),
        "mixer": (mamba2.mixer_params(tensors, f"{prefix}.mamba", layer, features)
                  if isinstance(layer, Mamba2)
                  else parts.attention_params(tensors, f"{prefix}.self_attn", layer, features)),
    }
  return {**tree, **head(tensors, model)}


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a pattern of Mamba-2 and attention blocks.

  Raises:
    CheckpointError: naming the option that `transformers`' Bamba does not have.
  """
  features = model.features
  fields = {"model_type": MODEL_TYPE, "hidden_size": features,
            "num_hidden_layers": model.num_blocks,
            "intermediate_size": mlp_width(features, model.mlp_expansion),
            "mlp_bias": model.mlp_bias, "hidden_act": "silu",
            "tie_word_embeddings": model.tie_embeddings,
            "attn_layer_indices": [i for i, kind in enumerate(mixer_kinds(model))
                                   if kind == "attention"],
            **mixer_fields(model, ARCHITECTURE)}
  tensors = parts.embedding_norm_and_head_tensors(model, params, "model.final_layernorm.weight")
  for i, block in enumerate(blocks):
    prefix = f"model.layers.{i}"
    tensors[f"{prefix}.pre_ff_layernorm.weight"] = block["mlp_norm"]["RMSNorm_0"]["scale"]
    tensors.update(mixer_tensors(prefix, block))
    tensors.update(parts.scoped(f"{prefix}.feed_forward", parts.swiglu_tensors(block)))
  return fields, tensors


def mixer_kinds(model: Any) -> list[str]:
  """"mamba" or "attention" for each block of a pattern of Mamba-2 and attention layers."""
  made = parts.pattern_layers(model)
  return ["mamba" if isinstance(made[i % len(made)], Mamba2) else "attention"
          for i in range(model.num_blocks)]


def mixer_fields(model: Any, architecture: str) -> dict[str, Any]:
  """The config.json fields of the Mamba-2 and attention layers and norms of Bamba and Granite
  4.0 (`architecture`; Granite's attention may have its own logit `scale`).

  Raises:
    CheckpointError: naming the option that the architecture does not have.
  """
  features = model.features
  made = parts.pattern_layers(model)
  eps = 1e-6 if model.norm_eps is None else model.norm_eps
  fields: dict[str, Any] = {"rms_norm_eps": eps}
  mambas = [layer for layer in made if isinstance(layer, Mamba2)]
  attentions = [layer for layer in made if isinstance(layer, Attention)]
  expect = functools.partial(parts.expect, architecture)
  if mambas:
    layer = mambas[0]
    mamba2.check_plain(layer, architecture)
    expect(len({_mamba_settings(m) for m in mambas}) == 1 and layer.norm_per_group
           and layer.norm_eps == eps, "Mamba2 options",
           f"the same in every layer, with norm_per_group=True and norm_eps={eps}")
    inner = mamba2.expanded_width(layer, features, architecture)
    fields.update(mamba_n_heads=inner // layer.head_dim, mamba_d_head=layer.head_dim,
                  mamba_n_groups=layer.n_groups, mamba_d_state=layer.d_state,
                  mamba_d_conv=layer.d_conv, mamba_expand=layer.expand,
                  mamba_conv_bias=layer.use_conv_bias, mamba_proj_bias=False,
                  time_step_limit=mamba2.written_limit(layer.dt_limit))
  if attentions:
    layer = attentions[0]
    heads = layer.num_heads
    out_bias = layer.use_bias if layer.out_bias is None else layer.out_bias
    expect(len({_attention_settings(a) for a in attentions}) == 1 and layer.window is None
           and not layer.qk_norm and not layer.output_gate and layer.logit_cap is None
           and out_bias == layer.use_bias and layer.head_dim in (None, features // heads)
           and (architecture != ARCHITECTURE or (layer.scale is None
                                                 and layer.rope_fraction == 0.5)),
           "Attention options", "the same in every layer, global, without qk_norm, "
           "output_gate or logit_cap, head_dim features / num_heads (Bamba's: half rotary, "
           "no scale of its own)")
    rope = {"rope_type": "default", "rope_theta": layer.rope_base}
    if layer.rope_fraction not in (0.0, 1.0):
      rope["partial_rotary_factor"] = layer.rope_fraction
    fields.update(num_attention_heads=heads, num_key_value_heads=layer.num_kv_heads or heads,
                  attention_bias=layer.use_bias, rope_parameters=rope)
  return fields


def mixer_tensors(prefix: str, block: dict[str, Any]) -> dict[str, np.ndarray]:
  """A block's input norm and Mamba-2 (`mamba.*`) or attention (`self_attn.*`) tensors."""
  mixer = block["mixer"]
  place, named = (("mamba", mamba2.mixer_tensors(mixer)) if "A_log" in mixer
                  else ("self_attn", parts.attention_tensors(mixer)))
  return {f"{prefix}.input_layernorm.weight": block["norm"]["RMSNorm_0"]["scale"],
          **parts.scoped(f"{prefix}.{place}", named)}


def _mamba_settings(layer: Mamba2) -> tuple[Any, ...]:
  return (layer.d_state, layer.d_conv, layer.use_conv_bias, layer.expand, layer.head_dim,
          layer.n_groups, layer.dt_limit, layer.norm_eps, layer.norm_per_group)


def _attention_settings(layer: Attention) -> tuple[Any, ...]:
  return (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.rope_base,
          layer.rope_fraction, layer.window, layer.qk_norm, layer.output_gate, layer.logit_cap,
          layer.scale, layer.use_bias, layer.out_bias)

