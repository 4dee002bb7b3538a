"""`Qwen3NextForCausalLM` checkpoints (Qwen/Qwen3-Next-80B-A3B-*) as a `SequenceModel`.

Qwen3-Next is Qwen3.5's language model (`ssmkit.pretrained` reads it as `qwen3_5` does:
Gated DeltaNet and gated attention by `layer_types`, (1 + w) norms) with two differences:

- Each block's MLP is a mixture of experts, `SequenceModel(mlp="experts", experts=Experts(
  num_experts, top_k=num_experts_per_tok, width=moe_intermediate_size,
  shared_width=shared_expert_intermediate_size, shared_gate=True, normalize=norm_topk_prob))`:
  softmax scores over the experts, the top k renormalised, plus a shared expert scaled by a
  sigmoid gate. The checkpoint holds each expert's `gate_proj`, `up_proj` and `down_proj`
  (`mlp.experts.<e>.*`), the router `mlp.gate`, the shared expert and `mlp.shared_expert_gate`.
  The load-balancing loss trains with the weight `router_aux_loss_coef` where
  `output_router_logits` is set, as `transformers` adds it.
- Gated DeltaNet's projections are fused per key head: `in_proj_qkvz` holds, for each key
  head, its query and key rows and the value and gate rows of its group of value heads;
  `in_proj_ba` likewise the write strengths and step sizes.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.experts import Experts
from ssmkit._src.layers.gated_deltanet import GatedDeltaNet
from ssmkit._src.pretrained import qwen3_5
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors

ARCHITECTURE = "Qwen3NextForCausalLM"
MODEL_TYPE = "qwen3_next"  # what `transformers` reads to pick the architecture
IGNORED = qwen3_5.IGNORED
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (GatedDeltaNet, Attention)
REQUIRED = {**qwen3_5.REQUIRED, "mlp": "experts"}


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Qwen3-Next `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly: blocks without
      experts (`mlp_only_layers`, `decoder_sparse_step`), no experts or no shared expert.
  """
  sparse, dense = fields.get("decoder_sparse_step", 1), fields.get("mlp_only_layers", [])
  if sparse != 1 or dense:
    raise CheckpointError(f"{fields.source}: `decoder_sparse_step`={sparse!r} and `mlp_only_layers`="
                          f"{dense!r} give blocks without experts; ssmkit loads Qwen3-Next with "
                          "experts in every block (decoder_sparse_step 1, mlp_only_layers []).")
  return {**qwen3_5.options(fields), **experts_options(fields, fields.get("norm_topk_prob", True))}


def experts_options(fields: Fields, normalize: bool) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of the mixture of Qwen3-Next and Qwen3.5-MoE: a
  softmax router, `normalize` its top k, and a gated shared expert.

  Raises:
    CheckpointError: naming the field whose value the mixture cannot take.
  """
  weight = fields.get("router_aux_loss_coef", 0.001)
  try:
    experts = Experts(
        num_experts=fields.int("num_experts"), top_k=fields.int("num_experts_per_tok"),
        width=fields.int("moe_intermediate_size"),
        shared_width=fields.int("shared_expert_intermediate_size"), shared_gate=True,
        normalize=bool(normalize),
        balance_weight=float(weight) if fields.get("output_router_logits", False) else 0.0)
  except ValueError as error:
    raise CheckpointError(f"{fields.source} gives experts ssmkit cannot build: {error}") from None
  return {"mlp": "experts", "experts": experts}


def deltanet_params(tensors: Tensors, where: str, layer: GatedDeltaNet, features: int
                    ) -> dict[str, Any]:
  """A Gated DeltaNet's parameters from Qwen3-Next's projections fused per key head."""
  heads, v_heads, k, v = qwen3_5.deltanet_sizes(layer)
  group = v_heads // heads * v
  take = lambda name, shape: tensors.take(f"{where}.{name}", shape)
  fused = take("in_proj_qkvz.weight", (heads * (2 * k + 2 * group), features))
  q_proj, k_proj, v_proj, g_proj = (
      part.reshape(-1, features).T
      for part in np.split(fused.reshape(heads, -1, features), [k, 2 * k, 2 * k + group], axis=1))
  b_proj, a_proj = (part.reshape(v_heads, features).T for part in np.split(
      take("in_proj_ba.weight", (2 * v_heads, features)).reshape(heads, -1, features), 2, axis=1))
  return {"q_proj": q_proj, "k_proj": k_proj, "v_proj": v_proj, "g_proj": g_proj,
          "b_proj": b_proj, "a_proj": a_proj, **qwen3_5.deltanet_shared(take, layer, features)}


def experts_params(tensors: Tensors, where: str, model: Any) -> dict[str, Any]:
  """The mixture of a block: each expert's SwiGLU stacked, the router, the shared expert."""
  config, features = model.experts, model.features
  width, shared = config.width, config.shared_width
  take = lambda name, shape: tensors.take(f"{where}.{name}.weight", shape).T
  stack = lambda name, shape: np.stack([take(f"experts.{e}.{name}", shape)
                                        for e in range(config.num_experts)])
  return {"mlp_experts": {
      "router": take("gate", (config.num_experts, features)),
      "gate": stack("gate_proj", (width, features)), "up": stack("up_proj", (width, features)),
      "down": stack("down_proj", (features, width)),
      "shared_gate": take("shared_expert.gate_proj", (shared, features)),
      "shared_up": take("shared_expert.up_proj", (shared, features)),
      "shared_down": take("shared_expert.down_proj", (features, shared)),
      "shared_router": take("shared_expert_gate", (1, features)),
  }}


params = functools.partial(qwen3_5.params, deltanet=deltanet_params, mlp=experts_params)


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of Qwen3.5's pattern with a mixture of experts per block.

  Raises:
    CheckpointError: naming the option that `transformers`' Qwen3-Next does not have.
  """
  fields, tensors = experts_checkpoint(model, blocks, params, ARCHITECTURE, deltanet_tensors)
  fields.update(model_type=MODEL_TYPE, norm_topk_prob=model.experts.normalize,
                decoder_sparse_step=1, mlp_only_layers=[])
  return fields, tensors


def experts_checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any],
                       architecture: str, deltanet: Any
                       ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of Qwen3-Next's or Qwen3.5-MoE's (`architecture`) pattern,
  its Gated DeltaNets' tensors named by `deltanet(mixer, layer)`.

  Raises:
    CheckpointError: naming the mixture's option that the architecture does not have.
  """
  config = model.experts
  if (config.scoring, config.routed_scale, config.score_bias, config.groups,
      config.activation) != ("softmax", 1.0, False, 1, "swiglu") or not (
          config.shared_width and config.shared_gate):
    raise CheckpointError(f"`model.experts`={config!r}: a {architecture} routes by softmax without "
                          "scaling, bias or groups to SwiGLU experts, beside a gated shared "
                          "expert (shared_width > 0, shared_gate=True).")
  fields, tensors = qwen3_5.checkpoint(model, blocks, params, deltanet=deltanet,
                                       mlp=experts_tensors)
  fields.update(num_experts=config.num_experts, num_experts_per_tok=config.top_k,
                moe_intermediate_size=config.width,
                shared_expert_intermediate_size=config.shared_width,
                router_aux_loss_coef=config.balance_weight or 0.001,
                output_router_logits=bool(config.balance_weight))
  return fields, tensors


def deltanet_tensors(mixer: dict[str, Any], layer: GatedDeltaNet) -> dict[str, np.ndarray]:
  """Qwen3-Next's Gated DeltaNet tensors, the projections fused per key head."""
  heads = layer.num_heads
  per_head = lambda name: mixer[name].T.reshape(heads, -1, mixer[name].shape[0])
  qkvz = np.concatenate([per_head(f"{n}_proj") for n in "qkvg"], axis=1)
  ba = np.concatenate([per_head("b_proj"), per_head("a_proj")], axis=1)
  return {"in_proj_qkvz.weight": qkvz.reshape(-1, qkvz.shape[-1]),
          "in_proj_ba.weight": ba.reshape(-1, ba.shape[-1]),
          **qwen3_5.deltanet_shared_tensors(mixer)}


def experts_tensors(block: dict[str, Any]) -> dict[str, np.ndarray]:
  """A block's mixture of experts by Qwen3-Next's names."""
  mixture = block["mlp_experts"]
  tensors = {"gate.weight": mixture["router"].T,
             "shared_expert_gate.weight": mixture["shared_router"].T}
  for name in ("gate", "up", "down"):
    tensors[f"shared_expert.{name}_proj.weight"] = mixture[f"shared_{name}"].T
    for e, weight in enumerate(mixture[name]):
      tensors[f"experts.{e}.{name}_proj.weight"] = weight.T
  return tensors
