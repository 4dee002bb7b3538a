"""A per-token MLP or mixture of experts as a layer of the pattern: the block of Nemotron-H
whose mixer is an MLP ("-") or experts ("E"), and any hybrid whose MLPs differ block by block
(a mixer block without an MLP followed by a block of this layer computes what a mixer block
with that MLP computes)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common, functional
from ssmkit._src.layers.block import feed_forward
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.layers.experts import Experts, mixture, sow_balance
from ssmkit._src.layers.experts import param_specs as experts_specs
from ssmkit._src.modes import Mode

Array = jax.Array

KINDS = ("gelu", "geglu", "swiglu", "relu2", "experts")


def _width(cfg: Any, features: int) -> int:
  return 4 * features if cfg.width is None else cfg.width


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The projections (and biases) of the MLP over `features` channels, or the mixture's."""
  if cfg.kind not in KINDS:
    raise ValueError(f"`kind` must be one of {KINDS}, got {cfg.kind!r}.")
  if (cfg.kind == "experts") != (cfg.experts is not None):
    raise ValueError(f"`experts` is the mixture of kind='experts': give both or neither, got "
                     f"kind={cfg.kind!r} and experts={cfg.experts!r}.")
  if cfg.kind == "experts":
    if not isinstance(cfg.experts, Experts):
      raise ValueError(f"`experts` must be an ssmkit.layers.Experts, got "
                       f"{type(cfg.experts).__name__}.")
    return experts_specs(cfg.experts, features)
  if cfg.width is not None:
    common.check_positive_int(cfg.width, "width")
  width = _width(cfg, features)
  lecun = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
  shapes = {"up": (features, width), "down": (width, features)}
  if cfg.kind in ("geglu", "swiglu"):
    shapes = {"gate": (features, width), **shapes}
  specs = {}
  for name, shape in shapes.items():
    specs[f"{name}_proj"] = ParamSpec(shape, lecun)
    if cfg.use_bias:
      specs[f"{name}_bias"] = ParamSpec(shape[-1:], nn.initializers.zeros)
  return specs


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> tuple[()]:
  """No state: each step is its own."""
  del cfg, input_shape
  return ()


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: tuple[()] | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, tuple[()]]:
  """The MLP on every step of `(..., T, H)` inputs: `(y, ())`; resets change nothing."""
  del reset, mode, initial_state
  dtype = common.computation_dtype(x.dtype)
  if cfg.kind == "experts":
    y, balance = mixture(cfg.experts, params, x, dtype, axis_name)
    sow_balance(cfg, cfg.experts, balance)  # cfg is the layer of either front end
    return y.astype(x.dtype), ()

  def dense(name: str) -> Callable[[Array], Array]:
    def apply(u: Array) -> Array:
      u = common.project(u, params[f"{name}_proj"], dtype)
      bias = params.get(f"{name}_bias")
      return u if bias is None else u + common.leading_ones(bias, u.ndim)
    return apply

  y = feed_forward(x, cfg.kind, up=dense("up"), down=dense("down"),
                   gate=dense("gate") if "gate_proj" in params else None)
  return y.astype(x.dtype), ()


def step(cfg: Any, params: dict[str, Array], state: tuple[()], x_t: Array,
         reset: Array | None = None) -> tuple[tuple[()], Array]:
  """The MLP on one step of `(*batch, H)` inputs: `((), y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class FeedForward(functional.LinenLayer):
  """A per-token MLP, or a mixture of experts, as a layer: `(..., T, H)` -> `(..., T, H)`.

  down(act(up x)) for "gelu" and "relu2" (relu(u)^2, Nemotron-H's), down(act(gate x) * up x)
  for "geglu" and "swiglu", of hidden `width`; or with `kind="experts"` the mixture `experts`
  (`ssmkit.layers.Experts`), whose weighted load-balancing loss is sown in "aux_loss" as a
  `MixtureOfExperts` sows it. Steps do not interact: no state (`()`), `reset` and `mode`
  change nothing. In a pattern with `block="mixer"` and `mlp="none"`, a block of this layer
  is a pre-norm residual MLP block.

  Attributes:
    kind: "gelu", "geglu", "swiglu", "relu2" or "experts".
    width: the hidden width; None: 4 x the input width.
    use_bias: biases on the projections (not of "experts").
    experts: the mixture of `kind="experts"`.
    param_dtype: dtype of the parameters.
  """

  kind: str = "swiglu"
  width: int | None = None
  use_bias: bool = False
  experts: Experts | None = None
  param_dtype: jnp.dtype = jnp.float32

  parameter_groups = common.ParameterGroups(no_decay=frozenset(
      {"gate_bias", "up_bias", "down_bias"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)
