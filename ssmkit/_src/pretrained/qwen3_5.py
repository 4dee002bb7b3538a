"""`Qwen3_5ForCausalLM` checkpoints (Qwen3.5's language models) as a `SequenceModel`.

Qwen3.5 interleaves Gated DeltaNet with gated attention, as its config's `layer_types` says
("linear_attention", "full_attention"; by default every fourth layer attends), each in a
pre-norm mixer block with a SwiGLU MLP, then a final norm and an untied head. Every norm scales
by 1 + weight (ssmkit's "rms_plus_one", whose parameters are the stored weights) with the
config's `rms_norm_eps`.

- Gated DeltaNet is `ssmkit.layers.GatedDeltaNet`: `linear_num_key_heads` query/key heads of
  `linear_key_head_dim` channels, read by groups of `linear_num_value_heads` value heads of
  `linear_value_head_dim` channels. The checkpoint's `in_proj_qkv` and its convolution over
  [q | k | v] are ssmkit's three projections and convolutions side by side.
- Attention is `ssmkit.layers.Attention` with an output gate, whose projection the checkpoint
  interleaves with the queries' head by head ([q | gate] per head in `q_proj`), (1 + w) query
  and key norms per head, and `partial_rotary_factor` of each head rotating.

Qwen3.5's published checkpoints are image-text models (`qwen3_5`,
`Qwen3_5ForConditionalGeneration`): their language model (`text_config`,
`model.language_model.*`) loads here and the vision tower (`model.visual.*`) is left out, as are
the multi-token prediction weights (`mtp.*`) that `transformers` does not load either. `save`
writes the language model, which `transformers` loads as a `Qwen3_5ForCausalLM`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.block import mlp_width
from ssmkit._src.layers.gated_deltanet import GatedDeltaNet
from ssmkit._src.pretrained import parts
from ssmkit._src.pretrained.config import Fields, Wrapper
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import FLAX_RMS_EPS, head

ARCHITECTURE = "Qwen3_5ForCausalLM"
MODEL_TYPE = "qwen3_5_text"  # what `transformers` reads to pick the architecture
# The image-text checkpoint that holds the same language model.
WRAPPERS = {"qwen3_5": Wrapper("Qwen3_5ForConditionalGeneration", "model.language_model.",
                               ("model.visual.",))}
# Weights of the checkpoints that no `transformers` model loads: multi-token prediction.
IGNORED = ("mtp.",)
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (GatedDeltaNet, Attention)
REQUIRED = {"block": "mixer", "norm": "rms_plus_one", "mlp": "swiglu", "mlp_bias": False,
            "prenorm": True, "pooling": "none", "decoder_bias": False, "scale_embeddings": False,
            "logit_cap": None}
_KINDS = {GatedDeltaNet: "linear_attention", Attention: "full_attention"}



def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Qwen3.5 `config.json` (its `text_config`).

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  features = fields.int("hidden_size")
  return {**pattern_options(fields), "mlp": "swiglu",
          "mlp_expansion": fields.int("intermediate_size") / features}


def pattern_options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of Qwen3.5's family but its MLP: the pattern of Gated
  DeltaNet and gated attention, the norms, the embedding and head.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  fields.require("hidden_act", "silu")
  features, blocks = fields.int("hidden_size"), fields.int("num_hidden_layers")
  eps = fields.float("rms_norm_eps", 1e-6)
  # As transformers fills it in: every `full_attention_interval`-th layer attends.
  interval = fields.int("full_attention_interval", 4)
  kinds = fields.get("layer_types", ["full_attention" if (i + 1) % interval == 0
                                     else "linear_attention" for i in range(blocks)])
  unknown = sorted(set(kinds) - set(_KINDS.values()))
  if unknown or len(kinds) != blocks:
    raise CheckpointError(f"{fields.source}: `layer_types` must give 'linear_attention' or "
                          f"'full_attention' for each of the {blocks} layers, got {kinds!r}.")
  keys, values = fields.int("linear_key_head_dim", 128), fields.int("linear_value_head_dim", 128)
  if values % keys:
    raise CheckpointError(f"{fields.source}: `linear_value_head_dim`={values} must be a multiple of "
                          f"`linear_key_head_dim`={keys} for ssmkit's GatedDeltaNet (expand_v).")
  deltanet = functools.partial(
      GatedDeltaNet, num_heads=fields.int("linear_num_key_heads", 16), d_state=keys,
      expand_v=values // keys, num_v_heads=fields.int("linear_num_value_heads", 32),
      norm_eps=eps, d_conv=fields.int("linear_conv_kernel_dim", 4))
  attention = functools.partial(Attention, **attention_options(fields), qk_norm_eps=eps)
  layers = {"linear_attention": deltanet, "full_attention": attention}
  vocab = fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features, num_blocks=blocks,
              layer=tuple(layers[kind] for kind in kinds), pooling="none", block="mixer",
              norm="rms_plus_one", norm_eps=eps,
              tie_embeddings=bool(fields.get("tie_word_embeddings", False)), decoder_bias=False)


def attention_options(fields: Fields) -> dict[str, Any]:
  """The `Attention` options of Qwen3.5's and Qwen3-Next's gated attention.

  Raises:
    CheckpointError: naming `rope_parameters` when they are not the default rotary embedding
      or rotate an odd number of channels.
  """
  heads = fields.int("num_attention_heads")
  head_dim = fields.int("head_dim", fields.int("hidden_size") // heads)
  rope = fields.get("rope_parameters", {})
  if rope.get("rope_type", "default") != "default":
    raise CheckpointError(f"{fields.source}: `rope_parameters.rope_type`={rope['rope_type']!r} is "
                          "not supported: ssmkit's rotary embedding is the default one.")
  fraction = float(rope.get("partial_rotary_factor", fields.get("partial_rotary_factor", 0.25)))
  if int(head_dim * fraction) % 2:
    raise CheckpointError(f"{fields.source}: `partial_rotary_factor`={fraction} rotates "
                          f"{int(head_dim * fraction)} of {head_dim} channels, an odd number.")
  return dict(num_heads=heads, num_kv_heads=fields.int("num_key_value_heads", heads),
              head_dim=head_dim, rope_base=float(rope.get("rope_theta", 10_000.0)),
              rope_fraction=fraction, qk_norm="rms_plus_one", output_gate=True,
              use_bias=bool(fields.get("attention_bias", False)))


def params(tensors: Tensors, fields: Fields, model: Any, *, deltanet: Any = None,
           mlp: Any = None) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors.

  `deltanet(tensors, where, layer, features)` and `mlp(tensors, where, model)` read a Gated
  DeltaNet's and a block MLP's (Qwen3-Next's differ); None: Qwen3.5's.
  """
  del fields
  deltanet, mlp = deltanet or deltanet_params, mlp or swiglu
  features = model.features
  norm = parts.norm_reader(tensors, features, "RMSNormPlusOne_0")
  tree = parts.embedding_and_final_norm(tensors, model, "model.norm.weight", "RMSNormPlusOne_0")
  for i in range(model.num_blocks):
    prefix = f"model.layers.{i}"
    layer = model.layer[i % len(model.layer)]()
    tree[f"block_{i}"] = {
        "norm": norm(f"{prefix}.input_layernorm.weight"),
        "mlp_norm": norm(f"{prefix}.post_attention_layernorm.weight"),
        **mlp(tensors, f"{prefix}.mlp", model),
        "mixer": (deltanet(tensors, f"{prefix}.linear_attn", layer, features)
                  if isinstance(layer, GatedDeltaNet)
                  else attention(tensors, f"{prefix}.self_attn", layer, features)),
    }
  return {**tree, **head(tensors, model)}


def swiglu(tensors: Tensors, where: str, model: Any) -> dict[str, Any]:
  """A block's SwiGLU MLP without biases."""
  return parts.swiglu_params(tensors, where, mlp_width(model.features, model.mlp_expansion),
                             model.features)


def deltanet_params(tensors: Tensors, where: str, layer: GatedDeltaNet, features: int
                    ) -> dict[str, Any]:
  """A Gated DeltaNet's parameters from Qwen3.5's separate projections."""
  heads, v_heads, k, v = deltanet_sizes(layer)
  take = lambda name, shape: tensors.take(f"{where}.{name}", shape)
  q_proj, k_proj, v_proj = np.split(
      take("in_proj_qkv.weight", (2 * heads * k + v_heads * v, features)).T,
      [heads * k, 2 * heads * k], axis=1)
  return {"q_proj": q_proj, "k_proj": k_proj, "v_proj": v_proj,
          "g_proj": take("in_proj_z.weight", (v_heads * v, features)).T,
          "b_proj": take("in_proj_b.weight", (v_heads, features)).T,
          "a_proj": take("in_proj_a.weight", (v_heads, features)).T,
          **deltanet_shared(take, layer, features)}


def deltanet_sizes(layer: GatedDeltaNet) -> tuple[int, int, int, int]:
  """(key heads, value heads, K, V) of a Gated DeltaNet."""
  v_heads = layer.num_v_heads or layer.num_heads
  return layer.num_heads, v_heads, layer.d_state, layer.expand_v * layer.d_state


def deltanet_shared(take: Any, layer: GatedDeltaNet, features: int) -> dict[str, np.ndarray]:
  """What Qwen3.5's and Qwen3-Next's Gated DeltaNets store alike: the depthwise convolution
  `(channels, 1, d_conv)` over [q | k | v] (ssmkit's `(d_conv, width)` kernels), the decay's
  parameters, the output norm and projection."""
  heads, v_heads, k, v = deltanet_sizes(layer)
  kernel = take("conv1d.weight", (2 * heads * k + v_heads * v, 1, layer.d_conv))[:, 0, :].T
  q_conv, k_conv, v_conv = np.split(kernel, [heads * k, 2 * heads * k], axis=1)
  return {"q_conv": q_conv, "k_conv": k_conv, "v_conv": v_conv,
          "A_log": take("A_log", (v_heads,)), "dt_bias": take("dt_bias", (v_heads,)),
          "norm_scale": take("norm.weight", (v,)),
          "o_proj": take("out_proj.weight", (features, v_heads * v)).T}


def attention(tensors: Tensors, where: str, layer: Attention, features: int) -> dict[str, Any]:
  """Gated attention's parameters: `q_proj` holds [queries | gate] of each head in turn."""
  heads, kv, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
  take = lambda name, shape: tensors.take(f"{where}.{name}", shape)
  both = take("q_proj.weight", (2 * heads * head_dim, features)).reshape(heads, 2, head_dim, -1)
  tree = {"q_proj": both[:, 0].reshape(heads * head_dim, features).T,
          "gate_proj": both[:, 1].reshape(heads * head_dim, features).T,
          "k_proj": take("k_proj.weight", (kv * head_dim, features)).T,
          "v_proj": take("v_proj.weight", (kv * head_dim, features)).T,
          "o_proj": take("o_proj.weight", (features, heads * head_dim)).T,
          "q_norm": take("q_norm.weight", (head_dim,)),
          "k_norm": take("k_norm.weight", (head_dim,))}
  if layer.use_bias:
    pair = take("q_proj.bias", (2 * heads * head_dim,)).reshape(heads, 2, head_dim)
    tree.update(q_bias=pair[:, 0].reshape(-1), gate_bias=pair[:, 1].reshape(-1),
                k_bias=take("k_proj.bias", (kv * head_dim,)),
                v_bias=take("v_proj.bias", (kv * head_dim,)),
                o_bias=take("o_proj.bias", (features,)))
  return tree


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any], *,
               deltanet: Any = None, mlp: Any = None
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a pattern of Gated DeltaNet and gated attention blocks.

  `deltanet(mixer, layer)` and `mlp(block)` name a Gated DeltaNet's and a block MLP's tensors
  (their names inside `linear_attn.` and `mlp.`); None: Qwen3.5's.

  Raises:
    CheckpointError: naming the option that `transformers`' Qwen3.5 does not have.
  """
  deltanet, mlp = deltanet or deltanet_tensors, mlp or parts.swiglu_tensors
  features = model.features
  made = parts.pattern_layers(model)
  eps = FLAX_RMS_EPS if model.norm_eps is None else model.norm_eps
  deltanets = [layer for layer in made if isinstance(layer, GatedDeltaNet)]
  attentions = [layer for layer in made if isinstance(layer, Attention)]
  for name, group in (("GatedDeltaNet", deltanets), ("Attention", attentions)):
    _expect(len({_settings(layer) for layer in group}) <= 1, f"{name} options",
            "the same in every such layer")
  fields = {"model_type": MODEL_TYPE, "hidden_size": features, "num_hidden_layers": model.num_blocks,
            "intermediate_size": mlp_width(features, model.mlp_expansion), "hidden_act": "silu",
            "rms_norm_eps": eps, "tie_word_embeddings": model.tie_embeddings,
            "layer_types": [_KINDS[type(made[i % len(made)])] for i in range(model.num_blocks)]}
  if deltanets:
    layer = deltanets[0]
    _expect(layer.d_state is not None and layer.norm_eps == eps and not layer.allow_neg_eigval,
            "GatedDeltaNet", f"given d_state, norm_eps the model's norm_eps ({eps}), and "
            "allow_neg_eigval=False")
    fields.update(linear_num_key_heads=layer.num_heads, linear_key_head_dim=layer.d_state,
                  linear_num_value_heads=layer.num_v_heads or layer.num_heads,
                  linear_value_head_dim=layer.expand_v * layer.d_state,
                  linear_conv_kernel_dim=layer.d_conv)
  if attentions:
    layer = attentions[0]
    fields.update(attention_fields(layer, features, eps))
  tensors = parts.embedding_norm_and_head_tensors(model, params, "model.norm.weight",
                                                  "RMSNormPlusOne_0")
  for i, block in enumerate(blocks):
    prefix, mixer = f"model.layers.{i}", block["mixer"]
    tensors[f"{prefix}.input_layernorm.weight"] = block["norm"]["RMSNormPlusOne_0"]["scale"]
    tensors[f"{prefix}.post_attention_layernorm.weight"] = (
        block["mlp_norm"]["RMSNormPlusOne_0"]["scale"])
    place, named = (("linear_attn", deltanet(mixer, made[i % len(made)])) if "A_log" in mixer
                    else ("self_attn", attention_tensors(mixer)))
    for where, values in ((place, named), ("mlp", mlp(block))):
      tensors.update(parts.scoped(f"{prefix}.{where}", values))
  return fields, tensors


def attention_fields(layer: Attention, features: int, eps: float) -> dict[str, Any]:
  """The config.json fields of Qwen3.5's and Qwen3-Next's gated attention.

  Raises:
    CheckpointError: naming the attention option they do not have.
  """
  out_bias = layer.use_bias if layer.out_bias is None else layer.out_bias
  _expect(layer.output_gate and layer.qk_norm == "rms_plus_one" and layer.qk_norm_eps == eps
          and layer.qk_norm_scope == "head", "Attention",
          f"output_gate=True, qk_norm='rms_plus_one' per head, qk_norm_eps={eps}")
  _expect(layer.window is None and layer.logit_cap is None and out_bias == layer.use_bias,
          "Attention", "global (window None), without logit_cap, with out_bias as use_bias")
  heads = layer.num_heads
  return {"num_attention_heads": heads, "num_key_value_heads": layer.num_kv_heads or heads,
          "head_dim": layer.head_dim or features // heads, "attention_bias": layer.use_bias,
          "rope_parameters": {"rope_type": "default", "rope_theta": layer.rope_base,
                              "partial_rotary_factor": layer.rope_fraction}}


def _settings(layer: Any) -> tuple[Any, ...]:
  """The options of a layer that config.json holds once for all such layers."""
  if isinstance(layer, GatedDeltaNet):
    return (layer.num_heads, layer.d_state, layer.expand_v, layer.num_v_heads, layer.norm_eps,
            layer.d_conv)
  return (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.rope_base,
          layer.rope_fraction, layer.window, layer.qk_norm, layer.qk_norm_eps, layer.output_gate,
          layer.logit_cap, layer.use_bias, layer.out_bias)



def deltanet_tensors(mixer: dict[str, Any], layer: GatedDeltaNet) -> dict[str, np.ndarray]:
  """Qwen3.5's Gated DeltaNet tensors from ssmkit's parameters (of `layer`)."""
  del layer  # the projections are apart, each of its own width
  return {
      "in_proj_qkv.weight": np.concatenate([mixer[f"{n}_proj"] for n in "qkv"], axis=1).T,
      "in_proj_z.weight": mixer["g_proj"].T, "in_proj_b.weight": mixer["b_proj"].T,
      "in_proj_a.weight": mixer["a_proj"].T, **deltanet_shared_tensors(mixer),
  }


def deltanet_shared_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  """The tensors of `deltanet_shared`."""
  return {
      "conv1d.weight": np.concatenate([mixer[f"{n}_conv"] for n in "qkv"], axis=1).T[:, None, :],
      "A_log": mixer["A_log"], "dt_bias": mixer["dt_bias"], "norm.weight": mixer["norm_scale"],
      "out_proj.weight": mixer["o_proj"].T,
  }


def attention_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  """Gated attention's tensors, queries and gate interleaved head by head in `q_proj`."""
  head_dim = mixer["q_norm"].shape[0]
  interleave = lambda q, gate: np.stack([q.reshape(-1, head_dim, *q.shape[1:]),
                                         gate.reshape(-1, head_dim, *gate.shape[1:])], 1).reshape(
                                             -1, *q.shape[1:])
  tensors = {"q_proj.weight": interleave(mixer["q_proj"].T, mixer["gate_proj"].T),
             "k_proj.weight": mixer["k_proj"].T, "v_proj.weight": mixer["v_proj"].T,
             "o_proj.weight": mixer["o_proj"].T, "q_norm.weight": mixer["q_norm"],
             "k_norm.weight": mixer["k_norm"]}
  if "q_bias" in mixer:
    tensors.update({"q_proj.bias": interleave(mixer["q_bias"], mixer["gate_bias"]),
                    "k_proj.bias": mixer["k_bias"], "v_proj.bias": mixer["v_bias"],
                    "o_proj.bias": mixer["o_bias"]})
  return tensors


_expect = functools.partial(parts.expect, ARCHITECTURE)
