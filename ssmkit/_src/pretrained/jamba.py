"""`JambaForCausalLM` checkpoints (ai21labs/AI21-Jamba-Mini/Large-1.x, Jamba-v0.1) as a
`SequenceModel`.

Each Jamba layer is Mamba or attention (every `attn_layer_period`-th from `attn_layer_offset`)
behind `input_layernorm`, then a SwiGLU MLP or a mixture of experts (every
`expert_layer_period`-th from `expert_layer_offset`) behind `pre_ff_layernorm`, each with its
residual. ssmkit builds each layer as two mixer blocks without MLPs (`mlp="none"`): the mixer's,
then one of `ssmkit.layers.FeedForward` (SwiGLU of `intermediate_size`, or experts: softmax
scores, the top `num_experts_per_tok` not renormalised, no shared expert), which computes the
same. The Mamba layers RMS-normalise the step size's input, B and C with learned scales
(`Mamba(selective_norm_eps=rms_norm_eps, selective_norm_scale=True)`); attention has no
positions and no biases.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.experts import Experts
from ssmkit._src.layers.feed_forward import FeedForward
from ssmkit._src.layers.mamba import Mamba
from ssmkit._src.pretrained import mamba, parts
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import head

ARCHITECTURE = "JambaForCausalLM"
MODEL_TYPE = "jamba"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (Mamba, Attention, FeedForward)
REQUIRED = {"block": "mixer", "norm": "rms", "mlp": "none", "prenorm": True, "pooling": "none",
            "decoder_bias": False, "scale_embeddings": False, "logit_cap": None}


def fits(model: Any) -> bool:
  """A Jamba model alternates a mixer block and a feed-forward block, its Mamba layers with
  scaled selective norms."""
  made = [make() for make in model.layer] if isinstance(model.layer, tuple) else []
  return bool(made) and len(made) % 2 == 0 and all(
      isinstance(layer, FeedForward) == (i % 2 == 1) for i, layer in enumerate(made)) and all(
          layer.selective_norm_scale for layer in made if isinstance(layer, Mamba))


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Jamba `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  fields.require("hidden_act", "silu")
  fields.require("mamba_proj_bias", False)
  features, layers = fields.int("hidden_size"), fields.int("num_hidden_layers")
  eps = fields.float("rms_norm_eps", 1e-6)
  rank = fields.get("mamba_dt_rank", "auto")
  mamba_layer = functools.partial(
      Mamba, d_state=fields.int("mamba_d_state", 16), d_conv=fields.int("mamba_d_conv", 4),
      expand=fields.int("mamba_expand", 2),
      dt_rank=math.ceil(features / 16) if rank == "auto" else fields.int("mamba_dt_rank"),
      use_conv_bias=bool(fields.get("mamba_conv_bias", True)), selective_norm_eps=eps,
      selective_norm_scale=True)
  heads = fields.int("num_attention_heads")
  attention = functools.partial(Attention, num_heads=heads,
                                num_kv_heads=fields.int("num_key_value_heads", heads),
                                head_dim=features // heads, rope_fraction=0.0)
  dense = functools.partial(FeedForward, kind="swiglu", width=fields.int("intermediate_size"))
  count = fields.get("num_experts", 16)
  if count > 1:
    try:
      experts = Experts(num_experts=fields.int("num_experts"),
                        top_k=fields.int("num_experts_per_tok"),
                        width=fields.int("intermediate_size"), normalize=False,
                        balance_weight=float(fields.get("router_aux_loss_coef", 0.001))
                        if fields.get("output_router_logits", False) else 0.0)
    except ValueError as error:
      raise CheckpointError(f"{fields.source} gives experts ssmkit cannot build: {error}") from None
    sparse = functools.partial(FeedForward, kind="experts", experts=experts)
  pattern = []
  for i in range(layers):
    pattern.append(attention if _every(fields, "attn_layer", i) else mamba_layer)
    pattern.append(sparse if count > 1 and _every(fields, "expert_layer", i) else dense)
  vocab = fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features, num_blocks=2 * layers,
              layer=tuple(pattern), pooling="none", block="mixer", norm="rms", norm_eps=eps,
              mlp="none", tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
              decoder_bias=False)


def _every(fields: Fields, name: str, index: int) -> bool:
  """Whether layer `index` is one of every `<name>_period`-th from `<name>_offset`."""
  period = fields.int(f"{name}_period")
  return index % period == fields.get(f"{name}_offset", 0)


def params(tensors: Tensors, fields: Fields, model: Any) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors."""
  del fields
  features = model.features

  def read(prefix: str, which: int, layer: Any) -> tuple[str, dict[str, Any]]:
    if which:
      return (f"{prefix}.pre_ff_layernorm.weight",
              _feed_forward_params(tensors, f"{prefix}.feed_forward", layer, features))
    return (f"{prefix}.input_layernorm.weight",
            mamba.mixer_params(tensors, f"{prefix}.mamba", layer, features)
            if isinstance(layer, Mamba)
            else parts.attention_params(tensors, f"{prefix}.self_attn", layer, features))

  tree = parts.paired_blocks(tensors, model, "model.final_layernorm.weight", read)
  return {**tree, **head(tensors, model)}


def _feed_forward_params(tensors: Tensors, where: str, layer: FeedForward, features: int
                         ) -> dict[str, Any]:
  take = lambda name, shape: tensors.take(f"{where}.{name}.weight", shape).T
  if layer.kind != "experts":
    return parts.swiglu_feed_forward_params(take, layer.width, features)
  config = layer.experts
  stack = lambda name, shape: np.stack([take(f"experts.{e}.{name}", shape)
                                        for e in range(config.num_experts)])
  return {"router": take("router", (config.num_experts, features)),
          "gate": stack("gate_proj", (config.width, features)),
          "up": stack("up_proj", (config.width, features)),
          "down": stack("down_proj", (features, config.width))}


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of Jamba's layers.

  Raises:
    CheckpointError: naming the option that `transformers`' Jamba does not have.
  """
  features = model.features
  made = [make() for make in model.layer]
  eps = 1e-6 if model.norm_eps is None else model.norm_eps
  layers = model.num_blocks // 2
  mixers = [made[(2 * i) % len(made)] for i in range(layers)]
  feeds = [made[(2 * i + 1) % len(made)] for i in range(layers)]
  fields: dict[str, Any] = {
      "model_type": MODEL_TYPE, "hidden_size": features, "num_hidden_layers": layers,
      "rms_norm_eps": eps, "hidden_act": "silu", "tie_word_embeddings": model.tie_embeddings,
      "mamba_proj_bias": False}
  fields.update(_periodic("attn_layer", [isinstance(m, Attention) for m in mixers]))
  fields.update(_periodic("expert_layer", [f.kind == "experts" for f in feeds]))
  for layer in mixers:
    if isinstance(layer, Mamba):
      _expect(layer.selective_norm_eps == eps and not layer.use_bias, "Mamba",
              f"selective_norm_eps={eps} with scales, no projection biases")
      fields.update(mamba_d_state=layer.d_state, mamba_d_conv=layer.d_conv,
                    mamba_expand=layer.expand,
                    mamba_dt_rank=layer.dt_rank or math.ceil(features / 16),
                    mamba_conv_bias=layer.use_conv_bias)
    else:
      heads = layer.num_heads
      _expect(layer.rope_fraction == 0 and not layer.use_bias and not layer.out_bias
              and layer.window is None and not layer.qk_norm and not layer.output_gate
              and layer.logit_cap is None and layer.scale is None
              and layer.head_dim in (None, features // heads), "Attention",
              "global, without positions, biases, norms, gate, cap or scale")
      fields.update(num_attention_heads=heads, num_key_value_heads=layer.num_kv_heads or heads)
  for layer in feeds:
    if layer.kind == "experts":
      config = layer.experts
      _expect((config.scoring, config.normalize, config.shared_width, config.routed_scale,
               config.score_bias, config.groups, config.activation) == (
                   "softmax", False, 0, 1.0, False, 1, "swiglu"), "the experts",
              "softmax-scored SwiGLU experts, not renormalised, without shared experts")
      fields.update(num_experts=config.num_experts, num_experts_per_tok=config.top_k,
                    intermediate_size=config.width,
                    router_aux_loss_coef=config.balance_weight or 0.001,
                    output_router_logits=bool(config.balance_weight))
    else:
      _expect(layer.kind == "swiglu" and not layer.use_bias, "FeedForward",
              "kind='swiglu' without biases")
      fields["intermediate_size"] = layer.width or 4 * features
  if not any(f.kind == "experts" for f in feeds):
    fields["num_experts"] = 1
  tensors = parts.embedding_norm_and_head_tensors(model, params, "model.final_layernorm.weight")
  for i in range(layers):
    prefix, first, second = f"model.layers.{i}", blocks[2 * i], blocks[2 * i + 1]
    mixer = first["mixer"]
    place, named = (("mamba", mamba.mixer_tensors(mixer)) if "A_log" in mixer
                    else ("self_attn", parts.attention_tensors(mixer)))
    tensors[f"{prefix}.input_layernorm.weight"] = first["norm"]["RMSNorm_0"]["scale"]
    tensors[f"{prefix}.pre_ff_layernorm.weight"] = second["norm"]["RMSNorm_0"]["scale"]
    tensors.update(parts.scoped(f"{prefix}.{place}", named))
    tensors.update(parts.scoped(f"{prefix}.feed_forward", _feed_forward_tensors(second["mixer"])))
  return fields, tensors


def _periodic(name: str, marked: list[bool]) -> dict[str, int]:
  """`<name>_period` and `<name>_offset` that mark exactly the layers `marked`, the longest
  period where several do (one mark in 4 layers: period 4, as a config of 4 layers has it).

  Raises:
    CheckpointError: when no period and offset do.
  """
  for period in range(len(marked), 0, -1):
    for offset in range(period):
      if marked == [i % period == offset for i in range(len(marked))]:
        return {f"{name}_period": period, f"{name}_offset": offset}
  if not any(marked):
    return {f"{name}_period": len(marked) + 1, f"{name}_offset": len(marked)}
  raise CheckpointError(f"`model`: a {ARCHITECTURE} places its {name.split('_')[0]} layers every "
                        f"`{name}_period`-th; the model has them at "
                        f"{[i for i, m in enumerate(marked) if m]}.")


def _feed_forward_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  if "router" not in mixer:
    return parts.swiglu_feed_forward_tensors(mixer)
  tensors = {"router.weight": mixer["router"].T}
  for name in ("gate", "up", "down"):
    for e, weight in enumerate(mixer[name]):
      tensors[f"experts.{e}.{name}_proj.weight"] = weight.T
  return tensors


_expect = functools.partial(parts.expect, ARCHITECTURE)
