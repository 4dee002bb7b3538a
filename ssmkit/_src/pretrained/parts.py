"""The tensors of parts that several architectures share, by `transformers`' names inside the
part's scope: grouped-query attention (`q_proj`, `k_proj`, `v_proj`, `o_proj`) and a mixer
block's SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.model import layer_pattern
from ssmkit._src.pretrained.files import CheckpointError, Tensors


def attention_params(tensors: Tensors, where: str, layer: Attention, features: int,
                     out: str = "o_proj") -> dict[str, Any]:
  """`ssmkit.layers.Attention`'s projections (and biases, with `use_bias`); the output one is
  stored as `out` (LFM2's `out_proj`)."""
  heads, kv, head_dim = layer.num_heads, layer.num_kv_heads or layer.num_heads, layer.head_dim
  widths = {"q": heads * head_dim, "k": kv * head_dim, "v": kv * head_dim}
  tree = {f"{n}_proj": tensors.take(f"{where}.{n}_proj.weight", (w, features)).T
          for n, w in widths.items()}
  tree["o_proj"] = tensors.take(f"{where}.{out}.weight", (features, heads * head_dim)).T
  if layer.use_bias:
    tree.update({f"{n}_bias": tensors.take(f"{where}.{n}_proj.bias", (w,))
                 for n, w in widths.items()})
    tree["o_bias"] = tensors.take(f"{where}.{out}.bias", (features,))
  return tree


def attention_tensors(mixer: dict[str, Any], out: str = "o_proj") -> dict[str, np.ndarray]:
  """The tensors of `attention_params`, the output projection stored as `out`."""
  names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": out}
  tensors = {f"{name}.weight": mixer[f"{n}_proj"].T for n, name in names.items()}
  tensors.update({f"{name}.bias": mixer[f"{n}_bias"] for n, name in names.items()
                  if f"{n}_bias" in mixer})
  return tensors


def swiglu_params(tensors: Tensors, where: str, width: int, features: int, bias: bool = False
                  ) -> dict[str, Any]:
  """A mixer block's SwiGLU MLP (`mlp_gate`, `mlp_up`, `mlp_down`) of hidden `width`."""
  shapes = {"gate": (width, features), "up": (width, features), "down": (features, width)}
  tree = {}
  for name, shape in shapes.items():
    tree[f"mlp_{name}"] = {"kernel": tensors.take(f"{where}.{name}_proj.weight", shape).T}
    if bias:
      tree[f"mlp_{name}"]["bias"] = tensors.take(f"{where}.{name}_proj.bias", shape[:1])
  return tree


def swiglu_tensors(block: dict[str, Any]) -> dict[str, np.ndarray]:
  """The tensors of `swiglu_params` (of any gated MLP's three projections, GeGLU's too)."""
  tensors = {}
  for name in ("gate", "up", "down"):
    dense = block[f"mlp_{name}"]
    tensors[f"{name}_proj.weight"] = dense["kernel"].T
    if "bias" in dense:
      tensors[f"{name}_proj.bias"] = dense["bias"]
  return tensors


def norm_reader(tensors: Tensors, features: int, scope: str = "RMSNorm_0") -> Any:
  """`read(name)`: the norm of `features` channels stored as `name`, as ssmkit's `Norm` holds
  it (`scope`: "RMSNorm_0", or "RMSNormPlusOne_0" for the (1 + w) norms)."""
  return lambda name: {scope: {"scale": tensors.take(name, (features,))}}


def embedding_and_final_norm(tensors: Tensors, model: Any, final_norm: str,
                             scope: str = "RMSNorm_0") -> dict[str, Any]:
  """The `model.embed_tokens` embedding and the final norm stored as `final_norm` (the
  `transformers` layout of Llama-like models); the head is `mamba.head`'s."""
  return {"encoder": {"embedding": tensors.take("model.embed_tokens.weight",
                                                (model.vocab_size, model.features))},
          "final_norm": norm_reader(tensors, model.features, scope)(final_norm)}


def embedding_norm_and_head_tensors(model: Any, params: dict[str, Any], final_norm: str,
                                    scope: str = "RMSNorm_0") -> dict[str, np.ndarray]:
  """The tensors of `embedding_and_final_norm`, and `lm_head` for an untied head."""
  tensors = {"model.embed_tokens.weight": params["encoder"]["embedding"],
             final_norm: params["final_norm"][scope]["scale"]}
  if not model.tie_embeddings:
    tensors["lm_head.weight"] = params["decoder"]["kernel"].T
  return tensors


def pattern_layers(model: Any) -> list[Any]:
  """The layers of a model's pattern, one per place (`layer_pattern`), each made once."""
  return [make() for make in layer_pattern(model.layer)]


def paired_blocks(tensors: Tensors, model: Any, final_norm: str,
                  read: Callable[[str, int, Any], tuple[str, dict[str, Any]]]) -> dict[str, Any]:
  """The embedding, final norm and blocks of a model whose every layer is two blocks, a mixer
  block then a `FeedForward` block (Jamba's, Kimi Linear's): `read(prefix, which, layer)` gives
  `(its norm's name, its mixer's parameters)` of the layer's first (`which` 0) or second
  block, `prefix` "model.layers.{i}"."""
  norm = norm_reader(tensors, model.features)
  tree = embedding_and_final_norm(tensors, model, final_norm)
  for i in range(model.num_blocks // 2):
    for which in (0, 1):
      name, mixer = read(f"model.layers.{i}", which, model.layer[2 * i + which]())
      tree[f"block_{2 * i + which}"] = {"norm": norm(name), "mixer": mixer}
  return tree


def swiglu_feed_forward_params(take: Callable[[str, tuple[int, ...]], np.ndarray], width: int,
                               features: int) -> dict[str, np.ndarray]:
  """`FeedForward(kind="swiglu")`'s parameters from `take(name, shape)` of `gate_proj`,
  `up_proj` and `down_proj` (transposed, as stored)."""
  return {"gate_proj": take("gate_proj", (width, features)),
          "up_proj": take("up_proj", (width, features)),
          "down_proj": take("down_proj", (features, width))}


def swiglu_feed_forward_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  """The tensors of `swiglu_feed_forward_params`."""
  return {f"{name}.weight": mixer[name].T for name in ("gate_proj", "up_proj", "down_proj")}


def expect(architecture: str, holds: bool, option: str, what: str) -> None:
  """Raises a `CheckpointError` that `architecture` needs the model's `option` to be `what`,
  unless `holds`."""
  if not holds:
    article = "an" if architecture[0] in "AEIOU" else "a"
    raise CheckpointError(f"`model`: {article} {architecture} needs {option} to be {what}.")


def embedding_multiplier(model: Any) -> float:
  """The factor on a model's token embeddings (its `scale_embeddings`) as a number."""
  scale = model.scale_embeddings
  return math.sqrt(model.features) if scale is True else float(scale or 1.0)


def scoped(scope: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """`tensors` named inside `scope`: "{scope}.{name}"."""
  return {f"{scope}.{name}": value for name, value in tensors.items()}
