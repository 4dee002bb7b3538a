"""`OlmoHybridForCausalLM` checkpoints (allenai/Olmo-Hybrid-*) as a `SequenceModel`.

OLMo Hybrid interleaves Gated DeltaNet with attention by `layer_types` (by default every
fourth layer attends), each with a SwiGLU MLP, then a final RMSNorm and a head; every norm an
RMSNorm of `rms_norm_eps`.

- Gated DeltaNet blocks are pre-norm: `ssmkit.layers.GatedDeltaNet(num_heads=
  linear_num_key_heads, num_v_heads=linear_num_value_heads, allow_neg_eigval=
  linear_allow_neg_eigval, norm_eps=1e-5)` (its output norm's epsilon is fixed, as
  flash-linear-attention's), with separate q, k, v projections and convolutions.
- Attention blocks are OLMo 2's: each norm on its branch's output (`norm_position="output"`
  at those places of the pattern), queries and keys RMS-normalised over all heads together
  (`Attention(qk_norm="rms", qk_norm_scope="all")`), rotary positions unless
  `rope_parameters.rope_theta` is null (the published checkpoints': NoPE).

The checkpoints name some weights otherwise than `transformers`' modules (its conversion
mapping): the pre-norm blocks' norms `attention_layer_norm` and `feedforward_layer_norm` (the
latter also the attention blocks' norm after attention), and the convolution as
`q_conv1d`, `k_conv1d`, `v_conv1d`; `load` reads and `save` writes those names.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.block import mlp_width
from ssmkit._src.layers.gated_deltanet import GatedDeltaNet
from ssmkit._src.layers.model import norm_positions
from ssmkit._src.pretrained import parts
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import FLAX_RMS_EPS, head
from ssmkit._src.pretrained.qwen3_5 import deltanet_sizes

ARCHITECTURE = "OlmoHybridForCausalLM"
MODEL_TYPE = "olmo_hybrid"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (GatedDeltaNet, Attention)
REQUIRED = {"block": "mixer", "norm": "rms", "mlp": "swiglu", "mlp_bias": False, "prenorm": True,
            "pooling": "none", "decoder_bias": False, "scale_embeddings": False,
            "logit_cap": None}
WRITES = ("norm_position",)  # its options beyond the usual
# The epsilon of the Gated DeltaNet's output norm, whatever the config's.
DELTANET_EPS = 1e-5
DEFAULT_THETA = 10_000.0  # the rotary base of a config that gives none
_KINDS = {GatedDeltaNet: "linear_attention", Attention: "full_attention"}
# The norms of each kind of block: (before or after the mixer, before or after the MLP).
_NORMS = {"linear_attention": ("attention_layer_norm", "feedforward_layer_norm"),
          "full_attention": ("feedforward_layer_norm", "post_feedforward_layernorm")}


def fits(model: Any) -> bool:
  """An OLMo Hybrid model has plain RMSNorms (Qwen3.5's are (1 + w) ones)."""
  return model.norm == "rms"


def _kinds(fields: Fields, blocks: int) -> list[str]:
  """`layer_types`, or transformers' default: every fourth layer attends, the last at least."""
  default = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(blocks)]
  if "full_attention" not in default:
    default[-1] = "full_attention"
  kinds = fields.get("layer_types", default)
  if (not isinstance(kinds, list) or len(kinds) != blocks
      or set(kinds) != {"linear_attention", "full_attention"}):
    raise CheckpointError(f"{fields.source}: `layer_types` must give 'linear_attention' or "
                          f"'full_attention' for each of the {blocks} layers, each at least "
                          f"once, got {kinds!r}.")
  return kinds


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of an OLMo Hybrid `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  fields.require("hidden_act", "silu")
  features, blocks = fields.int("hidden_size"), fields.int("num_hidden_layers")
  heads = fields.int("num_attention_heads")
  eps = fields.float("rms_norm_eps", 1e-6)
  key_heads = fields.int("linear_num_key_heads", heads)
  keys = fields.int("linear_key_head_dim", int(0.75 * features / key_heads))
  values = fields.int("linear_value_head_dim", 2 * keys)
  if values % keys:
    raise CheckpointError(f"{fields.source}: `linear_value_head_dim`={values} must be a multiple of "
                          f"`linear_key_head_dim`={keys} for ssmkit's GatedDeltaNet (expand_v).")
  deltanet = functools.partial(
      GatedDeltaNet, num_heads=key_heads, d_state=keys, expand_v=values // keys,
      num_v_heads=fields.int("linear_num_value_heads", heads), norm_eps=DELTANET_EPS,
      allow_neg_eigval=bool(fields.get("linear_allow_neg_eigval", True)),
      d_conv=fields.int("linear_conv_kernel_dim", 4))
  rope = fields.get("rope_parameters", {})
  if not isinstance(rope, dict):
    raise CheckpointError(f"{fields.source}: `rope_parameters` must be an object or null, got "
                          f"{rope!r}.")
  # As transformers fills it in: a `rope_theta` of null (the published checkpoints') turns the
  # rotary embedding off; a missing one is the default base.
  theta = rope.get("rope_theta", fields.values.get("rope_theta", DEFAULT_THETA))
  if theta is not None and rope.get("rope_type", "default") != "default":
    raise CheckpointError(f"{fields.source}: `rope_parameters.rope_type`={rope['rope_type']!r} is "
                          "not supported: ssmkit's rotary embedding is the default one.")
  attention = functools.partial(
      Attention, num_heads=heads, num_kv_heads=fields.int("num_key_value_heads", heads),
      head_dim=fields.int("head_dim", features // heads),
      rope_fraction=0.0 if theta is None else 1.0,
      rope_base=DEFAULT_THETA if theta is None else float(theta), qk_norm="rms",
      qk_norm_scope="all", qk_norm_eps=eps, use_bias=bool(fields.get("attention_bias", False)))
  kinds = _kinds(fields, blocks)
  vocab = fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features, num_blocks=blocks,
              layer=tuple(deltanet if kind == "linear_attention" else attention for kind in kinds),
              norm_position=tuple("input" if kind == "linear_attention" else "output"
                                  for kind in kinds),
              pooling="none", block="mixer", norm="rms", norm_eps=eps, mlp="swiglu",
              mlp_expansion=fields.int("intermediate_size") / features,
              tie_embeddings=bool(fields.get("tie_word_embeddings", False)), decoder_bias=False)


def params(tensors: Tensors, fields: Fields, model: Any) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors."""
  del fields
  features = model.features
  norm = parts.norm_reader(tensors, features)
  width = mlp_width(features, model.mlp_expansion)
  tree = parts.embedding_and_final_norm(tensors, model, "model.norm.weight")
  for i in range(model.num_blocks):
    prefix = f"model.layers.{i}"
    layer = model.layer[i % len(model.layer)]()
    kind = _KINDS[type(layer)]
    before, after = _NORMS[kind]
    tree[f"block_{i}"] = {
        "norm": norm(f"{prefix}.{before}.weight"),
        "mlp_norm": norm(f"{prefix}.{after}.weight"),
        **parts.swiglu_params(tensors, f"{prefix}.mlp", width, features),
        "mixer": (_deltanet_params(tensors, f"{prefix}.linear_attn", layer, features)
                  if kind == "linear_attention"
                  else _attention_params(tensors, f"{prefix}.self_attn", layer, features)),
    }
  return {**tree, **head(tensors, model)}


def _deltanet_params(tensors: Tensors, where: str, layer: GatedDeltaNet, features: int
                     ) -> dict[str, Any]:
  """A Gated DeltaNet's parameters: each projection and convolution by its own name."""
  heads, v_heads, k, v = deltanet_sizes(layer)
  take = lambda name, shape: tensors.take(f"{where}.{name}", shape)
  widths = {"q": heads * k, "k": heads * k, "v": v_heads * v}
  tree = {f"{n}_proj": take(f"{n}_proj.weight", (w, features)).T for n, w in widths.items()}
  # transformers concatenates the three convolutions (and writes them back in three equal
  # parts): their rows in order are [q | k | v], however the files divide them.
  stored = [tensors.take(f"{where}.{n}_conv1d.weight", None) for n in widths]
  kernel = np.concatenate(stored)
  if kernel.shape != (sum(widths.values()), 1, layer.d_conv) or any(
      s.shape[1:] != (1, layer.d_conv) for s in stored):
    raise CheckpointError(f"{tensors.source}: the weights '{where}.{{q,k,v}}_conv1d.weight' have "
                          f"shapes {[s.shape for s in stored]}; their rows together must be "
                          f"{sum(widths.values())} of shape (1, {layer.d_conv}).")
  kernels = np.split(kernel[:, 0, :].T, np.cumsum(list(widths.values()))[:-1], axis=1)
  tree.update({f"{n}_conv": part for n, part in zip(widths, kernels, strict=True)})
  return {**tree, "g_proj": take("g_proj.weight", (v_heads * v, features)).T,
          "a_proj": take("a_proj.weight", (v_heads, features)).T,
          "b_proj": take("b_proj.weight", (v_heads, features)).T,
          "A_log": take("A_log", (v_heads,)), "dt_bias": take("dt_bias", (v_heads,)),
          "norm_scale": take("o_norm.weight", (v,)),
          "o_proj": take("o_proj.weight", (features, v_heads * v)).T}


def _attention_params(tensors: Tensors, where: str, layer: Attention, features: int
                      ) -> dict[str, Any]:
  """Attention's projections and its norms over all heads' queries and keys."""
  heads, kv, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
  return {**parts.attention_params(tensors, where, layer, features),
          "q_norm": tensors.take(f"{where}.q_norm.weight", (heads * head_dim,)),
          "k_norm": tensors.take(f"{where}.k_norm.weight", (kv * head_dim,))}


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of an OLMo Hybrid model.

  Raises:
    CheckpointError: naming the option that `transformers`' OLMo Hybrid does not have.
  """
  features = model.features
  made = parts.pattern_layers(model)
  kinds = [_KINDS[type(made[i % len(made)])] for i in range(model.num_blocks)]
  positions = norm_positions(model)
  eps = FLAX_RMS_EPS if model.norm_eps is None else model.norm_eps
  _expect(set(kinds) == set(_KINDS.values()), "layers", "Gated DeltaNet and attention, both")
  _expect(all(positions[i % len(made)] == ("input" if kind == "linear_attention" else "output")
              for i, kind in enumerate(kinds)), "norm_position",
          "'input' at its GatedDeltaNet layers and 'output' at its Attention layers")
  deltanets = [layer for layer in made if isinstance(layer, GatedDeltaNet)]
  attentions = [layer for layer in made if isinstance(layer, Attention)]
  layer = deltanets[0]
  _expect(len({_deltanet_settings(d) for d in deltanets}) == 1 and layer.d_state is not None
          and layer.norm_eps == DELTANET_EPS, "GatedDeltaNet options",
          f"the same in every layer, with d_state given and norm_eps={DELTANET_EPS}")
  heads, v_heads, k, v = deltanet_sizes(layer)
  attention = attentions[0]
  out_bias = attention.use_bias if attention.out_bias is None else attention.out_bias
  _expect(len({_attention_settings(a) for a in attentions}) == 1
          and attention.qk_norm in (True, "rms") and attention.qk_norm_scope == "all"
          and attention.qk_norm_eps == eps and attention.rope_fraction in (0.0, 1.0)
          and attention.window is None and not attention.output_gate
          and attention.logit_cap is None and attention.scale is None
          and out_bias == attention.use_bias, "Attention options",
          f"the same in every layer, global, qk_norm='rms' over all heads with qk_norm_eps="
          f"{eps}, all channels rotating or none, without output_gate, logit_cap or scale")
  fields = {
      "model_type": MODEL_TYPE, "hidden_size": features, "num_hidden_layers": model.num_blocks,
      "intermediate_size": mlp_width(features, model.mlp_expansion), "hidden_act": "silu",
      "rms_norm_eps": eps, "tie_word_embeddings": model.tie_embeddings, "layer_types": kinds,
      "linear_num_key_heads": heads, "linear_num_value_heads": v_heads,
      "linear_key_head_dim": k, "linear_value_head_dim": v,
      "linear_conv_kernel_dim": layer.d_conv, "linear_allow_neg_eigval": layer.allow_neg_eigval,
      "num_attention_heads": attention.num_heads,
      "num_key_value_heads": attention.num_kv_heads or attention.num_heads,
      "head_dim": attention.head_dim or features // attention.num_heads,
      "attention_bias": attention.use_bias,
      "rope_parameters": {"rope_type": "default",
                          "rope_theta": attention.rope_base if attention.rope_fraction else None}}
  tensors = parts.embedding_norm_and_head_tensors(model, params, "model.norm.weight")
  for i, block in enumerate(blocks):
    prefix, mixer = f"model.layers.{i}", block["mixer"]
    before, after = _NORMS[kinds[i]]
    tensors.update({f"{prefix}.{before}.weight": block["norm"]["RMSNorm_0"]["scale"],
                    f"{prefix}.{after}.weight": block["mlp_norm"]["RMSNorm_0"]["scale"],
                    **parts.scoped(f"{prefix}.mlp", parts.swiglu_tensors(block))})
    if kinds[i] == "linear_attention":
      named = {f"{n}_proj.weight": mixer[f"{n}_proj"].T for n in "qkvgab"}
      named.update({f"{n}_conv1d.weight": mixer[f"{n}_conv"].T[:, None, :] for n in "qkv"})
      named.update({"A_log": mixer["A_log"], "dt_bias": mixer["dt_bias"],
                    "o_norm.weight": mixer["norm_scale"], "o_proj.weight": mixer["o_proj"].T})
      tensors.update(parts.scoped(f"{prefix}.linear_attn", named))
    else:
      named = {**parts.attention_tensors(mixer), "q_norm.weight": mixer["q_norm"],
               "k_norm.weight": mixer["k_norm"]}
      tensors.update(parts.scoped(f"{prefix}.self_attn", named))
  return fields, tensors


def _deltanet_settings(layer: GatedDeltaNet) -> tuple[Any, ...]:
  return (layer.num_heads, layer.d_state, layer.expand_v, layer.num_v_heads, layer.norm_eps,
          layer.allow_neg_eigval, layer.d_conv)


def _attention_settings(layer: Attention) -> tuple[Any, ...]:
  return (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.rope_base,
          layer.rope_fraction, layer.window, layer.qk_norm, layer.qk_norm_scope,
          layer.qk_norm_eps, layer.output_gate, layer.logit_cap, layer.scale, layer.use_bias,
          layer.out_bias)


_expect = functools.partial(parts.expect, ARCHITECTURE)
