"""Flax linen SSM layers with whole-sequence and step-by-step modes that agree."""

from ssmkit._src.layers.attention import Attention, AttentionState
from ssmkit._src.layers.block import MixerBlock, SSMBlock
from ssmkit._src.layers.convolution import ConvRecurrentState
from ssmkit._src.layers.experts import Experts, MixtureOfExperts
from ssmkit._src.layers.feed_forward import FeedForward
from ssmkit._src.layers.functional import ValueResidual
from ssmkit._src.layers.gated_deltanet import GatedDeltaNet
from ssmkit._src.layers.gated_deltaproduct import GatedDeltaProduct
from ssmkit._src.layers.kimi_delta_attention import KimiDeltaAttention
from ssmkit._src.layers.latent_attention import LatentAttention
from ssmkit._src.layers.lru import LRU
from ssmkit._src.layers.mamba import Mamba
from ssmkit._src.layers.mamba2 import Mamba2
from ssmkit._src.layers.mamba3 import Mamba3
from ssmkit._src.layers.mingru import MinGRU
from ssmkit._src.layers.model import SequenceModel, generate
from ssmkit._src.layers.parallel import Parallel
from ssmkit._src.layers.rglru import RGLRU, RGLRUState
from ssmkit._src.layers.rwkv7 import RWKV7
from ssmkit._src.layers.s4d import S4D
from ssmkit._src.layers.s5 import S5
from ssmkit._src.layers.short_conv import ShortConv

__all__ = [
    "LRU",
    "RGLRU",
    "RWKV7",
    "S4D",
    "S5",
    "Attention",
    "AttentionState",
    "ConvRecurrentState",
    "Experts",
    "FeedForward",
    "GatedDeltaNet",
    "GatedDeltaProduct",
    "KimiDeltaAttention",
    "LatentAttention",
    "Mamba",
    "Mamba2",
    "Mamba3",
    "MinGRU",
    "MixerBlock",
    "MixtureOfExperts",
    "Parallel",
    "RGLRUState",
    "SSMBlock",
    "SequenceModel",
    "ShortConv",
    "ValueResidual",
    "generate",
]
