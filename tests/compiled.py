"""One compiled function per computation for the whole test run.

Compiling is most of the suite's time. A test that wraps a new lambda in `jax.jit`, or calls a
module eagerly, compiles again what another test compiled already; `compiled(fn, **static)`
gives every test asking for the same `fn` and static arguments the same jitted function, so
each program compiles once per process (and once per run, with the persistent cache that
`conftest.py` turns on).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax


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
  """`module.init(key(seed), zeros(shape, dtype))`, compiled and computed once per argument."""
  return jax.jit(module.init)(jax.random.key(seed), jax.numpy.zeros(shape, dtype))
