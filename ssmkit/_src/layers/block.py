"""The residual blocks a model stacks: the S5-style `SSMBlock` and the transformer-style `MixerBlock`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common
from ssmkit._src.layers.experts import Experts, MixtureOfExperts
from ssmkit._src.layers.functional import ValueResidual, shares_values
from ssmkit._src.layers.lru import LRU
from ssmkit._src.layers.norms import RMSNormPlusOne
from ssmkit._src.modes import Mode

Array = jax.Array
ModuleDef = Callable[..., nn.Module]

NORMS = ("layer", "batch", "rms", "rms_plus_one")
ACTIVATIONS = ("gelu", "glu", "half_glu")
MLPS = ("none", "gelu", "geglu", "swiglu", "experts")
NORM_POSITIONS = ("input", "output")
# The activation of each MLP; the gated ones multiply it by a second projection. ("relu2",
# relu(u)^2, is Nemotron-H's, which `ssmkit.layers.FeedForward` takes.)
_MLP_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": jax.nn.gelu, "geglu": jax.nn.gelu, "swiglu": jax.nn.silu,
    "relu2": lambda u: jnp.square(jax.nn.relu(u))}


def expand_mask(mask: Array | None, x: Array) -> Array | None:
  """`(..., T)` step mask as `x`'s shape `(..., T, H)`, or None."""
  return None if mask is None else jnp.broadcast_to(mask[..., None], x.shape)


def run_layer(layer: Any, x: Array, *, reset: Array | None, state: Any, single_step: bool,
              return_state: bool, mode: str | Mode, axis_name: Hashable | None = None,
              value_residual: ValueResidual | None = None) -> tuple[tuple[Any, Any], Array]:
  """`((state, value_residual), y)` of an SSM layer (linen or NNX) on one step, or on a sequence
  from `state` (with its time axis split over the mesh axis `axis_name`, if given).

  The state is None on a sequence without `state` and `return_state`. The value residual
  passes to a layer that shares values (`functional.shares_values`) and comes back from it;
  any other layer passes it on unchanged.
  """
  options = {}
  if value_residual is not None and shares_values(layer):
    options["value_residual"] = value_residual
  if single_step:
    state, y, *shared = layer.step(state, x, reset, **options)
    return (state, shared[0] if shared else value_residual), y
  # Only asked for when used, so any layer with the basic contract fits the plain paths.
  if axis_name is not None:
    options["axis_name"] = axis_name
  if state is None and not return_state and "value_residual" not in options:
    return (None, value_residual), layer(x, reset, mode=mode, **options)
  y, state, *shared = layer(x, reset, mode=mode, initial_state=state, return_state=True, **options)
  return (state, shared[0] if shared else value_residual), y


def check_norm_across_devices(batch_statistics: bool, axis_name: Hashable | None) -> None:
  """Refuses BatchNorm's batch statistics over a sequence split across devices."""
  if batch_statistics and axis_name is not None:
    raise ValueError(
        "norm='batch' takes its statistics over the batch and time, which `axis_name` splits "
        "across devices: train with norm='layer' or 'rms' (BatchNorm's running averages, at "
        "evaluation, work across devices).")


def residual(x: Array, mask: Array | None, ssm: Callable[[Array], tuple[Any, Array]], *,
             norm: Callable[[Array], Array], dropout: Callable[[Array], Array],
             value: Callable[[Array], Array] | None, gate: Callable[[Array], Array] | None,
             prenorm: bool) -> tuple[Any, Array]:
  """The residual block from its parts, as both front ends (linen and NNX) compose it.

  y = x + dropout(glu(dropout(gelu(ssm(norm(x)))))), the norm applied to the sum instead when
  not `prenorm`; glu(u) = value(u) * sigmoid(gate(u)) with a `value` ("glu"),
  u * sigmoid(gate(u)) with only a `gate` ("half_glu"), and no GLU without either ("gelu").

  Args:
    x: `(..., T, H)` inputs, or `(*batch, H)` for one step.
    mask: optional `x.shape[:-1]` booleans, True on real steps: the SSM sees zeros elsewhere.
    ssm: the SSM layer, `ssm(u) -> (carry, y)`, its carry the layer's state and value
      residual (see `run_layer`).
    norm: the normalisation.
    dropout: the dropout (the identity at inference).
    value: the GLU's value projection, or None.
    gate: the GLU's gate projection, or None.
    prenorm: normalise the input (True) or the residual sum (False).

  Returns:
    `(carry, y)`: the SSM's carry and the outputs, of `x`'s shape and dtype.
  """
  y = norm(x) if prenorm else x
  if mask is not None:
    y = jnp.where(mask[..., None], y, jnp.zeros_like(y))
  carry, y = ssm(y)
  y = dropout(jax.nn.gelu(y))
  if gate is not None:
    y = dropout((y if value is None else value(y)) * jax.nn.sigmoid(gate(y)))
  y = x + y.astype(x.dtype)
  return carry, y if prenorm else norm(y)


def mlp_width(features: int, expansion: float) -> int:
  """The hidden width of a block's MLP: `expansion * features`, rounded, at least 1."""
  return max(1, round(expansion * features))


def feed_forward(x: Array, kind: str, *, up: Callable[[Array], Array],
                 gate: Callable[[Array], Array] | None, down: Callable[[Array], Array],
                 scales: tuple[float, float] = (1.0, 1.0)) -> Array:
  """The MLP `kind` of `MLPS` (not "none") or "relu2": down(act(up(x))) with GELU ("gelu") or
  relu(u)^2 ("relu2"), or down(act(gate(x)) * up(x)) with GELU ("geglu") or SiLU ("swiglu");
  `gate` is None for "gelu" and "relu2". `scales` (a, b): act's input times a, the output
  times b (Falcon-H1's `mlp_multipliers`)."""
  activation = _MLP_ACTIVATIONS[kind]
  into, out = scales
  scaled = lambda u, factor: u if factor == 1 else u * jnp.asarray(factor, u.dtype)
  hidden = (activation(scaled(up(x), into)) if gate is None
            else activation(scaled(gate(x), into)) * up(x))
  return scaled(down(hidden), out)


def check_mlp_scales(scales: Any) -> None:
  """Checks a mixer block's `mlp_scales`: two numbers."""
  if not isinstance(scales, tuple | list) or len(scales) != 2 or not all(
      isinstance(v, int | float) and not isinstance(v, bool) for v in scales):
    raise ValueError(f"`mlp_scales` must be two numbers (the activation's input factor, the "
                     f"output's), got {scales!r}.")


def mixer_residual(x: Array, mask: Array | None, mixer: Callable[[Array], tuple[Any, Array]], *,
                   norm: Callable[[Array], Array], dropout: Callable[[Array], Array],
                   mlp_norm: Callable[[Array], Array] | None,
                   mlp: Callable[[Array], Array] | None,
                   scale: float = 1.0, norm_position: str = "input") -> tuple[Any, Array]:
  """The transformer-style block from its parts, as both front ends compose it.

  h = x + s dropout(mixer(norm(x))); y = h + s dropout(mlp(mlp_norm(h))), or y = h without an
  MLP; s = `scale` (Granite's residual multiplier). With `norm_position` "output" each norm
  takes its branch's output instead (OLMo 2's): h = x + s dropout(norm(mixer(x))), y = h +
  s dropout(mlp_norm(mlp(h))).

  Args:
    x: `(..., T, H)` inputs, or `(*batch, H)` for one step.
    mask: optional `x.shape[:-1]` booleans, True on real steps: the mixer sees zeros elsewhere.
    mixer: the sequence layer, `mixer(u) -> (carry, y)`, its carry the layer's state and
      value residual (see `run_layer`).
    norm: the normalisation before the mixer.
    dropout: the dropout (the identity at inference).
    mlp_norm: the normalisation before the MLP, or None without one.
    mlp: the MLP (see `feed_forward`), or None.
    scale: the factor on both branches before they join the residual stream.
    norm_position: "input" (the norms before their branches) or "output" (after them).

  Returns:
    `(carry, y)`: the mixer's carry and the outputs, of `x`'s shape and dtype.
  """
  common.check_choice(norm_position, NORM_POSITIONS, "norm_position")
  scaled = (lambda u: u) if scale == 1.0 else (lambda u: u * scale)
  before, after = (norm, lambda u: u) if norm_position == "input" else (lambda u: u, norm)
  h = before(x)
  if mask is not None:
    h = jnp.where(mask[..., None], h, jnp.zeros_like(h))
  carry, h = mixer(h)
  x = x + scaled(dropout(after(h))).astype(x.dtype)
  if mlp is not None:
    h = mlp(mlp_norm(x)) if norm_position == "input" else mlp_norm(mlp(x))
    x = x + scaled(dropout(h)).astype(x.dtype)
  return carry, x


class Norm(nn.Module):
  """LayerNorm, RMSNorm, RMSNorm scaled by 1 + w ("rms_plus_one": Gemma's, Qwen3-Next's) or
  BatchNorm over the feature axis; BatchNorm skips masked steps.

  `dtype` is the dtype of its outputs (None: its inputs'; statistics are taken in float32 for
  narrower inputs), `param_dtype` that of its scale and bias, `eps` the epsilon added to the
  variance (None: flax's default, 1e-6 for LayerNorm and RMSNorm, 1e-5 for BatchNorm).

  BatchNorm uses batch statistics and updates the "batch_stats" collection when `train`, and
  its running averages (momentum 0.9) otherwise, which makes it a per-step map at inference.
  """

  kind: str = "layer"
  dtype: Any = None
  param_dtype: Any = jnp.float32
  eps: float | None = None

  @nn.compact
  def __call__(self, x: Array, mask: Array | None = None, *, train: bool = False,
               axis_name: Hashable | None = None) -> Array:
    common.check_choice(self.kind, NORMS, "norm")
    check_norm_across_devices(self.kind == "batch" and train, axis_name)
    precision = dict(dtype=self.dtype, param_dtype=self.param_dtype,
                     **({} if self.eps is None else {"epsilon": self.eps}))
    if self.kind == "layer":
      return nn.LayerNorm(**precision)(x)
    if self.kind == "rms":
      return nn.RMSNorm(**precision)(x)
    if self.kind == "rms_plus_one":
      return RMSNormPlusOne(**precision)(x)
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, **precision)(
        x, mask=expand_mask(mask, x))


class _Block(nn.Module):
  """What every block offers around its carry-first `forward`: sequences, zero state, one step.

  `dtype` is the computation dtype of its norms and projections (None: that of their inputs
  and parameters), `param_dtype` the dtype of their parameters; the layer has its own.
  `norm_eps` is its norms' epsilon (None: flax's default, see `Norm`).
  """

  layer: ModuleDef = LRU
  dtype: Any = None
  param_dtype: Any = jnp.float32
  norm_eps: float | None = None

  def _norm(self, name: str) -> Norm:
    return Norm(self.norm, dtype=self.dtype, param_dtype=self.param_dtype, eps=self.norm_eps,
                name=name)

  def _dense(self, features: int, name: str, **options: Any) -> nn.Dense:
    return nn.Dense(features, dtype=self.dtype, param_dtype=self.param_dtype, name=name, **options)

  def __call__(self, x: Array, mask: Array | None = None, reset: Array | None = None, *,
               initial_state: Any = None, return_state: bool = False, mode: str | Mode = "auto",
               train: bool = False, axis_name: Hashable | None = None) -> Array | tuple[Array, Any]:
    """Runs the block over a whole sequence.

    Args:
      x: `(..., T, H)` inputs.
      mask: optional `(..., T)` booleans, True on real steps (batch axes of size 1 broadcast).
      reset: optional `(..., T)` booleans; True clears the layer's state before that step.
      initial_state: optional layer state to start from, as `step` makes it; default zeros.
      return_state: also return the layer's state after the last step (padding included).
      mode: scan mode of the layer.
      train: dropout on and BatchNorm on batch statistics (needs a "dropout" rng when
        `dropout_rate` > 0 and a mutable "batch_stats" collection with BatchNorm).
      axis_name: sequence parallelism, as for the layers (`ssmkit.layers.LRU.__call__`).

    Returns:
      `(..., T, H)` outputs in `x`'s dtype; with `return_state`, `(outputs, state)`.
    """
    x, reset = common.check_sequence(x, reset)
    mask = check_mask(mask, x)
    (state, _), y = self.forward(x, mask, reset, initial_state, single_step=False,
                                 return_state=return_state, mode=mode, train=train,
                                 axis_name=axis_name)
    return (y, state) if return_state else y

  def initialize_state(self, input_shape: tuple[int, ...]) -> Any:
    """The layer's zero state for inputs `(*batch, H)` of one step."""
    return self.layer(parent=None).initialize_state(input_shape)

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
                                 mode="auto", train=False)
    return state, y


class SSMBlock(_Block):
  """x + dropout(activation(ssm(norm(x)))), with norm after the residual when `prenorm` is False.

  Inputs `(..., T, H)` give outputs `(..., T, H)`. The activation is GELU, or GELU followed by a
  gated linear unit: "glu" is `W1 y * sigmoid(W2 y)` (LRU, S5 "full GLU"), "half_glu" is
  `y * sigmoid(W y)` (S5 "half GLU"). `mask` marks real steps: the SSM sees zeros at padded steps,
  so a bidirectional layer carries nothing back from the padding, and BatchNorm ignores them.

  Attributes:
    layer: factory of the SSM layer, e.g. `functools.partial(ssmkit.layers.S5, d_state=32)`.
    norm: "layer", "batch", "rms" or "rms_plus_one" (scaled by 1 + w).
    activation: "gelu", "glu" or "half_glu".
    dropout_rate: dropout after the activation and after the GLU, when `train`.
    prenorm: normalise the block input (True) or the residual sum (False).

  References:
    Smith et al., "Simplified State Space Layers for Sequence Modeling", ICLR 2023 (S5 blocks).
    Orvieto et al., "Resurrecting Recurrent Neural Networks for Long Sequences", ICML 2023.
  """

  norm: str = "layer"
  activation: str = "glu"
  dropout_rate: float = 0.0
  prenorm: bool = True

  @nn.compact
  def forward(self, x: Array, mask: Array | None, reset: Array | None, state: Any, *, single_step: bool,
              return_state: bool, mode: str | Mode, train: bool, axis_name: Hashable | None = None,
              value_residual: ValueResidual | None = None) -> tuple[tuple[Any, Any], Array]:
    """The block on checked inputs, carry first, as a model stacks it: `((state,
    value_residual), y)`.

    Args:
      x: `(..., T, H)` inputs, or `(*batch, H)` for one step.
      mask: None, or `x.shape[:-1]` booleans as `check_mask` returns them.
      reset: None, or `x.shape[:-1]` booleans.
      state: the SSM state to start from; None: zeros (sequences only).
      single_step: `x` is one step (the layer's `step`, inference).
      return_state: compute the SSM state after a sequence (else it may be None).
      mode: scan mode of the SSM layer.
      train: dropout on and BatchNorm on batch statistics.
      axis_name: the mesh axis over which the time axis is split, or None.
      value_residual: the value residual of the blocks before (see `run_layer`), or None.
    """
    common.check_choice(self.activation, ACTIVATIONS, "activation")
    norm = self._norm("norm")
    ssm = functools.partial(run_layer, self.layer(name="ssm"), reset=reset, state=state,
                            single_step=single_step, return_state=return_state, mode=mode,
                            axis_name=axis_name, value_residual=value_residual)
    width = x.shape[-1]
    return residual(
        x, mask, ssm, norm=lambda u: norm(u, mask, train=train, axis_name=axis_name),
        dropout=nn.Dropout(self.dropout_rate, deterministic=not train),
        value=self._dense(width, "glu_value") if self.activation == "glu" else None,
        gate=self._dense(width, "glu_gate") if self.activation != "gelu" else None,
        prenorm=self.prenorm)


class MixerBlock(_Block):
  """The pre-norm transformer block: h = x + mixer(norm(x)), then h + mlp(norm(h)).

  Inputs `(..., T, H)` give outputs `(..., T, H)`. The mixer is any sequence layer, recurrent
  or attention. Without an MLP (`mlp="none"`) this is the block of Mamba and Mamba-2 language
  models; with one, of Griffin / RecurrentGemma ("geglu"), Jamba and Qwen3-Next ("swiglu").
  `mask` marks real steps: the mixer sees zeros at padded steps.

  Attributes:
    layer: factory of the mixer, e.g. `functools.partial(ssmkit.layers.Attention, window=64)`.
    norm: "rms", "rms_plus_one", "layer" or "batch", before the mixer and before the MLP.
    mlp: "none", "gelu" (down(gelu(up x))), "geglu" (down(gelu(gate x) * up x)), "swiglu"
      (down(silu(gate x) * up x)), or "experts", a mixture of SwiGLU experts (`experts`);
      GELU is its tanh approximation.
    mlp_expansion: the MLP's hidden width over the block's width (not of "experts").
    experts: the mixture of experts of `mlp="experts"` (`ssmkit.layers.Experts`), a
      `MixtureOfExperts` named "mlp_experts".
    residual_scale: the factor on the mixer's and the MLP's outputs before they join the
      residual stream (Granite's `residual_multiplier`).
    mlp_scales: (a, b): the dense MLP's activation input times a and its output times b
      (Falcon-H1's `mlp_multipliers`).
    norm_position: "input": each norm before its branch (pre-norm); "output": after it, on
      the branch's output before the residual (OLMo 2's and OLMo 3's attention blocks).
    mlp_bias: biases in the MLP's projections.
    dropout_rate: dropout on the mixer's and the MLP's outputs, when `train`.

  References:
    Gu and Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023.
    De et al., "Griffin: Mixing Gated Linear Recurrences with Local Attention for Efficient
    Language Models", 2024.
  """

  norm: str = "rms"
  mlp: str = "none"
  mlp_expansion: float = 4.0
  mlp_bias: bool = False
  experts: Experts | None = None
  residual_scale: float = 1.0
  mlp_scales: tuple[float, float] = (1.0, 1.0)
  norm_position: str = "input"
  dropout_rate: float = 0.0

  @nn.compact
  def forward(self, x: Array, mask: Array | None, reset: Array | None, state: Any, *, single_step: bool,
              return_state: bool, mode: str | Mode, train: bool, axis_name: Hashable | None = None,
              value_residual: ValueResidual | None = None) -> tuple[tuple[Any, Any], Array]:
    """The block on checked inputs, carry first, as a model stacks it: `((state,
    value_residual), y)` (arguments as `SSMBlock.forward`'s)."""
    check_experts(self.mlp, self.experts)
    check_mlp_scales(self.mlp_scales)
    norm = self._norm("norm")
    mixer = functools.partial(run_layer, self.layer(name="mixer"), reset=reset, state=state,
                              single_step=single_step, return_state=return_state, mode=mode,
                              axis_name=axis_name, value_residual=value_residual)
    mlp = mlp_norm = None
    if self.mlp != "none":
      mlp_norm = functools.partial(self._norm("mlp_norm"), mask=mask, train=train,
                                   axis_name=axis_name)
    if self.mlp == "experts":
      mlp = functools.partial(
          MixtureOfExperts(self.experts, dtype=self.dtype, param_dtype=self.param_dtype,
                           name="mlp_experts"), axis_name=axis_name)
    elif self.mlp != "none":
      dense = functools.partial(self._dense, use_bias=self.mlp_bias)
      hidden = mlp_width(x.shape[-1], self.mlp_expansion)
      mlp = functools.partial(
          feed_forward, kind=self.mlp, up=dense(hidden, "mlp_up"),
          gate=dense(hidden, "mlp_gate") if self.mlp != "gelu" else None,
          down=dense(x.shape[-1], "mlp_down"), scales=self.mlp_scales)
    return mixer_residual(x, mask, mixer,
                          norm=lambda u: norm(u, mask, train=train, axis_name=axis_name),
                          dropout=nn.Dropout(self.dropout_rate, deterministic=not train),
                          mlp_norm=mlp_norm, mlp=mlp, scale=self.residual_scale,
                          norm_position=self.norm_position)


def check_experts(mlp: str, experts: Experts | None) -> None:
  """Checks a mixer block's `mlp` kind and its `experts`, naming what does not fit."""
  common.check_choice(mlp, MLPS, "mlp")
  if (mlp == "experts") != (experts is not None):
    raise ValueError(f"`experts` is the mixture of `mlp='experts'`: give both or neither, got "
                     f"mlp={mlp!r} and experts={experts!r}.")
  if experts is not None and not isinstance(experts, Experts):
    raise ValueError(f"`experts` must be an ssmkit.layers.Experts, got {type(experts).__name__}.")


def check_mask(mask: Array | None, x: Array) -> Array | None:
  """Checks `mask` against `(..., T, H)` inputs `x` and returns it as `(..., T)` booleans.

  The mask has the batch and time axes of `x` (`x.shape[:-1]`); batch axes of size 1
  broadcast, so `(1, T)` marks the same steps of every sequence.
  """
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  shape = x.shape[:-1]
  fits = mask.ndim == len(shape) and mask.shape[-1:] == shape[-1:] and all(
      m in (1, n) for m, n in zip(mask.shape, shape, strict=True))
  if mask.dtype != jnp.bool_ or not fits:
    raise ValueError(
        f"`mask` must be booleans of shape {shape} (`x` without its feature axis; batch axes "
        f"of size 1 broadcast), got {mask.dtype} {mask.shape}."
    )
  return jnp.broadcast_to(mask, shape)
