"""`Mamba2ForCausalLM` checkpoints (mamba-codestral, the mamba2-*-hf conversions) as a `SequenceModel`.

Pre-norm residual blocks around `ssmkit.layers.Mamba2`, a final RMSNorm and a head, as
`transformers`' Mamba-2: its in-projection packs [z, x, B, C, dt] as ssmkit's does, its gated
RMSNorm normalises each of the `n_groups` groups of channels (`norm_per_group=True`) with the
config's epsilon, and its step size is clipped to `time_step_limit` (`dt_limit`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ssmkit._src.layers.mamba2 import Mamba2, sizes
from ssmkit._src.pretrained import mamba
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import embedding_and_head

ARCHITECTURE = "Mamba2ForCausalLM"
MODEL_TYPE = "mamba2"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (Mamba2,)
REQUIRED = mamba.REQUIRED



def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Mamba-2 `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit's Mamba-2 cannot compute exactly.
  """
  fields.require("hidden_act", "silu")
  fields.require("use_bias", False)
  features, expand = fields.int("hidden_size"), fields.int("expand", 2)
  head_dim, heads = fields.int("head_dim", 64), fields.int("num_heads")
  if heads * head_dim != expand * features:
    raise CheckpointError(f"{fields.source}: `num_heads` x `head_dim` = {heads * head_dim} must be "
                          f"`expand` x `hidden_size` = {expand * features}.")
  eps = fields.float("layer_norm_epsilon", 1e-5)
  layer = functools.partial(Mamba2, d_state=fields.int("state_size", 128),
                            d_conv=fields.int("conv_kernel", 4),
                            use_conv_bias=bool(fields.get("use_conv_bias", True)),
                            expand=expand, head_dim=head_dim,
                            n_groups=fields.int("n_groups", 1),
                            dt_limit=step_limit(fields, "time_step_limit"),
                            norm_eps=eps, norm_per_group=True)
  vocab = fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features,
              num_blocks=fields.int("num_hidden_layers"), layer=layer, pooling="none",
              block="mixer", norm="rms", norm_eps=eps, mlp="none",
              tie_embeddings=fields.get("tie_word_embeddings", False), decoder_bias=False)


def step_limit(fields: Fields, name: str) -> tuple[float, float]:
  """The step size's clip `[low, high]` of the field `name` (default no clip), its infinities
  written as `transformers` writes them ({"__float__": "Infinity"}) or as JSON's `Infinity`.

  Raises:
    CheckpointError: naming the field when it is not two numbers.
  """
  limit = fields.get(name, (0.0, math.inf))
  decoded = [float(v["__float__"]) if isinstance(v, dict) and set(v) == {"__float__"} else v
             for v in limit] if isinstance(limit, list | tuple) else None
  if decoded is None or len(decoded) != 2 or not all(
      isinstance(v, int | float) and not isinstance(v, bool) for v in decoded):
    raise CheckpointError(f"{fields.source}: `{name}` must be [low, high], got {limit!r}.")
  return float(decoded[0]), float(decoded[1])


def expanded_width(layer: Mamba2, features: int, architecture: str) -> int:
  """The inner width of a Mamba-2 layer that an architecture sizes by `expand` x H.

  Raises:
    CheckpointError: naming `num_heads` where it gives another width.
  """
  inner, _, _ = sizes(layer, features)
  if inner != layer.expand * features:
    raise CheckpointError(f"`model`: a {architecture} sizes Mamba-2 by expand x features = "
                          f"{layer.expand * features}; the layer's num_heads x head_dim is {inner}.")
  return inner


def written_limit(limit: tuple[float, float]) -> list[Any]:
  """A step size's clip as config.json holds it: infinities as `transformers` writes them
  ({"__float__": "Infinity"}), so that the file is strict JSON."""
  return [value if math.isfinite(value) else {"__float__": str(value).replace("inf", "Infinity")}
          for value in map(float, limit)]


def params(tensors: Tensors, fields: Fields, model: Any) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors."""
  features, layer = model.features, model.layer()
  tree: dict[str, Any] = {}
  for i in range(model.num_blocks):
    prefix = f"backbone.layers.{i}"
    tree[f"block_{i}"] = {
        "norm": {"RMSNorm_0": {"scale": tensors.take(f"{prefix}.norm.weight", (features,))}},
        "mixer": mixer_params(tensors, f"{prefix}.mixer", layer, features),
    }
  return {**tree, **embedding_and_head(tensors, model)}


def mixer_params(tensors: Tensors, where: str, layer: Mamba2, features: int) -> dict[str, Any]:
  """A Mamba-2 mixer's parameters from `transformers`' tensors under `where` (Mamba-2's, and
  those of the hybrids built on it)."""
  inner, heads, bc = sizes(layer, features)
  k = layer.d_conv
  take = lambda name, shape: tensors.take(f"{where}.{name}", shape)
  mixer = {"in_proj": take("in_proj.weight", (2 * inner + bc + heads, features)).T,
           "conv_kernel": take("conv1d.weight", (inner + bc, 1, k))[:, 0, :].T,
           "dt_bias": take("dt_bias", (heads,)), "A_log": take("A_log", (heads,)),
           "D": take("D", (heads,)), "out_proj": take("out_proj.weight", (features, inner)).T}
  if layer.gate_norm != "gate":
    mixer["norm_scale"] = take("norm.weight", (inner,))
  if layer.use_conv_bias:
    mixer["conv_bias"] = take("conv1d.bias", (inner + bc,))
  return mixer


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a Mamba-2 model: its blocks' parameters `blocks` and the
  rest of `params`.

  Raises:
    CheckpointError: when its gated norm is over the whole width with several groups, or has
      another epsilon than the model's norms: `transformers` has one, `layer_norm_epsilon`.
  """
  layer = model.layer()
  check_plain(layer, ARCHITECTURE)
  fields = mamba.head_fields(model)
  if layer.norm_eps != fields["layer_norm_epsilon"]:
    raise CheckpointError(f"`model.norm_eps`={model.norm_eps!r}: a Mamba2ForCausalLM has one "
                          "epsilon for its RMSNorms and its layers' gated norms; give the model "
                          f"the Mamba2 layers' norm_eps, {layer.norm_eps}.")
  if layer.n_groups > 1 and not layer.norm_per_group:
    raise CheckpointError("`model`: a Mamba2 layer with n_groups > 1 must normalise per group "
                          "(norm_per_group=True) to be a transformers Mamba2ForCausalLM.")
  inner = expanded_width(layer, model.features, ARCHITECTURE)
  return {"model_type": "mamba2", "hidden_size": model.features, "state_size": layer.d_state,
          "num_hidden_layers": model.num_blocks, "expand": layer.expand,
          "head_dim": layer.head_dim, "num_heads": inner // layer.head_dim,
          "n_groups": layer.n_groups, "conv_kernel": layer.d_conv,
          "time_step_limit": written_limit(layer.dt_limit),
          "use_bias": False, "use_conv_bias": layer.use_conv_bias, "hidden_act": "silu",
          "residual_in_fp32": True, **fields}, {
              **mamba.block_tensors(blocks, mixer_tensors), **mamba.head_tensors(model, params)}


def mixer_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  """A Mamba-2 mixer's tensors by `transformers`' names (inside its mixer's scope)."""
  tensors = {"in_proj.weight": mixer["in_proj"].T,
             "conv1d.weight": mixer["conv_kernel"].T[:, None, :], "dt_bias": mixer["dt_bias"],
             "A_log": mixer["A_log"], "D": mixer["D"], "out_proj.weight": mixer["out_proj"].T}
  if "norm_scale" in mixer:
    tensors["norm.weight"] = mixer["norm_scale"]
  if "conv_bias" in mixer:
    tensors["conv1d.bias"] = mixer["conv_bias"]
  return tensors


def check_plain(layer: Mamba2, architecture: str) -> None:
  """Checks that a Mamba-2 layer gates as Mamba-2 does, without Falcon-H1's options.

  Raises:
    CheckpointError: naming `gate_norm` or `in_proj_scales`, which `architecture` lacks.
  """
  if layer.gate_norm != "norm_gated" or layer.in_proj_scales is not None:
    raise CheckpointError(f"`model`: a {architecture} has Mamba2 layers with "
                          "gate_norm='norm_gated' and no in_proj_scales (Falcon-H1's), got "
                          f"gate_norm={layer.gate_norm!r}, in_proj_scales={layer.in_proj_scales!r}.")
