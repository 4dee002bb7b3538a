"""ssmkit: a JAX-native toolkit for state-space sequence models."""

from ssmkit import data, layers, nnx, rl, scan

__version__ = "0.1.0"

__all__ = ["data", "layers", "nnx", "rl", "scan"]
