"""Float8 checkpoints: weights quantized in blocks, dequantized to float32 as they load.

The format of `transformers`' FineGrainedFP8 (`quantization_config.quant_method` "fp8", as
Qwen's and DeepSeek's "-FP8" releases): a linear layer's `X.weight` is stored in float8 beside
`X.weight_scale_inv`, one float32 (or power-of-two float8) number per block of
`weight_block_size` entries (partial blocks at the edges), and the weight is their product.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import numpy as np

from ssmkit._src.pretrained.files import CONFIG, FLOAT8, CheckpointError

SCALE = "_scale_inv"  # `X.weight` is scaled by `X.weight_scale_inv`
_FLOAT8 = {np.dtype(dtype) for dtype in FLOAT8.values()}


def dequantized(tensors: dict[str, np.ndarray], config: dict[str, Any],
                directory: pathlib.Path) -> dict[str, np.ndarray]:
  """`tensors` with each float8 weight and its scales replaced by their float32 product.

  Raises:
    CheckpointError: naming `quantization_config`'s field for another kind of quantization, or
      the tensor for a float8 weight without scales, scales without a weight, or scales of
      another shape than the weight's blocks.
  """
  settings = config.get("quantization_config")
  quantized = sorted(name for name, value in tensors.items()
                     if value.dtype in _FLOAT8 and not name.endswith(SCALE))
  if settings is None:
    if quantized:
      raise CheckpointError(f"{directory}: the weight {quantized[0]!r} is float8, but {CONFIG} has "
                            "no `quantization_config` to scale it.")
    return tensors
  source = directory / CONFIG
  method = settings.get("quant_method")
  if method != "fp8":
    raise CheckpointError(f"{source}: `quantization_config.quant_method` {method!r}: ssmkit loads "
                          "the float8 checkpoints of 'fp8' (weights in blocks, each with its "
                          "scale), dequantized to float32.")
  scheme = settings.get("activation_scheme", "dynamic")
  if scheme != "dynamic":
    raise CheckpointError(f"{source}: `quantization_config.activation_scheme` {scheme!r}: ssmkit "
                          "computes in full precision and takes the 'dynamic' scheme, whose "
                          "checkpoints hold no activation scales.")
  block = settings.get("weight_block_size")
  tensors = dict(tensors)
  for name in [name for name in tensors if name.endswith(SCALE)]:
    weight = name[:-len(SCALE)]
    if weight not in tensors:
      raise CheckpointError(f"{directory}: the scales {name!r} have no weight {weight!r}.")
    scales = tensors.pop(name)
    tensors[weight] = _product(tensors[weight], scales.astype(np.float32), block, name, directory)
  unscaled = [name for name in quantized if tensors[name].dtype in _FLOAT8]
  if unscaled:
    raise CheckpointError(f"{directory}: the weight {unscaled[0]!r} is float8 without scales "
                          f"{unscaled[0] + SCALE!r}.")
  return tensors


def _product(weight: np.ndarray, scales: np.ndarray, block: list[int] | None, name: str,
             directory: pathlib.Path) -> np.ndarray:
  """`weight` `(..., rows, cols)` times the scale of its block; float32."""
  rows, cols = weight.shape[-2:]
  size = (rows, cols) if block is None else tuple(block)
  grid = (*weight.shape[:-2], math.ceil(rows / size[0]), math.ceil(cols / size[1]))
  if block is None and scales.size == 1:
    scales = scales.reshape(grid)
  if scales.shape != grid:
    raise CheckpointError(f"{directory}: the scales {name!r} have shape {scales.shape}, expected "
                          f"{grid}: one per block of {size[0]} x {size[1]} of the weight's "
                          f"{weight.shape}.")
  spread = np.repeat(np.repeat(scales, size[0], axis=-2), size[1], axis=-1)[..., :rows, :cols]
  return weight.astype(np.float32) * spread
