"""Every SSM layer by the name a config gives it, and the choices a model offers beside the layer.

A layer joins by one entry in `LAYERS` (its class name in lower case, words joined by "_"); what a
trainer needs to know about it, the layer declares itself: its fields (the keyword arguments a
config may set) and its `parameter_groups`.
"""

from __future__ import annotations

import flax.linen as nn

from ssmkit._src.layers.block import ACTIVATIONS, NORMS
from ssmkit._src.layers.gated_deltanet import GatedDeltaNet
from ssmkit._src.layers.lru import LRU
from ssmkit._src.layers.mamba import Mamba
from ssmkit._src.layers.mamba2 import Mamba2
from ssmkit._src.layers.mingru import MinGRU
from ssmkit._src.layers.model import POOLINGS
from ssmkit._src.layers.rglru import RGLRU
from ssmkit._src.layers.s4d import S4D
from ssmkit._src.layers.s5 import S5

LAYERS: dict[str, type[nn.Module]] = {
    "lru": LRU,
    "s4d": S4D,
    "s5": S5,
    "mamba": Mamba,
    "mamba2": Mamba2,
    "gated_deltanet": GatedDeltaNet,
    "rglru": RGLRU,
    "mingru": MinGRU,
}

__all__ = ["ACTIVATIONS", "LAYERS", "NORMS", "POOLINGS"]
