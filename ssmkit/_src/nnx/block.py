"""`SSMBlock` and `MixerBlock` as Flax NNX modules: the linen blocks' compositions with NNX sublayers."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ssmkit._src.layers import common
from ssmkit._src.layers.block import (
  ACTIVATIONS,
  NORM_POSITIONS,
  NORMS,
  check_experts,
  check_mask,
  check_mlp_scales,
  check_norm_across_devices,
  expand_mask,
  feed_forward,
  mixer_residual,
  mlp_width,
  residual,
  run_layer,
)
from ssmkit._src.layers.experts import Experts
from ssmkit._src.layers.functional import ValueResidual
from ssmkit._src.layers.norms import rms_norm_plus_one
from ssmkit._src.modes import Mode
from ssmkit._src.nnx.experts import MixtureOfExperts
from ssmkit._src.nnx.layers import LRU

Array = jax.Array


class RMSNormPlusOne(nnx.Module):
  """RMSNorm scaled by 1 + `scale` (starting at 0), as `ssmkit.layers`' norm "rms_plus_one"."""

  def __init__(self, features: int, *, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    del rngs
    self.scale = nnx.Param(jnp.zeros((features,), param_dtype))
    self.epsilon, self.dtype = epsilon, dtype

  def __call__(self, x: Array) -> Array:
    return rms_norm_plus_one(x, self.scale[...], self.epsilon, self.dtype)


Norm = nnx.LayerNorm | nnx.RMSNorm | RMSNormPlusOne | nnx.BatchNorm

# The NNX module of each norm; the linen block names its own `<Module>_0` inside "norm".
NORM_MODULES: dict[str, type[Norm]] = {"layer": nnx.LayerNorm, "rms": nnx.RMSNorm,
                                       "rms_plus_one": RMSNormPlusOne, "batch": nnx.BatchNorm}


def make_norm(kind: str, features: int, rngs: nnx.Rngs, *, dtype: Any = None,
              param_dtype: Any = jnp.float32, eps: float | None = None) -> Norm:
  """The norm "layer", "rms", "rms_plus_one" or "batch" over `features`, with the linen block's settings
  (`eps` None: flax's default epsilon)."""
  common.check_choice(kind, NORMS, "norm")
  precision = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                   **({} if eps is None else {"epsilon": eps}))
  if kind == "batch":
    return nnx.BatchNorm(features, momentum=0.9, **precision)
  return NORM_MODULES[kind](features, **precision)


def norm_kind(norm: Norm) -> str:
  """"layer", "rms", "rms_plus_one" or "batch": the kind of the norm module `norm`."""
  return next(kind for kind, cls in NORM_MODULES.items() if isinstance(norm, cls))


def normalize(norm: Norm, x: Array, mask: Array | None, *, inference: bool,
              axis_name: Hashable | None = None) -> Array:
  """`norm(x)`; BatchNorm skips the masked steps, and uses its running averages at `inference`
  whatever the module's train/eval mode (its batch statistics are refused under `axis_name`)."""
  if isinstance(norm, nnx.BatchNorm):
    check_norm_across_devices(not (inference or norm.use_running_average), axis_name)
    return norm(x, use_running_average=True if inference else None, mask=expand_mask(mask, x))
  return norm(x)


class _Block(nnx.Module):
  """What every NNX block offers around its carry-first `forward`: sequences, zero state, one step.

  The layer's attribute is named by `_layer_name`.
  """

  _layer_name: str

  def __call__(self, x: Array, mask: Array | None = None, reset: Array | None = None, *,
               initial_state: Any = None, return_state: bool = False, mode: str | Mode = "auto",
               axis_name: Hashable | None = None) -> Array | tuple[Array, Any]:
    """Runs the block over a whole sequence.

    Args:
      x: `(..., T, H)` inputs.
      mask: optional `(..., T)` booleans, True on real steps (batch axes of size 1 broadcast).
      reset: optional `(..., T)` booleans; True clears the layer's state before that step.
      initial_state: optional layer state to start from, as `step` makes it; default zeros.
      return_state: also return the layer's state after the last step (padding included).
      mode: scan mode of the layer.
      axis_name: sequence parallelism, as for the layers (`ssmkit.layers.LRU.__call__`).

    Returns:
      `(..., T, H)` outputs in `x`'s dtype; with `return_state`, `(outputs, state)`.
    """
    x, reset = common.check_sequence(x, reset)
    (state, _), y = self.forward(x, check_mask(mask, x), reset, initial_state, single_step=False,
                                 return_state=return_state, mode=mode, axis_name=axis_name)
    return (y, state) if return_state else y

  def initialize_state(self, input_shape: tuple[int, ...]) -> Any:
    """The layer's zero state for inputs `(*batch, H)` of one step."""
    return getattr(self, self._layer_name).initialize_state(input_shape)

  def step(self, state: Any, x_t: Array, reset: Array | None = None) -> tuple[Any, Array]:
    """Advances one step at inference (dropout off, BatchNorm on running averages).

    Args:
      state: the layer's state.
      x_t: `(*batch, H)` input of this step.
      reset: optional `(*batch,)` booleans; True clears the state before this step.

    Returns:
      `(state, y_t)` with `y_t` of shape `(*batch, H)`.
    """
    x_t, reset = common.check_step(x_t, reset)
    (state, _), y = self.forward(x_t, None, reset, state, single_step=True, return_state=True,
                                 mode="auto")
    return state, y


class SSMBlock(_Block):
  """`ssmkit.layers.SSMBlock` as an NNX module: x + dropout(activation(ssm(norm(x)))).

  Built as `SSMBlock(features, layer=ssmkit.nnx.LRU, ..., rngs=nnx.Rngs(0))`; the layer is
  `layer(features, rngs=rngs)`, so a class of `ssmkit.nnx` or a `functools.partial` of one.
  Dropout and BatchNorm follow NNX's modes: after `block.train()` (the mode a new module
  starts in) dropout is on and BatchNorm normalises by batch statistics and updates its
  running averages; after `block.eval()` neither. Dropout draws from the "dropout" stream of
  `rngs` (the default stream when it has none). `step` is always inference.

  Attributes:
    norm: the norm module (`nnx.LayerNorm`, `nnx.RMSNorm` or `nnx.BatchNorm`).
    ssm: the SSM layer.
    dropout: the dropout module.
    glu_value: the GLU's value projection ("glu"), else None.
    glu_gate: the GLU's gate projection ("glu", "half_glu"), else None.
  """

  _layer_name = "ssm"

  def __init__(self, features: int, *, layer: Callable[..., nnx.Module] = LRU, dtype: Any = None,
               param_dtype: Any = jnp.float32, norm: str = "layer", norm_eps: float | None = None,
               activation: str = "glu", dropout_rate: float = 0.0, prenorm: bool = True,
               rngs: nnx.Rngs):
    """Builds the block.

    Args:
      features: the width H of inputs and outputs.
      layer: factory of the SSM layer, e.g. `functools.partial(ssmkit.nnx.S5, d_state=32)`.
      dtype: the computation dtype of the norm and projections; None: their inputs'.
      param_dtype: the dtype of their parameters (the layer has its own).
      norm: "layer", "batch", "rms" or "rms_plus_one".
      norm_eps: the norm's epsilon; None: flax's default.
      activation: "gelu", "glu" or "half_glu".
      dropout_rate: dropout after the activation and after the GLU, in training mode.
      prenorm: normalise the block input (True) or the residual sum (False).
      rngs: the parameters' and dropout's random streams.
    """
    common.check_positive_int(features, "features")
    common.check_choice(activation, ACTIVATIONS, "activation")
    self.features = features
    self.activation = activation
    self.prenorm = prenorm
    self.dtype, self.param_dtype = dtype, param_dtype
    self.norm_eps = norm_eps
    self.norm = make_norm(norm, features, rngs, dtype=dtype, param_dtype=param_dtype, eps=norm_eps)
    self.ssm = layer(features, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
    linear = functools.partial(nnx.Linear, features, features, dtype=dtype, param_dtype=param_dtype,
                               rngs=rngs)
    self.glu_value = linear() if activation == "glu" else None
    self.glu_gate = linear() if activation != "gelu" else None

  def forward(self, x: Array, mask: Array | None, reset: Array | None, state: Any, *,
              single_step: bool, return_state: bool, mode: str | Mode,
              axis_name: Hashable | None = None, value_residual: ValueResidual | None = None
              ) -> tuple[tuple[Any, Any], Array]:
    """The block on checked inputs, carry first, as a model stacks it: `((state,
    value_residual), y)` (see `ssmkit.layers.SSMBlock.forward`; training follows `train()` /
    `eval()`)."""
    return residual(
        x, mask,
        functools.partial(run_layer, self.ssm, reset=reset, state=state, single_step=single_step,
                          return_state=return_state, mode=mode, axis_name=axis_name,
                          value_residual=value_residual),
        norm=lambda u: normalize(self.norm, u, mask, inference=single_step, axis_name=axis_name),
        dropout=lambda u: self.dropout(u, deterministic=True if single_step else None),
        value=self.glu_value, gate=self.glu_gate, prenorm=self.prenorm)


class MixerBlock(_Block):
  """`ssmkit.layers.MixerBlock` as an NNX module: h = x + mixer(norm(x)), then h + mlp(norm(h)).

  Built as `MixerBlock(features, layer=ssmkit.nnx.Attention, mlp="swiglu", ..., rngs=...)`;
  the mixer is `layer(features, rngs=rngs)`. Dropout and BatchNorm follow NNX's modes as in
  `SSMBlock`; `step` is always inference.

  Attributes:
    norm: the norm before the mixer.
    mixer: the sequence layer.
    dropout: the dropout module.
    mlp_norm: the norm before the MLP, or None without an MLP.
    mlp_up: the MLP's first projection, or None.
    mlp_gate: the MLP's gate projection ("geglu", "swiglu"), else None.
    mlp_down: the MLP's output projection, or None.
    mlp_experts: the mixture of experts of `mlp="experts"`, else None.
  """

  _layer_name = "mixer"

  def __init__(self, features: int, *, layer: Callable[..., nnx.Module] = LRU, dtype: Any = None,
               param_dtype: Any = jnp.float32, norm: str = "rms", norm_eps: float | None = None,
               mlp: str = "none", mlp_expansion: float = 4.0, mlp_bias: bool = False,
               experts: Experts | None = None, residual_scale: float = 1.0,
               mlp_scales: tuple[float, float] = (1.0, 1.0), norm_position: str = "input",
               dropout_rate: float = 0.0, rngs: nnx.Rngs):
    """Builds the block.

    Args:
      features: the width H of inputs and outputs.
      layer: factory of the mixer, e.g. `functools.partial(ssmkit.nnx.Attention, window=64)`.
      dtype: the computation dtype of the norms and the MLP; None: their inputs'.
      param_dtype: the dtype of their parameters (the layer has its own).
      norm: "rms", "rms_plus_one", "layer" or "batch".
      norm_eps: the norms' epsilon; None: flax's default.
      mlp: "none", "gelu", "geglu", "swiglu" or "experts" (see `ssmkit.layers.MixerBlock`).
      mlp_expansion: the MLP's hidden width over `features`.
      mlp_bias: biases in the MLP's projections.
      experts: the mixture of `mlp="experts"` (`ssmkit.layers.Experts`).
      residual_scale: the factor on the mixer's and the MLP's outputs before the residual.
      mlp_scales: (a, b): the dense MLP's activation input times a, its output times b.
      norm_position: "input" (pre-norm) or "output" (each norm on its branch's output).
      dropout_rate: dropout on the mixer's and the MLP's outputs, in training mode.
      rngs: the parameters' and dropout's random streams.
    """
    common.check_positive_int(features, "features")
    check_experts(mlp, experts)
    check_mlp_scales(mlp_scales)
    common.check_choice(norm_position, NORM_POSITIONS, "norm_position")
    self.features = features
    self.mlp = mlp
    self.mlp_expansion = mlp_expansion
    self.mlp_bias = mlp_bias
    self.experts = experts
    self.residual_scale = residual_scale
    self.mlp_scales = tuple(mlp_scales)
    self.norm_position = norm_position
    self.dtype, self.param_dtype = dtype, param_dtype
    precision = dict(dtype=dtype, param_dtype=param_dtype)
    self.norm_eps = norm_eps
    self.norm = make_norm(norm, features, rngs, eps=norm_eps, **precision)
    self.mixer = layer(features, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
    hidden = mlp_width(features, mlp_expansion)
    linear = functools.partial(nnx.Linear, use_bias=mlp_bias, rngs=rngs, **precision)
    has_mlp, dense = mlp != "none", mlp not in ("none", "experts")
    self.mlp_norm = make_norm(norm, features, rngs, eps=norm_eps, **precision) if has_mlp else None
    self.mlp_up = linear(features, hidden) if dense else None
    self.mlp_gate = linear(features, hidden) if mlp in ("geglu", "swiglu") else None
    self.mlp_down = linear(hidden, features) if dense else None
    self.mlp_experts = (MixtureOfExperts(features, experts, rngs=rngs, **precision)
                        if mlp == "experts" else None)

  def forward(self, x: Array, mask: Array | None, reset: Array | None, state: Any, *,
              single_step: bool, return_state: bool, mode: str | Mode,
              axis_name: Hashable | None = None, value_residual: ValueResidual | None = None
              ) -> tuple[tuple[Any, Any], Array]:
    """The block on checked inputs, carry first, as a model stacks it: `((state,
    value_residual), y)` (see `ssmkit.layers.SSMBlock.forward`; training follows `train()` /
    `eval()`)."""
    norm = functools.partial(normalize, mask=mask, inference=single_step, axis_name=axis_name)
    mlp = None
    if self.mlp == "experts":
      mlp = functools.partial(self.mlp_experts, axis_name=axis_name)
    elif self.mlp != "none":
      mlp = functools.partial(feed_forward, kind=self.mlp, up=self.mlp_up, gate=self.mlp_gate,
                              down=self.mlp_down, scales=self.mlp_scales)
    return mixer_residual(
        x, mask,
        functools.partial(run_layer, self.mixer, reset=reset, state=state, single_step=single_step,
                          return_state=return_state, mode=mode, axis_name=axis_name,
                          value_residual=value_residual),
        norm=lambda u: norm(self.norm, u),
        dropout=lambda u: self.dropout(u, deterministic=True if single_step else None),
        mlp_norm=None if mlp is None else (lambda u: norm(self.mlp_norm, u)), mlp=mlp,
        scale=self.residual_scale, norm_position=self.norm_position)
