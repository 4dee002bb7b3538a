"""The layers of the registry as the contract tests build them: one case per test configuration.

Every table of layers in the tests comes from here, so a layer joins every contract by its
registry entry alone (`test_registry.py` checks that with a throwaway layer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn

import ssmkit.nnx as snx
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


def names() -> list[str]:
  """The registered layers by their config names."""
  return list(LAYERS)
