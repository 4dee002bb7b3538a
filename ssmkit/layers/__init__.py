"""Flax linen SSM layers with whole-sequence and step-by-step modes that agree."""

from ssmkit._src.layers.block import SSMBlock
from ssmkit._src.layers.lru import LRU
from ssmkit._src.layers.mamba import Mamba, MambaState
from ssmkit._src.layers.model import SequenceModel, generate
from ssmkit._src.layers.s4d import S4D
from ssmkit._src.layers.s5 import S5

__all__ = ["LRU", "S4D", "S5", "Mamba", "MambaState", "SSMBlock", "SequenceModel", "generate"]
