"""The tensors of parts that several architectures share, by `transformers`' names inside the
part's scope: grouped-query attention (`q_proj`, `k_proj`, `v_proj`, `o_proj`) and a mixer
block's SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.pretrained.files import Tensors


def attention_params(tensors: Tensors, where: str, layer: Attention, features: int
                     ) -> dict[str, Any]:
  """`ssmkit.layers.Attention`'s projections (and biases, with `use_bias`)."""
  heads, kv, head_dim = layer.num_heads, layer.num_kv_heads or layer.num_heads, layer.head_dim
  widths = {"q": heads * head_dim, "k": kv * head_dim, "v": kv * head_dim}
  tree = {f"{n}_proj": tensors.take(f"{where}.{n}_proj.weight", (w, features)).T
          for n, w in widths.items()}
  tree["o_proj"] = tensors.take(f"{where}.o_proj.weight", (features, heads * head_dim)).T
  if layer.use_bias:
    tree.update({f"{n}_bias": tensors.take(f"{where}.{n}_proj.bias", (w,))
                 for n, w in widths.items()})
    tree["o_bias"] = tensors.take(f"{where}.o_proj.bias", (features,))
  return tree


def attention_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  """The tensors of `attention_params`."""
  tensors = {f"{n}_proj.weight": mixer[f"{n}_proj"].T for n in "qkvo"}
  tensors.update({f"{n}_proj.bias": mixer[f"{n}_bias"] for n in "qkvo" if f"{n}_bias" in mixer})
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
  """The tensors of `swiglu_params`."""
  tensors = {}
  for name in ("gate", "up", "down"):
    dense = block[f"mlp_{name}"]
    tensors[f"{name}_proj.weight"] = dense["kernel"].T
    if "bias" in dense:
      tensors[f"{name}_proj.bias"] = dense["bias"]
  return tensors
