"""Flax linen SSM layers with whole-sequence and step-by-step modes that agree."""

from ssmkit._src.layers.lru import LRU

__all__ = ["LRU"]
