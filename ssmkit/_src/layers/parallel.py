"""Several sequence layers side by side on one input, their outputs summed: the hybrid mixer of
Falcon-H1 (Mamba-2 beside attention in every block), each branch with a factor on its input
and on its output (Falcon-H1's `ssm_in_multiplier`, `attention_out_multiplier`, ...)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp

from ssmkit._src.layers import common, functional
from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.layers.gated_deltanet import GatedDeltaNet
from ssmkit._src.layers.gated_deltaproduct import GatedDeltaProduct
from ssmkit._src.layers.kimi_delta_attention import KimiDeltaAttention
from ssmkit._src.layers.latent_attention import LatentAttention
from ssmkit._src.layers.lru import LRU
from ssmkit._src.layers.mamba import Mamba
from ssmkit._src.layers.mamba2 import Mamba2
from ssmkit._src.layers.mamba3 import Mamba3
from ssmkit._src.layers.mingru import MinGRU
from ssmkit._src.layers.rglru import RGLRU
from ssmkit._src.layers.s4d import S4D
from ssmkit._src.layers.s5 import S5
from ssmkit._src.layers.short_conv import ShortConv
from ssmkit._src.modes import Mode

Array = jax.Array

# The layers a branch may be, by the registry's names, which prefix their parameters' names.
BRANCHES: dict[str, type[functional.LinenLayer]] = {
    "lru": LRU, "s4d": S4D, "s5": S5, "mamba": Mamba, "mamba2": Mamba2, "mamba3": Mamba3,
    "gated_deltanet": GatedDeltaNet, "kimi_delta_attention": KimiDeltaAttention,
    "gated_delta_product": GatedDeltaProduct, "rglru": RGLRU, "mingru": MinGRU,
    "attention": Attention, "latent_attention": LatentAttention, "short_conv": ShortConv}


def branches(cfg: Any) -> list[tuple[str, functional.LinenLayer, float, float]]:
  """`(name, layer, input factor, output factor)` of each branch, the configuration checked."""
  layers = cfg.layers
  if not isinstance(layers, tuple | list) or not layers:
    raise ValueError(f"`layers` must be a non-empty tuple of layer factories, got {layers!r}.")
  unknown = [f for f in layers if isinstance(f, str) and f not in BRANCHES]
  if unknown:
    raise ValueError(f"`layers`: {unknown} name no branch; the branches are "
                     f"{', '.join(BRANCHES)}.")
  made = [(BRANCHES[f] if isinstance(f, str) else f)(parent=None) for f in layers]
  names = []
  for layer in made:
    name = next((n for n, kind in BRANCHES.items() if type(layer) is kind), None)
    if name is None:
      raise ValueError(f"`layers`: {type(layer).__name__} cannot be a branch; the branches are "
                       f"{', '.join(BRANCHES)}.")
    names.append(name)
  if len(set(names)) != len(names):
    raise ValueError(f"`layers` must be of different kinds (their parameters are named by "
                     f"kind), got {names}.")
  factors = []
  for option in ("input_scales", "output_scales"):
    scales = getattr(cfg, option)
    scales = (1.0,) * len(made) if scales is None else scales
    if (not isinstance(scales, tuple | list) or len(scales) != len(made) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v != 0 for v in scales)):
      raise ValueError(f"`{option}` must be {len(made)} non-zero numbers (one per layer) or "
                       f"None, got {scales!r}.")
    factors.append(scales)
  return list(zip(names, made, *factors, strict=True))


def branch_params(params: dict[str, Array], name: str) -> dict[str, Array]:
  """The parameters of the branch `name`, by the names its layer gives them."""
  prefix = f"{name}_"
  return {key[len(prefix):]: value for key, value in params.items() if key.startswith(prefix)}


def _scaled(x: Array, factor: float) -> Array:
  return x if factor == 1 else x * jnp.asarray(factor, x.dtype)


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """Every branch's parameters over `features` channels, named "{branch}_{name}"."""
  return {f"{name}_{key}": spec._replace(inputs=tuple(f"{name}_{i}" for i in spec.inputs))
          for name, layer, _, _ in branches(cfg)
          for key, spec in layer.maths.param_specs(layer, features).items()}


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> tuple[Any, ...]:
  """The zero states of the branches, in their order, for inputs `(*batch, H)`."""
  return tuple(layer.maths.initialize_state(layer, input_shape)
               for _, layer, _, _ in branches(cfg))


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: tuple[Any, ...] | None = None, axis_name: Hashable | None = None,
             return_state: bool = True) -> tuple[Array, tuple[Any, ...]]:
  """The branches on `(..., T, H)` inputs: `(sum of their scaled outputs, their states)`."""
  parts = branches(cfg)
  states = (None,) * len(parts) if initial_state is None else initial_state
  y, finals = None, []
  for (name, layer, into, out), state in zip(parts, states, strict=True):
    options = {"return_state": return_state} if layer.maths.final_state_on_request else {}
    y_i, final = layer.maths.sequence(layer, branch_params(params, name), _scaled(x, into), reset, mode,
                                      initial_state=state, axis_name=axis_name, **options)
    y_i = _scaled(y_i, out)
    y = y_i if y is None else y + y_i
    finals.append(final)
  return y, tuple(finals)


def step(cfg: Any, params: dict[str, Array], state: tuple[Any, ...], x_t: Array,
         reset: Array | None = None) -> tuple[tuple[Any, ...], Array]:
  """One step of every branch on `(*batch, H)` inputs: `(their states, y_t)`."""
  y, states = None, []
  for (name, layer, into, out), state_i in zip(branches(cfg), state, strict=True):
    state_i, y_i = layer.maths.step(layer, branch_params(params, name), state_i,
                                    _scaled(x_t, into), reset)
    y_i = _scaled(y_i, out)
    y = y_i if y is None else y + y_i
    states.append(state_i)
  return tuple(states), y


def _groups() -> common.ParameterGroups:
  """Each branch layer's groups, by the names the branch gives its parameters."""
  def named(group: str) -> frozenset[str]:
    return frozenset(f"{name}_{key}" for name, layer in BRANCHES.items()
                     for key in getattr(layer.parameter_groups, group))
  return common.ParameterGroups(recurrence=named("recurrence"), no_decay=named("no_decay"))


class Parallel(functional.LinenLayer):
  """Sequence layers side by side: `(..., T, H)` -> `(..., T, H)`,

    y = sum_i output_scales[i] * layer_i(input_scales[i] * x),

  Falcon-H1's hybrid mixer (Mamba-2 and attention on the same normalised input). Each branch
  is a layer of `BRANCHES` (any of ssmkit's mixers but RWKV-7, at most one of each kind);
  its parameters are its own, named "{kind}_{name}" (`mamba2_A_log`, `attention_q_proj`),
  and its own `mode`, resets and sequence parallelism apply. The state is the tuple of the
  branches' states, in order.

  Attributes:
    layers: the branches: linen layer classes, `functools.partial`s of them (the NNX front
      end takes the same) or their names in `BRANCHES` (with their default options, as a
      training config gives them); default Mamba-2 beside attention.
    input_scales: a factor on each branch's input, or None (all 1).
    output_scales: a factor on each branch's output, or None (all 1).
    param_dtype: dtype of every branch's parameters (the branches' own is not read).

  References:
    Falcon-LLM Team, "Falcon-H1: A Family of Hybrid-Head Language Models Redefining
    Efficiency and Performance", 2025 (arXiv:2507.22448); `transformers`'
    `FalconH1DecoderLayer`.
  """

  layers: tuple[Any, ...] = (Mamba2, Attention)
  input_scales: tuple[float, ...] | None = None
  output_scales: tuple[float, ...] | None = None
  param_dtype: jnp.dtype = jnp.float32

  parameter_groups = _groups()
  maths = functional.Maths(param_specs, sequence, step, initialize_state,
                           final_state_on_request=True)
