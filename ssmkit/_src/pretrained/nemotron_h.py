"""`NemotronHForCausalLM` checkpoints (nvidia/Nemotron-H-8B/47B, NVIDIA-Nemotron-Nano-9B/12B-v2,
Nemotron-3-Nano) as a `SequenceModel`.

Nemotron-H's blocks each hold one sublayer behind an RMSNorm and a residual, by its pattern
(`layers_block_type`, or the older `hybrid_override_pattern` string: "M" Mamba-2, "*"
attention, "-" MLP, "E" experts): `SequenceModel(block="mixer", mlp="none", norm="rms")` over
a pattern of

- `ssmkit.layers.Mamba2(num_heads=mamba_num_heads, head_dim=mamba_head_dim, ...,
  dt_limit=(time_step_min, inf), norm_per_group=True)` (its inner width need not be a multiple
  of the model's);
- `ssmkit.layers.Attention` without positions (`rope_fraction=0`) or biases;
- `ssmkit.layers.FeedForward(kind="relu2", width=intermediate_size)`: down(relu(up x)^2);
- `ssmkit.layers.FeedForward(kind="experts")` of squared-ReLU experts chosen by sigmoid scores
  with DeepSeek-V3's correction bias (`e_score_correction_bias`), grouped choice (`n_group`,
  `topk_group`), renormalisation and `routed_scaling_factor`, beside one shared expert.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.experts import Experts
from ssmkit._src.layers.feed_forward import FeedForward
from ssmkit._src.layers.mamba2 import Mamba2, sizes
from ssmkit._src.pretrained import mamba2, parts
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import embedding_and_head, head_tensors

ARCHITECTURE = "NemotronHForCausalLM"
MODEL_TYPE = "nemotron_h"  # what `transformers` reads to pick the architecture
# The tensors that `transformers` keeps in float32 whatever the model's dtype (parts of the
# names in its `_keep_in_fp32_modules_strict`): the routers and their correction biases.
FLOAT32_TENSORS = ("e_score_correction_bias", "gate.weight")
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (Mamba2, Attention, FeedForward)
REQUIRED = {"block": "mixer", "norm": "rms", "mlp": "none", "prenorm": True, "pooling": "none",
            "decoder_bias": False, "scale_embeddings": False, "logit_cap": None}
# Each block kind by its names in `layers_block_type` (and the older names), and in
# `hybrid_override_pattern`.
_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
          "attention": "attention", "mlp": "mlp", "moe": "moe"}
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_WRITTEN = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "moe": "moe"}



def _kinds(fields: Fields) -> list[str]:
  """"mamba", "attention", "mlp" or "moe" for each block.

  Raises:
    CheckpointError: naming the pattern field when it has another kind.
  """
  if "layers_block_type" in fields.values or "layer_types" in fields.values:
    name = "layers_block_type" if "layers_block_type" in fields.values else "layer_types"
    given, table = fields.get(name), _KINDS
  else:
    name, given, table = "hybrid_override_pattern", list(fields.get("hybrid_override_pattern")), _PATTERN
  unknown = sorted({str(kind) for kind in given} - set(table))
  if unknown or not given:
    raise CheckpointError(f"{fields.source}: `{name}` has block kinds ssmkit does not know: "
                          f"{unknown or given!r} (it knows {sorted(table)}).")
  return [table[kind] for kind in given]


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Nemotron-H `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  fields.require("mamba_hidden_act", "silu")
  fields.require("use_bias", False)
  fields.require("sliding_window", None)
  fields.require("moe_latent_size", None)
  kinds = _kinds(fields)
  features, eps = fields.int("hidden_size"), fields.float("layer_norm_epsilon", 1e-5)
  heads, head_dim = fields.int("mamba_num_heads", 128), fields.int("mamba_head_dim", 64)
  mamba = functools.partial(
      Mamba2, d_state=fields.int("ssm_state_size", 128), d_conv=fields.int("conv_kernel", 4),
      use_conv_bias=bool(fields.get("use_conv_bias", True)), expand=fields.int("expand", 2),
      num_heads=heads, head_dim=head_dim, n_groups=fields.int("n_groups", 8),
      dt_limit=(float(fields.get("time_step_min", 0.001)), math.inf), norm_eps=eps,
      norm_per_group=True)
  attention_heads = fields.int("num_attention_heads")
  attention = functools.partial(
      Attention, num_heads=attention_heads,
      num_kv_heads=fields.int("num_key_value_heads", attention_heads),
      head_dim=fields.int("head_dim", features // attention_heads), rope_fraction=0.0)
  layers = {"mamba": mamba, "attention": attention}
  if "mlp" in kinds or "moe" in kinds:
    fields.require("mlp_hidden_act", "relu2")
  if "mlp" in kinds:
    layers["mlp"] = functools.partial(FeedForward, kind="relu2",
                                      width=fields.int("intermediate_size"),
                                      use_bias=bool(fields.get("mlp_bias", False)))
  if "moe" in kinds:
    fields.require("mlp_bias", False)
    layers["moe"] = functools.partial(FeedForward, kind="experts", experts=_experts(fields))
  vocab = fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features, num_blocks=len(kinds),
              layer=tuple(layers[kind] for kind in kinds), pooling="none", block="mixer",
              norm="rms", norm_eps=eps, mlp="none",
              tie_embeddings=bool(fields.get("tie_word_embeddings", False)), decoder_bias=False)


def _experts(fields: Fields) -> Experts:
  """The mixture of Nemotron-H's "moe" blocks.

  Raises:
    CheckpointError: naming the field whose value the mixture cannot take.
  """
  try:
    return Experts(
        num_experts=fields.int("n_routed_experts"), top_k=fields.int("num_experts_per_tok"),
        width=fields.int("moe_intermediate_size"),
        shared_width=(fields.int("moe_shared_expert_intermediate_size")
                      if fields.get("n_shared_experts", 1) else 0),
        scoring="sigmoid", normalize=bool(fields.get("norm_topk_prob", True)),
        routed_scale=float(fields.get("routed_scaling_factor", 1.0)), score_bias=True,
        groups=fields.int("n_group", 1), top_groups=fields.int("topk_group", 1),
        activation="relu2")
  except ValueError as error:
    raise CheckpointError(f"{fields.source} gives experts ssmkit cannot build: {error}") from None


def params(tensors: Tensors, fields: Fields, model: Any) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors."""
  del fields
  features = model.features
  tree: dict[str, Any] = {}
  for i in range(model.num_blocks):
    prefix = f"backbone.layers.{i}"
    layer = model.layer[i % len(model.layer)]()
    where = f"{prefix}.mixer"
    if isinstance(layer, Mamba2):
      mixer = mamba2.mixer_params(tensors, where, layer, features)
    elif isinstance(layer, Attention):
      mixer = parts.attention_params(tensors, where, layer, features)
    elif layer.kind == "experts":
      mixer = _experts_params(tensors, where, layer.experts, features)
    else:
      mixer = _mlp_params(tensors, where, layer, features)
    tree[f"block_{i}"] = {
        "norm": {"RMSNorm_0": {"scale": tensors.take(f"{prefix}.norm.weight", (features,))}},
        "mixer": mixer}
  return {**tree, **embedding_and_head(tensors, model)}


def _mlp_params(tensors: Tensors, where: str, layer: FeedForward, features: int) -> dict[str, Any]:
  width = layer.width
  tree = {"up_proj": tensors.take(f"{where}.up_proj.weight", (width, features)).T,
          "down_proj": tensors.take(f"{where}.down_proj.weight", (features, width)).T}
  if layer.use_bias:
    tree.update(up_bias=tensors.take(f"{where}.up_proj.bias", (width,)),
                down_bias=tensors.take(f"{where}.down_proj.bias", (features,)))
  return tree


def _experts_params(tensors: Tensors, where: str, config: Experts, features: int
                    ) -> dict[str, Any]:
  width, shared = config.width, config.shared_width
  take = lambda name, shape: tensors.take(f"{where}.{name}", shape)
  stack = lambda name, shape: np.stack([take(f"experts.{e}.{name}.weight", shape).T
                                        for e in range(config.num_experts)])
  tree = {"router": take("gate.weight", (config.num_experts, features)).T,
          "score_bias": take("gate.e_score_correction_bias", (config.num_experts,)),
          "up": stack("up_proj", (width, features)), "down": stack("down_proj", (features, width))}
  if shared:
    tree.update(shared_up=take("shared_experts.up_proj.weight", (shared, features)).T,
                shared_down=take("shared_experts.down_proj.weight", (features, shared)).T)
  return tree


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a pattern of Mamba-2, attention and feed-forward blocks.

  Raises:
    CheckpointError: naming the option that `transformers`' Nemotron-H does not have.
  """
  features = model.features
  made = parts.pattern_layers(model)
  eps = 1e-6 if model.norm_eps is None else model.norm_eps
  order = [made[i % len(made)] for i in range(model.num_blocks)]
  kinds = [_kind(layer) for layer in order]
  fields: dict[str, Any] = {
      "model_type": MODEL_TYPE, "hidden_size": features, "num_hidden_layers": model.num_blocks,
      "layers_block_type": [_WRITTEN[kind] for kind in kinds], "layer_norm_epsilon": eps,
      "tie_word_embeddings": model.tie_embeddings, "use_bias": False, "mamba_hidden_act": "silu",
      "mlp_hidden_act": "relu2"}
  for kind in ("mamba", "attention", "mlp", "moe"):
    group = [layer for layer in made if _kind(layer) == kind]
    if group:
      _expect(len({_settings(layer) for layer in group}) == 1, f"{kind} options",
              "the same in every such layer")
      fields.update(_fields(kind, group[0], features, eps))
  tensors = head_tensors(model, params)
  for i, block in enumerate(blocks):
    prefix, mixer = f"backbone.layers.{i}", block["mixer"]
    tensors[f"{prefix}.norm.weight"] = block["norm"]["RMSNorm_0"]["scale"]
    named = {"mamba": mamba2.mixer_tensors, "attention": parts.attention_tensors,
             "mlp": _mlp_tensors, "moe": _experts_tensors}[kinds[i]](mixer)
    tensors.update(parts.scoped(f"{prefix}.mixer", named))
  return fields, tensors


def _kind(layer: Any) -> str:
  if isinstance(layer, Mamba2):
    return "mamba"
  if isinstance(layer, Attention):
    return "attention"
  return "moe" if layer.kind == "experts" else "mlp"


def _settings(layer: Any) -> tuple[Any, ...]:
  """The options of a layer that config.json holds once for all layers of its kind."""
  return tuple(getattr(layer, name) for name in type(layer).__dataclass_fields__
               if name not in ("parent", "name"))


def _fields(kind: str, layer: Any, features: int, eps: float) -> dict[str, Any]:
  """The config.json fields of the blocks of `kind`, checked to be Nemotron-H's."""
  if kind == "mamba":
    _, heads, _ = sizes(layer, features)
    mamba2.check_plain(layer, ARCHITECTURE)
    _expect(layer.norm_per_group and layer.norm_eps == eps and layer.dt_limit[1] == math.inf,
            "Mamba2", f"norm_per_group=True, norm_eps={eps}, dt_limit=(low, inf)")
    return {"ssm_state_size": layer.d_state, "mamba_num_heads": heads,
            "mamba_head_dim": layer.head_dim, "n_groups": layer.n_groups,
            "conv_kernel": layer.d_conv, "expand": layer.expand,
            "use_conv_bias": layer.use_conv_bias, "time_step_min": layer.dt_limit[0]}
  if kind == "attention":
    heads = layer.num_heads
    _expect(layer.rope_fraction == 0 and not layer.use_bias and not layer.out_bias
            and layer.window is None and not layer.qk_norm and not layer.output_gate
            and layer.logit_cap is None, "Attention",
            "global, without positions (rope_fraction=0), biases, norms, gate or logit cap")
    return {"num_attention_heads": heads, "num_key_value_heads": layer.num_kv_heads or heads,
            "head_dim": layer.head_dim or features // heads, "attention_bias": False}
  if kind == "mlp":
    _expect(layer.kind == "relu2", "FeedForward", "kind='relu2' (or 'experts')")
    return {"intermediate_size": layer.width or 4 * features, "mlp_bias": layer.use_bias}
  config = layer.experts
  _expect(config.scoring == "sigmoid" and config.score_bias and config.activation == "relu2"
          and not config.shared_gate, "the experts",
          "sigmoid-scored with a score bias, squared-ReLU, a shared expert without gate")
  return {"n_routed_experts": config.num_experts, "num_experts_per_tok": config.top_k,
          "moe_intermediate_size": config.width,
          "moe_shared_expert_intermediate_size": config.shared_width or config.width,
          "n_shared_experts": int(bool(config.shared_width)), "norm_topk_prob": config.normalize,
          "routed_scaling_factor": config.routed_scale, "n_group": config.groups,
          "topk_group": config.top_groups, "mlp_bias": False}


def _mlp_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  tensors = {"up_proj.weight": mixer["up_proj"].T, "down_proj.weight": mixer["down_proj"].T}
  tensors.update({f"{n}_proj.bias": mixer[f"{n}_bias"] for n in ("up", "down")
                  if f"{n}_bias" in mixer})
  return tensors


def _experts_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  tensors = {"gate.weight": mixer["router"].T,
             "gate.e_score_correction_bias": mixer["score_bias"]}
  for name in ("up", "down"):
    for e, weight in enumerate(mixer[name]):
      tensors[f"experts.{e}.{name}_proj.weight"] = weight.T
    if f"shared_{name}" in mixer:
      tensors[f"shared_experts.{name}_proj.weight"] = mixer[f"shared_{name}"].T
  return tensors


_expect = functools.partial(parts.expect, ARCHITECTURE)
