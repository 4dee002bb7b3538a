"""One compiled function per computation for the whole test run.

Compiling is most of the suite's time. A test that wraps a new lambda in `jax.jit`, or calls a
module eagerly, compiles again what another test compiled already; `compiled(fn, **static)`
gives every test asking for the same `fn` and static arguments the same jitted function, so
each program compiles once per process (and once per run, with the persistent cache that
`conftest.py` turns on). `init` draws parameters with keys whose draws compile in half the time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax


@functools.cache
def compiled(fn: Callable[..., Any], **static: Any) -> Callable[..., Any]:
  """`jax.jit(functools.partial(fn, **static))`, made once per `fn` and static arguments.

  `fn` and the static values must be hashable (a module-level function; linen modules,
  strings, numbers, tuples); the arrays go in as the arguments of the returned function.
  """
  return jax.jit(functools.partial(fn, **static))


def apply(params: Any, *args: Any, module: Any, method: str | None = None, **kwargs: Any) -> Any:
  """`module.apply(params, *args, method=method, **kwargs)`: pass to `compiled` with `module`."""
  return module.apply(params, *args, method=method, **kwargs)


def run(module: Any, **static: Any) -> Callable[..., Any]:
  """`module.apply(variables, *args, **static)`, compiled once per module and `static`
  (`method="step"` for a module's step)."""
  return compiled(apply, module=module, **static)


@functools.cache
def init(module: Any, shape: tuple[int, ...], seed: int = 0, dtype: str = "float32") -> Any:
  """`module.init(key(seed), zeros(shape, dtype))`, compiled and computed once per argument,
  with a key of `HASHED` (the parameters' distributions are the initialisers', their values
  not those of JAX's default keys)."""
  return jax.jit(module.init)(key(seed), jnp.zeros(shape, dtype))


def key(seed: int) -> jax.Array:
  """A key of `HASHED` for `seed`."""
  return jax.random.key(seed, impl=HASHED)


# Random draws are most of what an initialisation compiles: of 24 layers' `init` programs,
# 7.0-7.8 s of compile with JAX's Threefry keys, 3.2 s with these (and 4.9-5.6 s with its
# Philox keys, whose products fail to compile in programs sharded over several CPU devices).
# The tests compare computations on whatever parameters were drawn; the initialisers' own
# tests, and the trainer, draw with JAX's default keys.


def _mixed(x: jax.Array) -> jax.Array:
  """Wellons' "lowbias32" hash of uint32s: each input bit flips each output bit about half
  the time."""
  x = (x ^ (x >> 16)) * np.uint32(0x7FEB352D)
  x = (x ^ (x >> 15)) * np.uint32(0x846CA68B)
  return x ^ (x >> 16)


def _hashed(key: jax.Array, counters: jax.Array) -> jax.Array:
  """uint32 bits of `counters` under `key` (2 uint32s)."""
  return _mixed(_mixed(counters * np.uint32(0x9E3779B9) + key[0]) ^ key[1])


def _seed(seed: jax.Array) -> jax.Array:
  seed = jnp.asarray(seed)
  high = seed >> 32 if seed.dtype.itemsize == 8 else jnp.zeros_like(seed)
  return jnp.stack([lax.convert_element_type(high, np.uint32),
                    lax.convert_element_type(seed, np.uint32)])


def _split(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  return _hashed(key, lax.iota(np.uint32, 2 * math.prod(shape))).reshape((*shape, 2))


def _random_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
  if bit_width == 64:
    halves = _hashed(key, lax.iota(np.uint32, 2 * math.prod(shape))).astype(np.uint64)
    return (halves[0::2] << np.uint64(32) | halves[1::2]).reshape(shape)
  bits = _hashed(key, lax.iota(np.uint32, math.prod(shape)))
  return lax.convert_element_type(bits, np.dtype(f"uint{bit_width}")).reshape(shape)


def _fold_in(key: jax.Array, data: jax.Array) -> jax.Array:
  # Another stream than `_split`'s, whose counters are the same numbers.
  return _hashed(key ^ np.uint32(0x5BD1E995), jnp.stack([2 * data, 2 * data + 1]).astype(np.uint32))


HASHED = jex.random.define_prng_impl(key_shape=(2,), seed=_seed, split=_split,
                                     random_bits=_random_bits, fold_in=_fold_in, name="hashed")
