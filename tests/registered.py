"""The layers of the registry as the contract tests build them: one case per test configuration.

Every table of layers in the tests comes from here, so a layer joins every contract by its
registry entry alone (`test_registry.py` checks that with a throwaway layer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import ssmkit.nnx as snx
from ssmkit._src.layers.functional import ValueResidual, shares_values
from ssmkit._src.layers.registry import LAYERS


def _case_id(name: str, index: int, config: dict) -> str:
  """`name` for a layer's own configuration; its keywords appended for a variant."""
  if index == 0:
    return name
  return "-".join([name, *(f"{key}={value}" for key, value in sorted(config.items()))])


def linen_cases(variants: bool = True) -> dict[str, Callable[[], nn.Module]]:
  """Linen layer factories by case id: every test configuration, or each layer's own."""
  return {
      _case_id(name, i, config): functools.partial(entry.layer, **config)
      for name, entry in LAYERS.items()
      for i, config in enumerate(entry.test_configs if variants else entry.test_configs[:1])
  }


def nnx_cases(variants: bool = True) -> dict[str, tuple[Callable[..., snx.Layer], nn.Module]]:
  """`(NNX factory, linen layer)` by case id, as `linen_cases` lists them."""
  cases = {}
  for case, factory in linen_cases(variants).items():
    linen = factory()
    cases[case] = (functools.partial(snx.front_end(factory.func), **factory.keywords), linen)
  return cases


# One layer of each kind of state, for the model tests whose layer-dependent part (a layer's
# state, its resets and its steps) the layer contract checks for every layer: a complex
# diagonal state, a selective scan behind a convolution window, a matrix state, a
# diagonal-plus-low-rank state behind a token shift, a gated diagonal state that knows the
# sequence's first step, and a key-value cache. Fewer than half the layers, so not a contract
# (`test_registry.py`).
ONE_OF_EACH_STATE = ("lru", "mamba", "mamba2", "rwkv7", "rglru", "attention")


def drawn_where_zero(params):
  """`params` (a pytree of arrays) with every parameter that is all zeros drawn from N(0, 1)
  instead: a layer that starts a projection at zero (RWKV-7's output projection and low-rank
  bottlenecks) would otherwise hide the maths behind it from the contract."""
  draw = lambda p: np.random.default_rng(p.size).standard_normal(p.shape).astype(p.dtype)
  return jax.tree.map(lambda p: p if np.any(p) else draw(p), params)


def as_later_layer(layer, call, x):
  """`call(x, **options) -> outputs` (a linen layer's apply with its variables, or an NNX
  layer) run as a later layer of a model: with a written value residual for a layer that
  shares values (RWKV7), so the parameters that mix it in take part (a model's first layer
  keeps its own values), and plainly for the others."""
  if not shares_values(layer):
    return call(x)
  width = layer.maths.value_width(layer, x.shape[-1])
  values = np.random.default_rng(width).standard_normal((*x.shape[:-1], width)).astype(np.float32)
  y, _ = call(x, value_residual=ValueResidual(jnp.asarray(values), jnp.asarray(True)))
  return y


def names() -> list[str]:
  """The registered layers by their config names."""
  return list(LAYERS)
