"""ssmkit: a JAX-native toolkit for state-space sequence models."""

from ssmkit import rl, scan

__version__ = "0.1.0"

__all__ = ["rl", "scan"]
