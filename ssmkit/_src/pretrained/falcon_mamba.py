"""`FalconMambaForCausalLM` checkpoints (tiiuae/falcon-mamba-7b) as a `SequenceModel`.

Falcon-Mamba is Mamba whose step-size input, B and C pass an RMSNorm without a scale
(`mixer_rms_eps`): `ssmkit.layers.Mamba(selective_norm_eps=...)`. Its tensors are Mamba's.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ssmkit._src.layers.mamba import Mamba
from ssmkit._src.pretrained import mamba
from ssmkit._src.pretrained.config import Fields

ARCHITECTURE = "FalconMambaForCausalLM"
MODEL_TYPE = "falcon_mamba"  # what `transformers` reads to pick the architecture
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (Mamba,)
REQUIRED = mamba.REQUIRED
params = mamba.params


def fits(model: Any) -> bool:
  """Whether `model`'s Mamba layers normalise their selective inputs, as Falcon-Mamba's do."""
  layer = model.layer()
  return layer.selective_norm_eps is not None and not layer.selective_norm_scale


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Falcon-Mamba `config.json` (see `mamba.options`)."""
  found = mamba.options(fields)
  eps = fields.float("mixer_rms_eps", 1e-6)
  return {**found, "layer": functools.partial(found["layer"], selective_norm_eps=eps)}


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of a Falcon-Mamba model (see `mamba.checkpoint`)."""
  fields, tensors = mamba.checkpoint(model, blocks, params)
  return {**fields, "model_type": "falcon_mamba",
          "mixer_rms_eps": model.layer().selective_norm_eps}, tensors
