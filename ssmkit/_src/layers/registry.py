"""Every SSM layer by the name a config gives it, and the choices a model offers beside the layer.

A layer joins by one entry in `LAYERS` (its class name in lower case, words joined by "_"); what a
trainer needs to know about it, the layer declares itself: its fields (the keyword arguments a
config may set) and its `parameter_groups`. Its NNX front end is made from the linen class
(`ssmkit.nnx.front_end`), and the tests and `ssmkit bench layers` read the entries: the contract
tests run every entry's `test_configs`, so a registered layer is tested like every other.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.block import ACTIVATIONS, MLPS, NORMS
from ssmkit._src.layers.feed_forward import FeedForward
from ssmkit._src.layers.functional import LinenLayer
from ssmkit._src.layers.gated_deltanet import GatedDeltaNet
from ssmkit._src.layers.gated_deltaproduct import GatedDeltaProduct
from ssmkit._src.layers.kimi_delta_attention import KimiDeltaAttention
from ssmkit._src.layers.latent_attention import LatentAttention
from ssmkit._src.layers.lru import LRU
from ssmkit._src.layers.mamba import Mamba
from ssmkit._src.layers.mamba2 import Mamba2
from ssmkit._src.layers.mamba3 import Mamba3
from ssmkit._src.layers.mingru import MinGRU
from ssmkit._src.layers.model import BLOCKS, POOLINGS
from ssmkit._src.layers.parallel import Parallel
from ssmkit._src.layers.rglru import RGLRU
from ssmkit._src.layers.rwkv7 import RWKV7
from ssmkit._src.layers.s4d import S4D
from ssmkit._src.layers.s5 import S5
from ssmkit._src.layers.short_conv import ShortConv


class Entry(NamedTuple):
  """One registered layer.

  Attributes:
    layer: the linen layer class, a `functional.LinenLayer`.
    test_configs: small configurations (keyword arguments) for inputs of 4 to 8 channels
      that the contract tests build the layer with: the first is the layer's own, the
      others variants that take other paths of its code (a discretisation, a block layout).
      A chunked layer's own takes chunks of 4 steps, so the contract's sequences of 13 span
      several chunks with resets inside them.
  """

  layer: type[LinenLayer]
  test_configs: tuple[dict[str, Any], ...]


LAYERS: dict[str, Entry] = {
    "lru": Entry(LRU, ({"d_state": 6},)),
    "s4d": Entry(S4D, ({"d_state": 6}, {"d_state": 4, "a_init": "lin", "discretization": "bilinear"})),
    "s5": Entry(S5, ({"d_state": 8},
                     {"d_state": 6, "blocks": 2, "conj_sym": False, "discretization": "bilinear"})),
    "mamba": Entry(Mamba, ({"d_state": 4, "d_conv": 3},)),
    "mamba2": Entry(Mamba2, ({"d_state": 4, "head_dim": 2, "n_groups": 2, "d_conv": 3,
                              "chunk_size": 4},)),
    "mamba3": Entry(Mamba3, ({"d_state": 4, "head_dim": 2, "chunk_size": 4},
                             {"d_state": 4, "head_dim": 4, "mimo_rank": 2, "outproj_norm": True})),
    "gated_deltanet": Entry(GatedDeltaNet, ({"num_heads": 2, "d_conv": 3, "chunk_size": 4},)),
    "kimi_delta_attention": Entry(KimiDeltaAttention, ({"num_heads": 2, "expand_v": 2, "d_conv": 3,
                                                        "chunk_size": 4},)),
    "gated_delta_product": Entry(GatedDeltaProduct, ({"num_heads": 2, "expand_v": 1, "d_conv": 3,
                                                      "chunk_size": 4},)),
    "rwkv7": Entry(RWKV7, ({"head_dim": 2, "decay_low_rank_dim": 3, "a_low_rank_dim": 2,
                            "gate_low_rank_dim": 3, "chunk_size": 4},)),
    "rglru": Entry(RGLRU, ({"num_heads": 2, "d_conv": 3},)),
    "mingru": Entry(MinGRU, ({"d_state": 6},)),
    "attention": Entry(Attention, (
        {"num_heads": 2, "num_kv_heads": 1, "head_dim": 4, "window": 5, "rope_fraction": 0.5,
         "qk_norm": "rms_plus_one", "output_gate": True},
        {"num_heads": 2, "head_dim": 4, "cache_size": 16, "qk_norm": True, "qk_norm_scope": "all",
         "logit_cap": 3.0, "use_bias": True},
    )),
    "latent_attention": Entry(LatentAttention, (
        {"num_heads": 2, "qk_nope_head_dim": 3, "qk_rope_head_dim": 2, "v_head_dim": 3,
         "kv_lora_rank": 4, "window": 5},
        {"num_heads": 2, "qk_nope_head_dim": 2, "qk_rope_head_dim": 0, "v_head_dim": 4,
         "kv_lora_rank": 3, "q_lora_rank": 3, "rope_base": None, "cache_size": 16,
         "use_bias": True},
    )),
    "feed_forward": Entry(FeedForward, ({"kind": "swiglu", "width": 6},
                                        {"kind": "relu2", "width": 5})),
    "short_conv": Entry(ShortConv, ({"d_conv": 3},)),
    "parallel": Entry(Parallel, (
        {"layers": (functools.partial(Mamba2, d_state=4, head_dim=2, d_conv=3, chunk_size=4,
                                      gate_norm="gate_normed", in_proj_scales=(0.5, 2.0, 1.5, 0.7, 0.9)),
                    functools.partial(Attention, num_heads=2, num_kv_heads=1, head_dim=4)),
         "input_scales": (0.5, 2.0), "output_scales": (1.5, 0.25)},
        {"layers": (functools.partial(GatedDeltaNet, num_heads=2, d_conv=3, chunk_size=4),
                    functools.partial(ShortConv, d_conv=3),
                    functools.partial(S4D, d_state=4))},
    )),
}



def registry_name(factory: Any) -> str:
  """The `LAYERS` name of the layer a factory makes (a class, or a `functools.partial` of one).

  Raises:
    ValueError: naming `layer` when the layer is not registered.
  """
  kind = type(factory())
  for name, entry in LAYERS.items():
    if entry.layer is kind:
      return name
  raise ValueError(f"`layer`: {kind.__name__} is not a registered layer ({', '.join(LAYERS)}).")


__all__ = ["ACTIVATIONS", "BLOCKS", "LAYERS", "MLPS", "NORMS", "POOLINGS", "Entry", "registry_name"]
