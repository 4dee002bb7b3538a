"""Every layer, block and `SequenceModel` as a Flax NNX module, with the linen modules' maths.

    layer = ssmkit.nnx.LRU(features, d_state=64, rngs=nnx.Rngs(0))
    y = layer(x, reset=done)                                  # x: (..., T, features)
    state, y_t = layer.step(layer.initialize_state(x_t.shape), x_t)
    model = ssmkit.nnx.from_linen(linen_module, variables)   # and back: ssmkit.nnx.to_linen(model)
"""

from ssmkit._src.nnx.importable import require_nnx

require_nnx()

from ssmkit._src.nnx.block import MixerBlock, SSMBlock  # noqa: E402
from ssmkit._src.nnx.convert import from_linen, to_linen  # noqa: E402
from ssmkit._src.nnx.layers import (  # noqa: E402
    LRU,
    RGLRU,
    RWKV7,
    S4D,
    S5,
    Attention,
    FeedForward,
    GatedDeltaNet,
    GatedDeltaProduct,
    KimiDeltaAttention,
    LatentAttention,
    Layer,
    Mamba,
    Mamba2,
    Mamba3,
    MinGRU,
    Parallel,
    ShortConv,
    front_end,
)
from ssmkit._src.nnx.model import SequenceModel, generate  # noqa: E402

__all__ = [
    "LRU",
    "RGLRU",
    "RWKV7",
    "S4D",
    "S5",
    "Attention",
    "FeedForward",
    "GatedDeltaNet",
    "GatedDeltaProduct",
    "KimiDeltaAttention",
    "LatentAttention",
    "Layer",
    "Mamba",
    "Mamba2",
    "Mamba3",
    "MinGRU",
    "MixerBlock",
    "Parallel",
    "SSMBlock",
    "SequenceModel",
    "ShortConv",
    "from_linen",
    "front_end",
    "generate",
    "to_linen",
]
