"""`Qwen3_5MoeForCausalLM` checkpoints (Qwen3.5's mixtures of experts, e.g. Qwen/Qwen3.5-35B-A3B)
as a `SequenceModel`.

Qwen3.5's language model (`qwen3_5`: Gated DeltaNet with separate projections and gated
attention by `layer_types`) with Qwen3-Next's mixture in every block (`qwen3_next`: a softmax
router over `num_experts`, the top `num_experts_per_tok` always renormalised, and a shared
expert behind a sigmoid gate; each expert stored as `mlp.experts.<e>.*`). The published
checkpoints are image-text models (`qwen3_5_moe`, `Qwen3_5MoeForConditionalGeneration`), whose
language model loads and saves as Qwen3.5's does.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.gated_deltanet import GatedDeltaNet
from ssmkit._src.pretrained import qwen3_5, qwen3_next
from ssmkit._src.pretrained.config import Fields, Wrapper
from ssmkit._src.pretrained.files import CheckpointError

ARCHITECTURE = "Qwen3_5MoeForCausalLM"
MODEL_TYPE = "qwen3_5_moe_text"  # what `transformers` reads to pick the architecture
WRAPPERS = {"qwen3_5_moe": Wrapper("Qwen3_5MoeForConditionalGeneration", "model.language_model.",
                                   ("model.visual.",))}
IGNORED = qwen3_5.IGNORED
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (GatedDeltaNet, Attention)
REQUIRED = qwen3_next.REQUIRED


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Qwen3.5-MoE `config.json` (its `text_config`).

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  return {**qwen3_5.pattern_options(fields), **qwen3_next.experts_options(fields, normalize=True)}


params = functools.partial(qwen3_5.params, mlp=qwen3_next.experts_params)


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of Qwen3.5's pattern with a renormalised mixture per block.

  Raises:
    CheckpointError: naming the option that `transformers`' Qwen3.5-MoE does not have.
  """
  if not model.experts.normalize:
    raise CheckpointError(f"`model.experts`: a {ARCHITECTURE} renormalises its top k weights "
                          "(normalize=True).")
  fields, tensors = qwen3_next.experts_checkpoint(model, blocks, params, ARCHITECTURE,
                                                  qwen3_5.deltanet_tensors)
  del fields["intermediate_size"]  # its blocks have no dense MLP
  fields.update(model_type=MODEL_TYPE)
  return fields, tensors
