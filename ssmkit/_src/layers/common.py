"""Argument checks, initialisers and broadcasting helpers shared by the layers."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ssmkit._src import checks
from ssmkit._src.engine import with_next_slice
from ssmkit._src.linear_recurrence import accumulation_dtype

Array = jax.Array


class ParameterGroups(NamedTuple):
  """Which parameters of a layer an optimizer treats apart, by the names the layer gives them.

  Every layer declares its groups as the class attribute `parameter_groups`, next to the
  parameters it names, so a trainer names none: `ssmkit.train` trains `recurrence` with its
  `ssm_learning_rate` and no weight decay, and `no_decay` at the base learning rate without
  weight decay.

  Attributes:
    recurrence: the parameters of the recurrence (eigenvalues, step sizes, input matrices).
    no_decay: further parameters trained without weight decay.
  """

  recurrence: frozenset[str] = frozenset()
  no_decay: frozenset[str] = frozenset()


class ParamSpec(NamedTuple):
  """One parameter of a layer, as both front ends (linen and NNX) create it.

  A layer lists its parameters in order in `param_specs(cfg, features) -> dict[str, ParamSpec]`,
  keyed by name. A parameter whose start depends on others (LRU's gamma normalisation on its
  eigenvalues) names them in `inputs`: they come earlier in the dict, and `init` receives their
  values after its usual arguments.

  Attributes:
    shape: the parameter's shape.
    init: `init(key, shape, dtype, *inputs) -> Array`; without `inputs`, a
      `jax.nn.initializers` initializer.
    inputs: names of earlier parameters whose values `init` receives, in this order.
  """

  shape: tuple[int, ...]
  init: Callable[..., Array]
  inputs: tuple[str, ...] = ()


def create_params(specs: dict[str, ParamSpec], dtype: Any,
                  create: Callable[[str, Callable[..., Array], tuple[int, ...], Any], Array]
                  ) -> dict[str, Array]:
  """Creates the parameters `specs` lists, in order, by name.

  Args:
    specs: a layer's `param_specs`.
    dtype: the parameters' dtype.
    create: `create(name, init, shape, dtype) -> Array` makes one parameter from an
      `init(key, shape, dtype)` (the front end supplies the key, or an existing value); the
      inputs of a spec are already bound into its `init`.

  Returns:
    The parameters by name.
  """
  params = {}
  for name, spec in specs.items():
    init = spec.init
    if spec.inputs:
      init = functools.partial(_with_inputs, spec.init, tuple(params[i] for i in spec.inputs))
    params[name] = create(name, init, spec.shape, dtype)
  return params


def _with_inputs(init: Callable[..., Array], inputs: tuple[Array, ...], key: Array, shape, dtype
                 ) -> Array:
  return init(key, shape, dtype, *inputs)


def linen_params(module: nn.Module, specs: dict[str, ParamSpec], dtype: Any) -> dict[str, Array]:
  """Declares `specs` as parameters of the linen `module` (inside a compact method), by name."""
  return create_params(specs, dtype, module.param)


def check_choice(value: str, choices: tuple[str, ...], name: str) -> None:
  """Raises a ValueError naming `name` unless `value` is one of `choices`."""
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")


def check_positive_int(value: Any, name: str) -> None:
  """Raises a ValueError naming `name` unless `value` is a positive int (a layer attribute)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"`{name}` must be a positive int, got {value!r}.")


def check_float_dtype(value: Any, name: str, optional: bool = True) -> None:
  """Raises a ValueError naming `name` unless `value` names a floating dtype (or is None, when
  `optional`): `jnp.bfloat16`, "float32", ..."""
  if value is None and optional:
    return
  try:
    kind = None if value is None else jnp.dtype(value)  # jnp.dtype(None) is the default float
  except TypeError:
    kind = None
  if kind is None or not jnp.issubdtype(kind, jnp.floating):
    raise ValueError(f"`{name}` must be a floating dtype such as jnp.bfloat16 or 'float32'"
                     f"{' (or None)' if optional else ''}, got {value!r}.")


def check_causal(cfg: Any, what: str) -> None:
  """Raises a ValueError for a bidirectional layer (S4D, S5) asked for `what` (a step, a state)."""
  if getattr(cfg, "bidirectional", False):
    raise ValueError(f"a bidirectional {type(cfg).__name__} has no {what}: it reads the future.")


def complex_from(re: Array, im: Array) -> Array:
  """re + i im in complex64 at least: there is no 16-bit complex type, so parameters kept in
  bfloat16 (`param_dtype`) form their complex numbers in float32."""
  widen = lambda v: v.astype(jnp.promote_types(v.dtype, jnp.float32))
  return jax.lax.complex(widen(re), widen(im))


def leading_ones(v: Array, ndim: int) -> Array:
  """`v` with leading axes of size 1 up to rank `ndim`, for explicit broadcasting."""
  return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def _check(x: Array, reset: Array | None, name: str, layout: str, min_ndim: int,
           reset_what: str) -> tuple[Array, Array | None]:
  x = jnp.asarray(x)
  if x.ndim < min_ndim:
    raise ValueError(f"`{name}` must be `{layout}`, got shape {x.shape}.")
  checks.check_inexact(x, name)
  if reset is not None:
    reset = jnp.asarray(reset)
    checks.check_bool(reset, "reset")
    checks.check_shape(reset, x.shape[:-1], "reset", reset_what)
  return x, reset


def check_sequence(x: Array, reset: Array | None) -> tuple[Array, Array | None]:
  """Checks `(..., T, features)` inputs and `(..., T)` boolean resets."""
  return _check(x, reset, "x", "(..., T, features)", 2, "`x` without its feature axis")


def check_step(x_t: Array, reset: Array | None) -> tuple[Array, Array | None]:
  """Checks `(*batch, features)` inputs of one step and `(*batch,)` boolean resets."""
  return _check(x_t, reset, "x_t", "(*batch, features)", 1, "the batch shape of `x_t`")


def shift_back(x: Array, axis: int, axis_name: Hashable | None = None) -> Array:
  """x_{t+1} at t along `axis`, zero at the last step; with `axis_name`, of the whole sequence
  split over that mesh axis (a slice's last step reads the next device's first)."""
  rest = jax.lax.slice_in_dim(x, 1, x.shape[axis], axis=axis)
  shifted = jnp.concatenate([rest, jnp.zeros_like(jax.lax.slice_in_dim(x, 0, 1, axis=axis))], axis)
  return shifted if axis_name is None else with_next_slice(shifted, x, 1, axis, axis_name)


def check_state(state: Any, expected: Any, name: str) -> None:
  """Checks that `state` has the structure, shapes and dtypes of `expected`.

  Args:
    state: a layer's state.
    expected: the zero state of these inputs (arrays or `jax.ShapeDtypeStruct`s).
    name: the argument `state` was given as.
  """
  got = jax.tree.map(lambda s: (jnp.shape(s), jnp.result_type(s)), state)
  want = jax.tree.map(lambda s: (tuple(s.shape), s.dtype), expected)
  if got != want:
    raise ValueError(
        f"`{name}` must be a state like `initialize_state` makes for these inputs: "
        f"{want}, got {got}."
    )


def clear(state: Any, reset: Array | None) -> Any:
  """`state` (any pytree of `(*batch, ...)` arrays) set to zero where `(*batch,)` `reset` is True."""
  if reset is None:
    return state

  def leaf(s: Array) -> Array:
    flags = reset.reshape(reset.shape + (1,) * (s.ndim - reset.ndim))
    return jnp.where(flags, jnp.zeros_like(s), s)

  return jax.tree.map(leaf, state)


def computation_dtype(dtype: Any) -> Any:
  """The dtype a layer's projections compute in for inputs of `dtype`: bfloat16 or float16
  inputs (mixed precision) keep theirs; other inputs compute in their accumulation dtype
  (float32, or float64 for float64 inputs)."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
    return dtype
  return accumulation_dtype(dtype)


def project(v: Array, w: Array, dtype: Any) -> Array:
  """`v @ w` with both operands in `dtype` (a `computation_dtype`), summed and returned in its
  accumulation dtype: under mixed precision, bfloat16 products with float32 sums and results."""
  return jnp.matmul(v.astype(dtype), w.astype(dtype), preferred_element_type=accumulation_dtype(dtype))
