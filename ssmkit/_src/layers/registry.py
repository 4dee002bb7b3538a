"""Every SSM layer by the name a config gives it, and the choices a model offers beside the layer.

A layer joins by one entry in `LAYERS` (its class name in lower case); what a trainer needs to know
about it, the layer declares itself: its fields (the keyword arguments a config may set) and its
`parameter_groups`.
"""

from __future__ import annotations

import flax.linen as nn

from ssmkit._src.layers.block import ACTIVATIONS, NORMS
from ssmkit._src.layers.lru import LRU
from ssmkit._src.layers.mamba import Mamba
from ssmkit._src.layers.model import POOLINGS
from ssmkit._src.layers.s4d import S4D
from ssmkit._src.layers.s5 import S5

LAYERS: dict[str, type[nn.Module]] = {layer.__name__.lower(): layer for layer in (LRU, S4D, S5, Mamba)}

__all__ = ["ACTIVATIONS", "LAYERS", "NORMS", "POOLINGS"]
