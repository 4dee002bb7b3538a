"""`FalconH1ForCausalLM` checkpoints (tiiuae/Falcon-H1-*) as a `SequenceModel`.

Every Falcon-H1 block is a pre-norm mixer block whose mixer is Mamba-2 beside attention on the
same normalised input (`ssmkit.layers.Parallel`), then a SwiGLU MLP; a final RMSNorm and a
head. Its maximal-update multipliers are options of ssmkit's layers, so that fine-tuning sees
the parametrisation the checkpoint was trained in:

- `ssm_in_multiplier`, `attention_in_multiplier`, `ssm_out_multiplier`,
  `attention_out_multiplier`: the branches' `input_scales` and `output_scales`;
- `ssm_multipliers` (z, x, B, C, dt): `Mamba2(in_proj_scales=...)`;
- `key_multiplier`: attention's logit factor, `Attention(scale=key_multiplier / sqrt(head_dim))`;
- `mlp_multipliers` (gate, down): `SequenceModel(mlp_scales=...)`;
- `embedding_multiplier`: `scale_embeddings`; `lm_head_multiplier`: `logits_scaling` = 1 / it.

Mamba-2's inner width is `mamba_d_ssm` (`num_heads=mamba_n_heads`); without `mamba_rms_norm`
its output is y * SiLU(z) (`gate_norm="gate"`), with it RMSNorm(y) * SiLU(z) per group
(`mamba_norm_before_gate`, "gate_normed") or RMSNorm(y * SiLU(z)) ("norm_gated").
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.block import mlp_width
from ssmkit._src.layers.mamba2 import Mamba2, sizes
from ssmkit._src.layers.parallel import Parallel, branch_params, branches
from ssmkit._src.pretrained import bamba, mamba2, parts
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import head

ARCHITECTURE = "FalconH1ForCausalLM"
MODEL_TYPE = "falcon_h1"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (Parallel,)
REQUIRED = {"block": "mixer", "norm": "rms", "mlp": "swiglu", "prenorm": True, "pooling": "none",
            "decoder_bias": False, "logit_cap": None}
WRITES = ("mlp_scales", "logits_scaling")  # its options beyond the usual
_GATES = {(False, True): "gate", (False, False): "gate", (True, True): "gate_normed",
          (True, False): "norm_gated"}  # by (mamba_rms_norm, mamba_norm_before_gate)
_BRANCH_SCALES = (("ssm_in_multiplier", "attention_in_multiplier"),
                  ("ssm_out_multiplier", "attention_out_multiplier"))


def _factors(fields: Fields, name: str, count: int) -> tuple[float, ...]:
  """The list of `count` positive factors in the field `name` (default all 1)."""
  values = fields.get(name, [1.0] * count)
  if not isinstance(values, list) or len(values) != count or not all(
      isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values):
    raise CheckpointError(f"{fields.source}: `{name}` must be {count} positive numbers, got "
                          f"{values!r}.")
  return tuple(float(v) for v in values)


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Falcon-H1 `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  fields.require("projectors_bias", False)
  features = fields.int("hidden_size")
  gate = _GATES[(bool(fields.get("mamba_rms_norm", False)),
                 bool(fields.get("mamba_norm_before_gate", True)))]
  ssm_scales = _factors(fields, "ssm_multipliers", 5)
  eps = fields.float("rms_norm_eps", 1e-5)
  mamba = functools.partial(
      bamba.mamba_layer(fields, inner_field="mamba_d_ssm"), gate_norm=gate,
      in_proj_scales=None if set(ssm_scales) == {1.0} else ssm_scales)
  attention = bamba.attention_options(fields)
  key = fields.float("key_multiplier", 1.0)
  # Falcon-H1's default rotary embedding turns every channel of a head, whatever the config.
  attention.update(rope_fraction=1.0,
                   scale=None if key == 1.0 else key / math.sqrt(attention["head_dim"]))
  mixer = functools.partial(
      Parallel, layers=(mamba, functools.partial(Attention, **attention)),
      input_scales=tuple(fields.float(n, 1.0) for n in _BRANCH_SCALES[0]),
      output_scales=tuple(fields.float(n, 1.0) for n in _BRANCH_SCALES[1]))
  embedding, vocab = fields.float("embedding_multiplier", 1.0), fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features,
              num_blocks=fields.int("num_hidden_layers"), layer=mixer, pooling="none",
              block="mixer", norm="rms", norm_eps=eps, mlp="swiglu",
              mlp_expansion=fields.int("intermediate_size") / features,
              mlp_bias=bool(fields.get("mlp_bias", False)),
              mlp_scales=_factors(fields, "mlp_multipliers", 2),
              tie_embeddings=bool(fields.get("tie_word_embeddings", False)), decoder_bias=False,
              scale_embeddings=embedding if embedding != 1.0 else False,
              logits_scaling=1 / fields.float("lm_head_multiplier", 1.0))


def params(tensors: Tensors, fields: Fields, model: Any) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors."""
  del fields
  features = model.features
  norm = parts.norm_reader(tensors, features)
  mamba, attention = _branches(model)
  width = mlp_width(features, model.mlp_expansion)
  tree = parts.embedding_and_final_norm(tensors, model, "model.final_layernorm.weight")
  for i in range(model.num_blocks):
    prefix = f"model.layers.{i}"
    ssm = mamba2.mixer_params(tensors, f"{prefix}.mamba", mamba, features)
    attend = parts.attention_params(tensors, f"{prefix}.self_attn", attention, features)
    tree[f"block_{i}"] = {
        "norm": norm(f"{prefix}.input_layernorm.weight"),
        "mlp_norm": norm(f"{prefix}.pre_ff_layernorm.weight"),
        **parts.swiglu_params(tensors, f"{prefix}.feed_forward", width, features, model.mlp_bias),
        "mixer": {**{f"mamba2_{k}": v for k, v in ssm.items()},
                  **{f"attention_{k}": v for k, v in attend.items()}},
    }
  return {**tree, **head(tensors, model)}


def _branches(model: Any) -> tuple[Mamba2, Attention]:
  """The Mamba-2 and attention branches of a Falcon-H1 model's mixers.

  Raises:
    CheckpointError: naming `model.layer` when its mixers are not one Parallel of Mamba2 then
      Attention.
  """
  layer = model.layer() if callable(model.layer) else None
  made = [branch for _, branch, _, _ in branches(layer)] if isinstance(layer, Parallel) else []
  if [type(m) for m in made] != [Mamba2, Attention]:
    raise CheckpointError(f"`model.layer`: a {ARCHITECTURE} has one Parallel layer of Mamba2 "
                          "then Attention in every block.")
  return made[0], made[1]


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a Falcon-H1 model.

  Raises:
    CheckpointError: naming the option that `transformers`' Falcon-H1 does not have.
  """
  features = model.features
  mamba, attention = _branches(model)
  parallel = model.layer()
  eps = 1e-6 if model.norm_eps is None else model.norm_eps
  inner, heads, _ = sizes(mamba, features)
  head_dim = attention.head_dim or features // attention.num_heads
  if not (mamba.norm_per_group and mamba.norm_eps == eps):
    raise CheckpointError(f"`model`: a {ARCHITECTURE} needs Mamba2 to be norm_per_group=True "
                          f"with norm_eps={eps}, the model's.")
  if (attention.window is not None or attention.qk_norm or attention.output_gate
      or attention.logit_cap is not None or attention.rope_fraction != 1.0
      or (attention.out_bias is not None and attention.out_bias != attention.use_bias)):
    raise CheckpointError(f"`model`: a {ARCHITECTURE} needs global Attention with full rotary "
                          "embeddings, without qk_norm, output_gate, logit_cap or out_bias of "
                          "its own.")
  scale = 1.0 if attention.scale is None else attention.scale * math.sqrt(head_dim)
  into, out = (tuple(s) if s else (1.0, 1.0) for s in (parallel.input_scales,
                                                       parallel.output_scales))
  fields = {
      "model_type": MODEL_TYPE, "hidden_size": features, "num_hidden_layers": model.num_blocks,
      "intermediate_size": mlp_width(features, model.mlp_expansion), "mlp_bias": model.mlp_bias,
      "hidden_act": "silu", "tie_word_embeddings": model.tie_embeddings, "rms_norm_eps": eps,
      "mamba_d_ssm": inner, "mamba_n_heads": heads, "mamba_d_head": mamba.head_dim,
      "mamba_n_groups": mamba.n_groups, "mamba_d_state": mamba.d_state,
      "mamba_d_conv": mamba.d_conv, "mamba_conv_bias": mamba.use_conv_bias,
      "mamba_proj_bias": False, "projectors_bias": False,
      "mamba_rms_norm": mamba.gate_norm != "gate",
      "mamba_norm_before_gate": mamba.gate_norm != "norm_gated",
      "time_step_limit": mamba2.written_limit(mamba.dt_limit),
      "num_attention_heads": attention.num_heads,
      "num_key_value_heads": attention.num_kv_heads or attention.num_heads,
      "head_dim": head_dim, "attention_bias": attention.use_bias,
      "rope_parameters": {"rope_type": "default", "rope_theta": attention.rope_base},
      "key_multiplier": scale, "ssm_multipliers": list(mamba.in_proj_scales or (1.0,) * 5),
      "mlp_multipliers": list(model.mlp_scales),
      "embedding_multiplier": parts.embedding_multiplier(model),
      "lm_head_multiplier": 1 / model.logits_scaling,
      **{name: float(v) for names, values in zip(_BRANCH_SCALES, (into, out), strict=True)
         for name, v in zip(names, values, strict=True)}}
  tensors = parts.embedding_norm_and_head_tensors(model, params, "model.final_layernorm.weight")
  for i, block in enumerate(blocks):
    prefix, ssm, attend = (f"model.layers.{i}", *(branch_params(block["mixer"], kind)
                                                  for kind in ("mamba2", "attention")))
    tensors.update({
        f"{prefix}.input_layernorm.weight": block["norm"]["RMSNorm_0"]["scale"],
        f"{prefix}.pre_ff_layernorm.weight": block["mlp_norm"]["RMSNorm_0"]["scale"],
        **parts.scoped(f"{prefix}.mamba", mamba2.mixer_tensors(ssm)),
        **parts.scoped(f"{prefix}.self_attn", parts.attention_tensors(attend)),
        **parts.scoped(f"{prefix}.feed_forward", parts.swiglu_tensors(block))})
  return fields, tensors
