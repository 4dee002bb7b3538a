"""ssmkit: a JAX-native toolkit for state-space sequence models."""

import importlib
from typing import Any

from ssmkit import data, layers, rl, scan

__version__ = "0.1.0"

__all__ = ["data", "layers", "nnx", "rl", "scan"]


def __getattr__(name: str) -> Any:
  # `ssmkit.nnx` imports flax's NNX, which some flax and jax pairings cannot import (flax
  # 0.12.8 under jax 0.11): loaded on first use, so the scans, the RL estimators and the linen
  # layers work there all the same.
  if name == "nnx":
    return importlib.import_module("ssmkit.nnx")
  raise AttributeError(f"module 'ssmkit' has no attribute {name!r}")
