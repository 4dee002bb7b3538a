"""`RecurrentGemmaForCausalLM` checkpoints (google/recurrentgemma-2b, 9b) as a `SequenceModel`.

Griffin: the config's `block_types` (RG-LRU "recurrent" blocks and local "attention") cycled
over the layers, each a pre-norm mixer block with a GeGLU MLP (biases, each branch
`intermediate_size / 2` wide), then a final RMSNorm, the embedding's transpose as the head and
a soft cap of the logits. Gemma's norms scale by 1 + weight: ssmkit's norm "rms_plus_one",
whose parameters are the stored weights. The embeddings are scaled by sqrt(hidden) rounded to
bfloat16, as `transformers` keeps the constant. The attention blocks have an output bias and no
query/key/value biases: `Attention(use_bias=False, out_bias=True)`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.rglru import RGLRU
from ssmkit._src.pretrained import parts
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import head

ARCHITECTURE = "RecurrentGemmaForCausalLM"
MODEL_TYPE = "recurrent_gemma"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (RGLRU, Attention)
REQUIRED = {"block": "mixer", "norm": "rms_plus_one", "mlp": "geglu", "mlp_bias": True,
            "prenorm": True, "pooling": "none", "tie_embeddings": True}
_KINDS = {RGLRU: "recurrent", Attention: "attention"}



def embedding_scale(features: int) -> float:
  """sqrt(`features`) rounded to bfloat16, the constant `transformers` scales embeddings by."""
  return float(jnp.asarray(features**0.5, jnp.bfloat16))


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a RecurrentGemma `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  fields.require("hidden_activation", "gelu_pytorch_tanh")
  fields.require("attention_bias", False)
  features, heads = fields.int("hidden_size"), fields.int("num_attention_heads")
  rope = fields.get("rope_parameters", {})
  if rope.get("rope_type", "default") != "default":
    raise CheckpointError(f"{fields.source}: `rope_parameters.rope_type`={rope['rope_type']!r} is "
                          "not supported: ssmkit's rotary embedding is the default one.")
  kinds = fields.get("block_types", ["recurrent", "recurrent", "attention"])
  unknown = sorted(set(kinds) - {"recurrent", "attention"})
  if unknown:
    raise CheckpointError(f"{fields.source}: `block_types` {unknown} are not RecurrentGemma blocks.")
  head_dim = fields.int("head_dim", features // heads)
  rglru = functools.partial(RGLRU, d_state=fields.int("lru_width", features), num_heads=heads,
                            d_conv=fields.int("conv1d_width", 4))
  attention = functools.partial(
      Attention, num_heads=heads, num_kv_heads=fields.int("num_key_value_heads", heads),
      head_dim=head_dim, rope_base=float(rope.get("rope_theta", 10_000.0)),
      rope_fraction=float(rope.get("partial_rotary_factor", 0.5)),
      window=fields.int("attention_window_size", 2048),
      cache_size=fields.int("attention_window_size", 2048), use_bias=False, out_bias=True)
  layers = {"recurrent": rglru, "attention": attention}
  vocab, blocks = fields.int("vocab_size"), fields.int("num_hidden_layers")
  pattern = tuple(layers[kind] for kind in kinds)[:blocks]
  mlp_width = fields.int("intermediate_size") // 2
  return dict(num_outputs=vocab, vocab_size=vocab, features=features, num_blocks=blocks,
              layer=pattern, pooling="none", block="mixer", norm="rms_plus_one",
              norm_eps=fields.float("rms_norm_eps", 1e-6), mlp="geglu",
              mlp_expansion=mlp_width / features, mlp_bias=True,
              tie_embeddings=fields.get("tie_word_embeddings", True),
              scale_embeddings=embedding_scale(features),
              logit_cap=fields.float("logits_soft_cap", 30.0))


def params(tensors: Tensors, fields: Fields, model: Any) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors."""
  features, vocab = model.features, model.vocab_size
  gemma_norm = lambda name: {"RMSNormPlusOne_0": {"scale": tensors.take(name, (features,))}}
  mlp_width = round(model.mlp_expansion * features)
  tree: dict[str, Any] = {
      "encoder": {"embedding": tensors.take("model.embed_tokens.weight", (vocab, features))},
      "final_norm": gemma_norm("model.final_norm.weight"),
  }
  for i in range(model.num_blocks):
    prefix = f"model.layers.{i}"
    mixer = f"{prefix}.temporal_block"
    dense = lambda name, out, into, where: {"kernel": tensors.take(f"{where}.{name}.weight",
                                                                   (out, into)).T,
                                            "bias": tensors.take(f"{where}.{name}.bias", (out,))}
    mlp = f"{prefix}.mlp_block"
    layer = model.layer[i % len(model.layer)]()
    block = {
        "norm": gemma_norm(f"{prefix}.temporal_pre_norm.weight"),
        "mlp_norm": gemma_norm(f"{prefix}.channel_pre_norm.weight"),
        "mlp_gate": dense("gate_proj", mlp_width, features, mlp),
        "mlp_up": dense("up_proj", mlp_width, features, mlp),
        "mlp_down": dense("down_proj", features, mlp_width, mlp),
    }
    block["mixer"] = (_rglru(tensors, mixer, layer, features) if isinstance(layer, RGLRU)
                      else _attention(tensors, mixer, layer, features))
    tree[f"block_{i}"] = block
  return {**tree, **head(tensors, model)}


def _rglru(tensors: Tensors, mixer: str, layer: RGLRU, features: int) -> dict[str, Any]:
  width, heads = layer.d_state or features, layer.num_heads
  block = width // heads
  take = lambda name, shape: tensors.take(f"{mixer}.{name}", shape)
  return {
      "y_proj": take("linear_y.weight", (width, features)).T, "y_bias": take("linear_y.bias", (width,)),
      "x_proj": take("linear_x.weight", (width, features)).T, "x_bias": take("linear_x.bias", (width,)),
      "conv_kernel": take("conv_1d.weight", (width, 1, layer.d_conv))[:, 0, :].T,
      "conv_bias": take("conv_1d.bias", (width,)),
      "input_gate": take("rg_lru.input_gate_weight", (heads, block, block)),
      "input_gate_bias": take("rg_lru.input_gate_bias", (heads, block)),
      "a_gate": take("rg_lru.recurrent_gate_weight", (heads, block, block)),
      "a_gate_bias": take("rg_lru.recurrent_gate_bias", (heads, block)),
      "a_param": take("rg_lru.recurrent_param", (width,)),
      "out_proj": take("linear_out.weight", (features, width)).T,
      "out_bias": take("linear_out.bias", (features,)),
  }


def _attention(tensors: Tensors, mixer: str, layer: Attention, features: int) -> dict[str, Any]:
  heads, kv, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
  take = lambda name, shape: tensors.take(f"{mixer}.{name}", shape)
  return {
      "q_proj": take("q_proj.weight", (heads * head_dim, features)).T,
      "k_proj": take("k_proj.weight", (kv * head_dim, features)).T,
      "v_proj": take("v_proj.weight", (kv * head_dim, features)).T,
      "o_proj": take("o_proj.weight", (features, heads * head_dim)).T,
      "o_bias": take("o_proj.bias", (features,)),
  }


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a Griffin model of RG-LRU and attention blocks.

  Raises:
    CheckpointError: naming the option that `transformers`' RecurrentGemma does not have.
  """
  features = model.features
  made = parts.pattern_layers(model)
  heads = {layer.num_heads for layer in made}
  attention = [layer for layer in made if isinstance(layer, Attention)]
  recurrent = [layer for layer in made if isinstance(layer, RGLRU)]
  _expect(model.scale_embeddings == embedding_scale(features), "model.scale_embeddings",
          f"sqrt(features) rounded to bfloat16, {embedding_scale(features)}")
  _expect(model.logit_cap is not None, "model.logit_cap", "a number (logits_soft_cap)")
  _expect(len(heads) == 1, "num_heads", "the same in every RG-LRU and attention layer")
  for name, count in (("attention", attention), ("RG-LRU", recurrent)):
    _expect(len({_settings(layer) for layer in count}) <= 1, f"{name} options",
            "the same in every such layer")
  if attention:
    layer = attention[0]
    _expect(layer.head_dim in (None, features // layer.num_heads), "Attention.head_dim",
            "features / num_heads")
    _expect(layer.rope_fraction == 0.5, "Attention.rope_fraction", "0.5")
    out_bias = layer.use_bias if layer.out_bias is None else layer.out_bias
    _expect(out_bias and not layer.qk_norm and layer.logit_cap is None, "Attention",
            "out_bias=True (an output bias), no qk_norm, no logit_cap")
  width = (recurrent[0].d_state or features) if recurrent else features
  fields = {
      "model_type": "recurrent_gemma", "hidden_size": features, "num_hidden_layers": model.num_blocks,
      "num_attention_heads": heads.pop(), "lru_width": width,
      "intermediate_size": 2 * round(model.mlp_expansion * features),
      "block_types": [_KINDS[type(layer)] for layer in made],
      "conv1d_width": recurrent[0].d_conv if recurrent else 4,
      "logits_soft_cap": model.logit_cap, "hidden_activation": "gelu_pytorch_tanh",
      "rms_norm_eps": 1e-6 if model.norm_eps is None else model.norm_eps,
      "attention_bias": False, "tie_word_embeddings": True,
  }
  if attention:
    layer = attention[0]
    fields.update(num_key_value_heads=layer.num_kv_heads or layer.num_heads,
                  attention_window_size=layer.window or layer.cache_size,
                  rope_parameters={"rope_type": "default", "rope_theta": layer.rope_base,
                                   "partial_rotary_factor": 0.5})
  gemma = lambda norm: norm["RMSNormPlusOne_0"]["scale"]
  tensors = {"model.embed_tokens.weight": params["encoder"]["embedding"],
             "model.final_norm.weight": gemma(params["final_norm"])}
  for i, block in enumerate(blocks):
    prefix, mixer = f"model.layers.{i}", block["mixer"]
    tensors[f"{prefix}.temporal_pre_norm.weight"] = gemma(block["norm"])
    tensors[f"{prefix}.channel_pre_norm.weight"] = gemma(block["mlp_norm"])
    tensors.update(parts.scoped(f"{prefix}.mlp_block", parts.swiglu_tensors(block)))
    tensors.update(parts.scoped(f"{prefix}.temporal_block", _rglru_tensors(mixer)
                                if "a_param" in mixer else _attention_tensors(mixer)))
  return fields, tensors


def _settings(layer: Any) -> tuple[Any, ...]:
  """The options of an RG-LRU or attention layer that config.json holds once for all layers."""
  if isinstance(layer, RGLRU):
    return layer.d_state, layer.d_conv
  return (layer.num_kv_heads, layer.head_dim, layer.rope_base, layer.window, layer.rope_fraction,
          layer.use_bias, layer.out_bias)



def _rglru_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  return {
      "linear_y.weight": mixer["y_proj"].T, "linear_y.bias": mixer["y_bias"],
      "linear_x.weight": mixer["x_proj"].T, "linear_x.bias": mixer["x_bias"],
      "conv_1d.weight": mixer["conv_kernel"].T[:, None, :], "conv_1d.bias": mixer["conv_bias"],
      "rg_lru.input_gate_weight": mixer["input_gate"],
      "rg_lru.input_gate_bias": mixer["input_gate_bias"],
      "rg_lru.recurrent_gate_weight": mixer["a_gate"],
      "rg_lru.recurrent_gate_bias": mixer["a_gate_bias"],
      "rg_lru.recurrent_param": mixer["a_param"],
      "linear_out.weight": mixer["out_proj"].T, "linear_out.bias": mixer["out_bias"],
  }


def _attention_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  if any(np.any(mixer.get(f"{name}_bias", 0)) for name in "qkv"):
    raise CheckpointError("`variables`: an attention block's query, key or value bias is not "
                          "zero, and RecurrentGemma's attention has only an output bias.")
  return {"q_proj.weight": mixer["q_proj"].T, "k_proj.weight": mixer["k_proj"].T,
          "v_proj.weight": mixer["v_proj"].T, "o_proj.weight": mixer["o_proj"].T,
          "o_proj.bias": mixer["o_bias"]}


_expect = functools.partial(parts.expect, ARCHITECTURE)
