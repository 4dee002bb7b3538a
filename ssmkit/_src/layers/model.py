"""Stacked sequence models: encoder, blocks of a layer pattern, pooling and decoder; generation."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ssmkit._src.engine import axis_position
from ssmkit._src.layers import common
from ssmkit._src.layers.attention import Attention
from ssmkit._src.layers.block import (
  NORM_POSITIONS,
  MixerBlock,
  ModuleDef,
  Norm,
  SSMBlock,
  check_experts,
  check_mask,
  check_mlp_scales,
)
from ssmkit._src.layers.experts import AUX_LOSS, Experts
from ssmkit._src.layers.functional import LinenLayer, ValueResidual, shares_values
from ssmkit._src.layers.lru import LRU
from ssmkit._src.modes import Mode

Array = jax.Array

POOLINGS = ("mean", "last", "none")


BLOCKS = ("ssm", "mixer")
# The options each kind of block takes from its model, by the same names on both front ends'
# models and blocks.
BLOCK_OPTIONS = {
    "ssm": ("norm", "norm_eps", "activation", "dropout_rate", "prenorm", "dtype", "param_dtype"),
    "mixer": ("norm", "norm_eps", "mlp", "mlp_expansion", "mlp_bias", "experts", "residual_scale",
              "mlp_scales", "dropout_rate", "dtype", "param_dtype"),
}


def block_options(model: Any, index: int) -> dict[str, Any]:
  """The options of block `index` of a `SequenceModel` of either front end: the model's, and
  its `norm_position` at that place of the layer pattern."""
  options = {name: getattr(model, name) for name in BLOCK_OPTIONS[model.block]}
  if model.block == "mixer":
    options["norm_position"] = norm_positions(model)[pattern_place(model, index)]
  return options


def norm_positions(model: Any) -> tuple[str, ...]:
  """The `norm_position` of each place of a model's layer pattern, checked.

  Raises:
    ValueError: naming `norm_position` when it is not a position or one per pattern place.
  """
  positions, length = model.norm_position, len(layer_pattern(model.layer))
  positions = (positions,) * length if isinstance(positions, str) else tuple(positions)
  if len(positions) != length or not set(positions) <= set(NORM_POSITIONS):
    raise ValueError(f"`norm_position` must be one of {NORM_POSITIONS} or a sequence of them, "
                     f"one per layer of the pattern ({length}), got {model.norm_position!r}.")
  return positions


def scale_embeddings(model: Any, x: Array) -> Array:
  """Token embeddings `x` of a `SequenceModel` of either front end times its `scale_embeddings`
  (sqrt(`features`) for True; unchanged for False)."""
  scale = model.scale_embeddings
  if scale is False:
    return x
  return x * jnp.asarray(math.sqrt(model.features) if scale is True else scale, x.dtype)


def layer_pattern(layer: Any) -> tuple[Callable[..., Any], ...]:
  """The layer factories a model cycles over its blocks: `(layer,)` for one factory.

  Raises:
    ValueError: naming `layer` when it is neither a factory nor a non-empty sequence of them.
  """
  if callable(layer):
    return (layer,)
  if isinstance(layer, list | tuple) and layer and all(callable(make) for make in layer):
    return tuple(layer)
  raise ValueError("`layer` must be a layer factory or a non-empty sequence of them (a pattern "
                   f"cycled over the blocks), got {layer!r}.")


def place_in_pattern(index: int, length: int, head: int) -> int:
  """The place in a layer pattern of `length` whose first `head` places are the first blocks'
  alone that block `index` takes: its own among them, then the places after them cycled."""
  return index if index < head else head + (index - head) % (length - head)


def pattern_place(model: Any, index: int) -> int:
  """The place in the layer pattern of a `SequenceModel` (of either front end) that block
  `index` takes (`place_in_pattern` of its `head_blocks`)."""
  return place_in_pattern(index, len(layer_pattern(model.layer)), model.head_blocks)


def block_layer(model: Any, index: int) -> Callable[..., Any]:
  """The layer factory of block `index` of a `SequenceModel` of either front end: its place's in
  the pattern (`pattern_place`). A layer whose starting parameters depend on its depth (RWKV7's
  `layer_index` of `num_layers`, as flash-linear-attention's model numbers its layers) is placed
  at block `index` of `num_blocks`, where its factory leaves those out.
  """
  pattern = layer_pattern(model.layer)
  make = pattern[pattern_place(model, index)]
  cls = getattr(make, "func", make)
  fields = getattr(getattr(cls, "linen", cls), "__dataclass_fields__", {})
  given = getattr(make, "keywords", {})
  depth = {name: value for name, value in (("layer_index", index), ("num_layers", model.num_blocks))
           if name in fields and name not in given and index < model.num_blocks}
  return functools.partial(make, **depth) if depth else make


@functools.partial(jax.jit, static_argnums=(0, 1))
def _compiled_init(model: nn.Module, static: tuple[tuple[str, Any], ...], rngs: Any,
                   args: tuple[Any, ...], arrays: dict[str, Any]) -> Any:
  variables = nn.Module.init(model, rngs, *args, **dict(static), **arrays)
  return {name: value for name, value in variables.items() if name != AUX_LOSS}


def check_model(model: Any) -> None:
  """Checks the options of a `SequenceModel` of either front end against each other.

  Raises:
    ValueError: naming the option that does not fit.
  """
  common.check_choice(model.pooling, POOLINGS, "pooling")
  common.check_choice(model.block, BLOCKS, "block")
  check_experts(model.mlp, model.experts)
  common.check_positive_int(model.num_blocks, "num_blocks")
  if model.block == "ssm" and model.mlp != "none":
    raise ValueError(f"`mlp` needs block='mixer' (an SSMBlock has its `activation`), got "
                     f"mlp={model.mlp!r} with block='ssm'.")
  if model.block == "mixer" and not model.prenorm:
    raise ValueError("block='mixer' is a pre-norm block: `prenorm` must be True.")
  if model.tie_embeddings and (model.vocab_size is None or model.num_outputs != model.vocab_size):
    raise ValueError("`tie_embeddings` needs token inputs with `num_outputs` equal to `vocab_size`, "
                     f"got vocab_size={model.vocab_size!r}, num_outputs={model.num_outputs!r}.")
  scale = model.scale_embeddings
  if not isinstance(scale, bool) and not (isinstance(scale, int | float) and scale > 0):
    raise ValueError(f"`scale_embeddings` must be True, False or a number > 0, got {scale!r}.")
  if model.scale_embeddings and model.vocab_size is None:
    raise ValueError("`scale_embeddings` scales token embeddings: it needs `vocab_size`.")
  if model.logit_cap is not None and not model.logit_cap > 0:
    raise ValueError(f"`logit_cap` must be > 0 or None, got {model.logit_cap!r}.")
  for name in ("logits_scaling", "residual_scale"):
    if not getattr(model, name) > 0:
      raise ValueError(f"`{name}` must be > 0, got {getattr(model, name)!r}.")
  check_mlp_scales(model.mlp_scales)
  changed = {"residual_scale": model.residual_scale != 1.0,
             "mlp_scales": tuple(model.mlp_scales) != (1.0, 1.0),
             "norm_position": set(norm_positions(model)) != {"input"}}
  for name in (name for name, given in changed.items() if given):
    if model.block != "mixer":
      raise ValueError(f"`{name}` is an option of mixer blocks: it needs block='mixer', "
                       f"got block={model.block!r}.")
  if model.norm_eps is not None and not model.norm_eps > 0:
    raise ValueError(f"`norm_eps` must be > 0 or None, got {model.norm_eps!r}.")
  common.check_float_dtype(model.dtype, "dtype")
  common.check_float_dtype(model.param_dtype, "param_dtype", optional=False)
  length = len(layer_pattern(model.layer))
  head = model.head_blocks
  if isinstance(head, bool) or not (isinstance(head, int) and 0 <= head < length):
    raise ValueError(f"`head_blocks` must be an int from 0 to the length of the layer pattern "
                     f"less one ({length - 1}), got {model.head_blocks!r}.")
  if model.scan_blocks and model.num_blocks < length:
    raise ValueError(f"`scan_blocks` needs `num_blocks` >= the length of the layer pattern, got "
                     f"num_blocks={model.num_blocks} for a pattern of {length}.")


def scanned_counts(model: Any) -> tuple[int, int]:
  """`(repeats, rest)` of a model with `scan_blocks`: how many whole patterns (after the
  `head_blocks`, of the places after them) the blocks hold, and how many blocks of one more,
  partial, repeat follow them (the "tail")."""
  return divmod(model.num_blocks - model.head_blocks,
                len(layer_pattern(model.layer)) - model.head_blocks)


def scanned_place(model: Any, index: int) -> tuple[str, str, int]:
  """Where block `index` of a model with `scan_blocks` keeps its variables: the scan's name
  ("head" for the `head_blocks`, "blocks" for the repeats, "tail" for the partial last
  repeat), the block's name in it, and its position on the stacked leading axis."""
  if callable(model.layer):
    return "blocks", "block", index
  head = model.head_blocks
  if index < head:
    return "head", f"block_{index}", 0
  size = len(layer_pattern(model.layer)) - head
  repeats, _ = scanned_counts(model)
  repeat, place = divmod(index - head, size)
  return ("blocks", f"block_{place}", repeat) if repeat < repeats else ("tail", f"block_{place}", 0)


def with_scanned_blocks(model: Any) -> Any:
  """A linen `SequenceModel` with its blocks under `nn.scan` and its layer pattern, with the
  blocks' norm positions, cut to the fewest blocks to compile: a head of distinct first blocks
  (`head_blocks`), then the shortest period of the blocks after them, and the tail that period
  leaves (fewer head blocks where two cuts compile as many). A model given one factory per
  block (as `ssmkit.pretrained.load` builds them) compiles those, not every block."""
  if callable(model.layer):
    return model.clone(scan_blocks=True)
  unrolled = with_unrolled_blocks(model)
  places = list(zip(unrolled.layer, norm_positions(unrolled), strict=True))
  cuts = []  # (blocks compiled, head, period)
  for head in range(len(places)):
    rest = places[head:]
    period = next(p for p in range(1, len(rest) + 1)
                  if all(place == rest[i % p] for i, place in enumerate(rest)))
    cuts.append((head + period + len(rest) % period, head, period))
  _, head, period = min(cuts)
  layer, positions = zip(*places[:head + period], strict=True)
  norm_position = model.norm_position if isinstance(model.norm_position, str) else positions
  return model.clone(layer=layer, norm_position=norm_position, head_blocks=head,
                     scan_blocks=True)


def with_unrolled_blocks(model: Any) -> Any:
  """A linen `SequenceModel` with its blocks unrolled and one place of its layer pattern per
  block (the inverse of `with_scanned_blocks`, as `ssmkit.pretrained` reads a model's layers)."""
  if callable(model.layer):
    return model.clone(scan_blocks=False)
  pattern, positions = layer_pattern(model.layer), norm_positions(model)
  places = [pattern_place(model, i) for i in range(model.num_blocks)]
  norm_position = (model.norm_position if isinstance(model.norm_position, str)
                   else tuple(positions[p] for p in places))
  return model.clone(layer=tuple(pattern[p] for p in places), norm_position=norm_position,
                     head_blocks=0, scan_blocks=False)


def output_logits(model: Any, logits: Array) -> Array:
  """The decoder's outputs of a `SequenceModel` of either front end divided by its
  `logits_scaling`, then soft-capped to `cap * tanh(logits / cap)` by its `logit_cap`."""
  if model.logits_scaling != 1.0:
    logits = logits / model.logits_scaling
  cap = model.logit_cap
  return logits if cap is None else cap * jnp.tanh(logits / cap)


def stacked_state(states: tuple[Any, ...], count: int) -> Any:
  """Each block state of `states` stacked `count` times on a new leading axis, as a scan holds it."""
  return tuple(jax.tree.map(lambda s: jnp.stack([s] * count), state) for state in states)


class _ScannedBlocks(nn.Module):
  """One repeat of the layer pattern, carry first, as `nn.scan` applies it across repeats.

  With one layer (not a pattern) the block is named "block" and its state is not a tuple.
  """

  blocks: tuple[ModuleDef, ...]
  pattern: bool
  single_step: bool
  return_state: bool
  mode: str | Mode = "auto"
  train: bool = False
  axis_name: Hashable | None = None

  @nn.compact
  def __call__(self, carry: tuple[Array, ValueResidual | None], state: Any, mask: Array | None,
               reset: Array | None) -> tuple[tuple[Array, ValueResidual | None], Any]:
    x, shared = carry
    flags = dict(single_step=self.single_step, return_state=self.return_state, mode=self.mode,
                 train=self.train, axis_name=self.axis_name)
    if not self.pattern:
      (state, shared), x = self.blocks[0](name="block").forward(x, mask, reset, state,
                                                                value_residual=shared, **flags)
      return (x, shared), state
    states = []
    for j, make in enumerate(self.blocks):
      (block_state, shared), x = make(name=f"block_{j}").forward(
          x, mask, reset, None if state is None else state[j], value_residual=shared, **flags)
      states.append(block_state)
    return (x, shared), tuple(states)


class SequenceModel(nn.Module):
  """Encoder, `num_blocks` residual blocks, final norm, pooling and a linear decoder.

  Real inputs `(..., T, F)` are encoded by a Dense layer, token inputs `(..., T)` (int) by an
  embedding when `vocab_size` is set. With pooling "mean" or "last" the model classifies whole
  sequences, `(..., num_outputs)`; with "none" it returns per-step outputs `(..., T, num_outputs)`,
  causal when the layers are, and `step` runs it one step at a time (see `generate`).

  `layer` is one layer factory, or a pattern of them cycled over the blocks: Griffin's
  `[rglru, rglru, local_attention]` puts attention in every third block (26 blocks: 8 whole
  patterns and two recurrent blocks). The state (`initialize_state`, `return_state`, `step`)
  holds every block's: recurrent states and attention caches in one pytree. Layers that share
  values (RWKV7's value residual) receive the first such layer's values through the blocks
  between them, scanned or not.

  Attributes:
    num_outputs: classes, or the output vocabulary of a language model.
    layer: factory of the sequence layer, e.g. `functools.partial(ssmkit.layers.S5, d_state=32)`,
      or a sequence of factories cycled over the blocks. A layer whose starting parameters
      depend on its depth (RWKV7's `layer_index` and `num_layers`) starts as block i of
      `num_blocks` unless its factory sets them; with `scan_blocks`, every repeat of the
      pattern starts as the first.
    features: model width H.
    num_blocks: number of residual blocks.
    vocab_size: input vocabulary for token inputs; None for real-valued inputs.
    pooling: "mean" or "last" over the real steps of `mask`, or "none".
    block: "ssm" (`SSMBlock`: norm, layer, activation or GLU, residual) or "mixer"
      (`MixerBlock`: pre-norm, layer, residual, then an optional pre-norm MLP and residual).
    norm: "layer", "batch", "rms" or "rms_plus_one" (RMSNorm scaled by 1 + w, w from 0:
      Gemma's, Qwen3-Next's), in the blocks and after them.
    norm_eps: the epsilon of every norm; None: flax's default (1e-6 for "layer" and "rms",
      1e-5 for "batch"). Published Mamba checkpoints use 1e-5.
    activation: "gelu", "glu" or "half_glu" (block "ssm", see `SSMBlock`).
    mlp: "none", "gelu", "geglu", "swiglu" or "experts" (block "mixer", see `MixerBlock`).
    mlp_expansion: the MLP's hidden width over `features` (block "mixer").
    mlp_bias: biases in the MLP's projections (block "mixer").
    experts: the mixture of experts of every block with `mlp="experts"`
      (`ssmkit.layers.Experts`).
    dropout_rate: dropout inside the blocks when `train`.
    prenorm: normalise block inputs (True) or residual sums (False; block "ssm" only); a
      pre-norm model normalises the last block's outputs.
    scan_blocks: apply the blocks with `nn.scan` over parameters stacked on a leading axis, so
      compile time does not grow with depth: one scan over the whole repeats of the layer
      pattern ("blocks", one stacked block per pattern position) and, when `num_blocks` is not
      a multiple of the pattern's length, one of length 1 over the blocks left ("tail").
    head_blocks: how many first places of the `layer` pattern are the first blocks' alone:
      block i < `head_blocks` takes place i, and the blocks after them cycle over the places
      after them (Kimi Linear's first layer, with a dense MLP where the others have experts).
      With `scan_blocks` they run first, as a scan of length 1 ("head"), and the repeats and
      the tail are of the places after them.
    tie_embeddings: decode with the transposed token embedding (needs `vocab_size` equal to
      `num_outputs`); no separate decoder.
    decoder_bias: a bias on the decoder (untied heads); published language models have none.
    scale_embeddings: multiply token embeddings by sqrt(`features`) (True: Gemma), or by this
      number (RecurrentGemma's checkpoints use sqrt(`features`) rounded to bfloat16).
    logit_cap: soft-cap the outputs to `logit_cap * tanh(y / logit_cap)`; None: no cap.
    logits_scaling: divide the decoder's outputs by this, before the cap (Granite's).
    residual_scale: the factor on each mixer block's branches before they join the residual
      stream (block "mixer"; Granite's `residual_multiplier`).
    mlp_scales: (a, b): each dense MLP's activation input times a, its output times b
      (block "mixer"; Falcon-H1's `mlp_multipliers`).
    norm_position: where a mixer block's norms sit: "input" (pre-norm) or "output" (on each
      branch's output, OLMo 2's), or one of these per layer of the pattern (OLMo Hybrid's
      attention blocks "output", its Gated DeltaNet blocks "input").
    dtype: the computation dtype of the model's activations, embeddings, norms and
      projections, e.g. `jnp.bfloat16` for mixed precision; None: that of the inputs and
      parameters. The layers take their inputs in it, multiply their projections in it
      (summed in float32) and keep their recurrences in float32.
    param_dtype: the dtype of the model's own parameters (encoder, norms, projections,
      decoder); the layers' parameters follow their own `param_dtype`.
  """

  num_outputs: int
  layer: ModuleDef | tuple[ModuleDef, ...] = LRU
  features: int = 64
  num_blocks: int = 2
  vocab_size: int | None = None
  pooling: str = "mean"
  block: str = "ssm"
  norm: str = "layer"
  norm_eps: float | None = None
  activation: str = "glu"
  mlp: str = "none"
  mlp_expansion: float = 4.0
  mlp_bias: bool = False
  experts: Experts | None = None
  dropout_rate: float = 0.0
  prenorm: bool = True
  scan_blocks: bool = False
  head_blocks: int = 0
  tie_embeddings: bool = False
  decoder_bias: bool = True
  scale_embeddings: bool | float = False
  logit_cap: float | None = None
  logits_scaling: float = 1.0
  residual_scale: float = 1.0
  mlp_scales: tuple[float, float] = (1.0, 1.0)
  norm_position: str | tuple[str, ...] = "input"
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self) -> None:
    # A list would make the module unhashable (`generate` hashes it).
    for name in ("layer", "norm_position"):
      if isinstance(getattr(self, name), list):
        object.__setattr__(self, name, tuple(getattr(self, name)))
    super().__post_init__()

  def _block(self, index: int) -> ModuleDef:
    """The factory of block `index` (`block_layer`)."""
    cls = SSMBlock if self.block == "ssm" else MixerBlock
    return functools.partial(cls, layer=block_layer(self, index), **block_options(self, index))

  def _blocks(self) -> tuple[ModuleDef, ...]:
    """One block factory per position of the layer pattern, as in its first repeat."""
    return tuple(self._block(j) for j in range(len(layer_pattern(self.layer))))

  def _scanned(self, blocks: tuple[ModuleDef, ...], length: int, name: str, **flags: Any) -> nn.Module:
    scan = nn.scan(
        _ScannedBlocks,
        variable_axes={"params": 0, "batch_stats": 0, AUX_LOSS: 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(0, nn.broadcast, nn.broadcast),
        length=length,
    )
    return scan(blocks, not callable(self.layer), **flags, name=name)

  def _run_blocks(self, x: Array, mask: Array | None, reset: Array | None, state: Any,
                  **flags: Any) -> tuple[Array, Any]:
    blocks = self._blocks()
    shared = start_value_residual(self, x)
    if not self.scan_blocks:
      states = []
      for i in range(self.num_blocks):
        block = self._block(i)(name=f"block_{i}")
        (block_state, shared), x = block.forward(x, mask, reset, None if state is None else state[i],
                                                 value_residual=shared, **flags)
        states.append(block_state)
      return x, tuple(states)
    if callable(self.layer):
      (x, _), state = self._scanned(blocks, self.num_blocks, "blocks", **flags)(
          (x, shared), state, mask, reset)
      return x, state
    repeats, rest = scanned_counts(self)
    head = self.head_blocks
    state = (None,) * (3 if head else 2) if state is None else state
    heads = ()
    if head:
      (x, shared), heads = self._scanned(blocks[:head], 1, "head", **flags)(
          (x, shared), state[0], mask, reset)
    period, state = blocks[head:], state[-2:]
    (x, shared), repeated = self._scanned(period, repeats, "blocks", **flags)(
        (x, shared), state[0], mask, reset)
    tail = ()
    if rest:
      (x, _), tail = self._scanned(period[:rest], 1, "tail", **flags)((x, shared), state[1], mask, reset)
    return x, ((heads,) if head else ()) + (repeated, tail)

  @nn.compact
  def _forward(self, x: Array, mask: Array | None, reset: Array | None, state: Any, *, single_step: bool,
               return_state: bool, mode: str | Mode, train: bool,
               axis_name: Hashable | None = None) -> tuple[Any, Array]:
    """The model on one step, or on a sequence (from `state` unless None), and the blocks' state."""
    check_model(self)
    precision = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    if self.vocab_size is None:
      encoder = nn.Dense(self.features, name="encoder", **precision)
    else:
      encoder = nn.Embed(self.vocab_size, self.features, name="encoder", **precision)
    if self.vocab_size is not None:
      x = tokens_in_vocabulary(x, self.vocab_size, "x_t" if single_step else "x")
    x = encoder(x)
    x = scale_embeddings(self, x)
    x, state = self._run_blocks(x, mask, reset, state, single_step=single_step,
                                return_state=return_state, mode=mode, train=train,
                                axis_name=axis_name)
    if self.prenorm:
      x = Norm(self.norm, eps=self.norm_eps, name="final_norm", **precision)(
          x, mask, train=train, axis_name=axis_name)
    if not single_step:
      x = pool(x, mask, self.pooling, axis_name)
    if self.tie_embeddings:
      y = encoder.attend(x)
    else:
      y = nn.Dense(self.num_outputs, use_bias=self.decoder_bias, name="decoder", **precision)(x)
    return state, output_logits(self, y)

  @nn.nowrap
  def init(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
    """`flax.linen.Module.init`, compiled as one program for the model, the input shapes and
    the keyword options (and cached: the same call again costs nothing).

    Run eagerly, each initializer and each operation of the forward pass compiled on its own:
    a 6-block Griffin (width 128) took 8.3 s to initialise eagerly against 4.2 s compiled, in a
    new process on CPU (`ssmkit bench layers` times it). The values are those of
    `jax.jit(model.init)`: flax's eager init could differ from them in the last bits, where XLA
    fuses an initializer's arithmetic. `method`, and a `mutable` or `capture_intermediates`
    other than a bool, take flax's eager path. The load-balancing losses that mixtures of
    experts sow while initialising ("aux_loss") are left out of the variables, so that `apply`
    with `mutable=["aux_loss"]` returns the call's own.
    """
    static = {k: v for k, v in kwargs.items() if isinstance(v, str | bool | int | float)}
    arrays = {k: v for k, v in kwargs.items() if k not in static}
    if method is not None or any(k in arrays for k in ("mutable", "capture_intermediates")):
      return super().init(rngs, *args, method=method, **kwargs)
    return _compiled_init(self, tuple(sorted(static.items())), rngs, args, arrays)

  def __call__(self, x: Array, mask: Array | None = None, reset: Array | None = None, *,
               initial_state: Any = None, return_state: bool = False, mode: str | Mode = "auto",
               train: bool = False, axis_name: Hashable | None = None) -> Array | tuple[Array, Any]:
    """Runs the model over whole sequences.

    Args:
      x: `(..., T, F)` real inputs, or `(..., T)` integer tokens when `vocab_size` is set:
        ids outside [0, vocab_size) are refused where known (outside `jit`), and under `jit`
        embed as NaN (`tokens_in_vocabulary`), never as another token.
      mask: optional `(..., T)` booleans, True on real steps (batch axes of size 1
        broadcast). Padding may come after the real steps or before them: pooling reads
        only real steps, and the layers see zeros at padded steps, which leave the state
        of LRU, S4D and S5 at zero, so left padding changes nothing there either. Mamba's
        convolution bias moves its state during padding: pass `reset` True at the first
        real step to start it there.
      reset: optional `(..., T)` booleans; True clears every block's state before that step
        (attention then reads no key before it).
      initial_state: optional state to start from, as `initialize_state` or `step` makes it
        (e.g. the state at the start of a rollout); default zeros.
      return_state: also return the state after the last step (padding included), from which
        `step` or another call continues.
      mode: scan mode of the layers.
      train: dropout on and BatchNorm on batch statistics (needs a "dropout" rng when
        `dropout_rate` > 0 and a mutable "batch_stats" collection with BatchNorm).
      axis_name: sequence parallelism. Inside `jax.shard_map` with the time axis of `x`,
        `mask` and `reset` split over the mesh axis of this name (consecutive slices of equal
        length in mesh order) and the parameters replicated, every block runs across the
        devices (see the layers' `axis_name`), and each device returns its slice of the
        per-step outputs, or the pooled outputs of the whole sequence, the same on every
        device. `initial_state` is read where the layers read it; the returned state is the
        whole sequence's. BatchNorm's batch statistics (`train` with norm "batch") are refused.

    Returns:
      `(..., num_outputs)` with pooling, else `(..., T, num_outputs)`; with `return_state`,
      `(outputs, state)`.
    """
    x, mask, reset = check_inputs(self, x, mask, reset)
    state, y = self._forward(x, mask, reset, initial_state, single_step=False,
                             return_state=return_state, mode=mode, train=train, axis_name=axis_name)
    return (y, state) if return_state else y

  def initialize_state(self, input_shape: tuple[int, ...]) -> Any:
    """The zero state of every block for one step of input: `(*batch, F)`, or `(*batch,)` tokens.

    A tuple of the blocks' states; with `scan_blocks`, one layer's state stacked over the blocks,
    or for a pattern `(repeats, tail)`: per pattern position, the states of its blocks in the
    whole repeats stacked, and those of the tail (stacked on an axis of size 1); with
    `head_blocks`, `(head, repeats, tail)`, the head's states stacked on an axis of size 1.
    """
    check_model(self)
    batch = tuple(input_shape) if self.vocab_size is not None else tuple(input_shape)[:-1]
    states = tuple(make(parent=None).initialize_state((*batch, self.features))
                   for make in self._blocks())
    return pattern_state(self, states)

  def step(self, state: Any, x_t: Array, reset: Array | None = None) -> tuple[Any, Array]:
    """Advances one step at inference; needs pooling "none". Call it compiled:
    `step = jax.jit(functools.partial(model.apply, method="step"))`, then
    `state, logits = step(variables, state, token)` (`generate` runs the whole loop compiled).

    Args:
      state: from `initialize_state` or a previous `step`.
      x_t: `(*batch, F)` input, or `(*batch,)` tokens when `vocab_size` is set (ids outside
        the vocabulary as for `__call__`).
      reset: optional `(*batch,)` booleans; True clears the state before this step.

    Returns:
      `(state, y_t)` with `y_t` of shape `(*batch, num_outputs)`.
    """
    x_t, reset = check_step_inputs(self, x_t, reset)
    check_step_state(self, state, x_t)
    return self._forward(x_t, None, reset, state, single_step=True, return_state=True, mode="auto",
                         train=False)


def pattern_state(model: Any, states: tuple[Any, ...]) -> Any:
  """A model's state from one block state per pattern position (see `initialize_state`)."""
  if not model.scan_blocks:
    return tuple(states[pattern_place(model, i)] for i in range(model.num_blocks))
  if callable(model.layer):
    return stacked_state(states, model.num_blocks)[0]
  repeats, rest = scanned_counts(model)
  head, period = model.head_blocks, states[model.head_blocks:]
  scanned = stacked_state(period, repeats), stacked_state(period[:rest], 1)
  return (stacked_state(states[:head], 1), *scanned) if head else scanned


def _check_tokens(model: Any, x: Array, batch_rank: int, what: str) -> Array:
  x = jnp.asarray(x)
  if model.vocab_size is None:
    return x
  if not jnp.issubdtype(x.dtype, jnp.integer) or x.ndim < batch_rank:
    raise ValueError(
        f"`{what}` must be integer tokens with `vocab_size` set, got {x.dtype} {x.shape}.")
  return x


def check_inputs(model: Any, x: Array, mask: Array | None, reset: Array | None
                 ) -> tuple[Array, Array | None, Array | None]:
  """Checks the whole-sequence inputs of a `SequenceModel` of either front end.

  Args:
    model: a linen or NNX `SequenceModel` (its `vocab_size` is read).
    x: `(..., T, F)` real inputs, or `(..., T)` integer tokens when `vocab_size` is set.
    mask: optional `(..., T)` booleans (batch axes of size 1 broadcast).
    reset: optional `(..., T)` booleans.

  Returns:
    `(x, mask, reset)` as arrays, `mask` broadcast to `(..., T)`.
  """
  x = _check_tokens(model, x, 1, "x")
  steps = x.shape if model.vocab_size is not None else x.shape[:-1]
  if model.vocab_size is None:
    x, reset = common.check_sequence(x, reset)
  elif reset is not None:
    common.check_sequence(jnp.zeros((*steps, 1)), reset)
  return x, check_mask(mask, jnp.zeros((*steps, 1), bool)), reset


def check_step_inputs(model: Any, x_t: Array, reset: Array | None) -> tuple[Array, Array | None]:
  """Checks one step's inputs of a `SequenceModel` of either front end, and its pooling "none".

  Args:
    model: a linen or NNX `SequenceModel` (its `vocab_size` and `pooling` are read).
    x_t: `(*batch, F)` input, or `(*batch,)` tokens when `vocab_size` is set.
    reset: optional `(*batch,)` booleans.

  Returns:
    `(x_t, reset)` as arrays.
  """
  if model.pooling != "none":
    raise ValueError(f"`step` needs pooling='none', got pooling={model.pooling!r}.")
  x_t = _check_tokens(model, x_t, 0, "x_t")
  if model.vocab_size is None:
    x_t, reset = common.check_step(x_t, reset)
  elif reset is not None:
    common.check_step(jnp.zeros((*x_t.shape, 1)), reset)
  return x_t, reset


def check_step_state(model: Any, state: Any, x_t: Array) -> None:
  """Checks that `state` is a state of `model` for one step of inputs shaped as `x_t`.

  Raises:
    ValueError: naming `x_t` and the shape a step takes when its batch shape is not the
      state's (a `(B, 1)` token for a state of `(B,)`), else naming `state`.
  """
  expected = jax.eval_shape(lambda: model.initialize_state(x_t.shape))
  shapes = lambda tree: [np.shape(leaf) for leaf in jax.tree.leaves(tree)]
  if jax.tree.structure(state) != jax.tree.structure(expected):
    raise ValueError("`state` is not a state of this model: make it with `initialize_state` or a "
                     "previous `step`.")
  if shapes(state) == shapes(expected):
    return
  one = "(*batch,) tokens" if model.vocab_size is not None else "(*batch, F) inputs"
  raise ValueError(f"`x_t` of shape {x_t.shape} does not fit `state`: a step takes {one} with "
                   "the batch that `initialize_state` was given (of a sequence `x`, `x[..., t]`"
                   f"{'' if model.vocab_size is not None else ', :'}), and `state` was made for "
                   "another batch.")


def pool(x: Array, mask: Array | None, pooling: str, axis_name: Hashable | None = None) -> Array:
  """Pools `(..., T, H)` over the real steps of `mask` (`(..., T)`, padding anywhere), of the
  whole sequence when its time axis is split over the mesh axis `axis_name`.

  A sequence without real steps pools to zeros.
  """
  if pooling == "none":
    return x
  if mask is None and axis_name is None:
    return jnp.mean(x, axis=-2) if pooling == "mean" else x[..., -1, :]
  if mask is None:
    mask = jnp.ones(x.shape[:-1], bool)
  total = (lambda v: v) if axis_name is None else (lambda v: jax.lax.psum(v, axis_name))
  if pooling == "mean":
    count = jnp.maximum(total(jnp.sum(mask, axis=-1, keepdims=True)), 1).astype(x.dtype)
    return total(jnp.sum(jnp.where(mask[..., None], x, jnp.zeros_like(x)), axis=-2)) / count
  last = mask.shape[-1] - 1 - jnp.argmax(jnp.flip(mask, axis=-1), axis=-1)
  pooled = jnp.take_along_axis(x, last[..., None, None], axis=-2)[..., 0, :]
  seen = jnp.any(mask, axis=-1)
  if axis_name is not None:  # the last device with a real step holds the sequence's last
    index, _ = axis_position(axis_name)
    latest = jax.lax.pmax(jnp.where(seen, index, -1), axis_name)
    seen = latest >= 0
    pooled = total(jnp.where((index == latest)[..., None], pooled, jnp.zeros_like(pooled)))
  return jnp.where(seen[..., None], pooled, jnp.zeros_like(pooled))


def _filter_logits(logits: Array, top_k: int | None = None, top_p: Array | float | None = None
                  ) -> Array:
  """`logits` with -inf outside the `top_k` largest and outside the nucleus of mass `top_p`.

  top-k keeps the logits at least as large as the k-th largest; top-p (nucleus) then keeps
  the most probable tokens whose probabilities, in decreasing order, first sum to `top_p`
  or more (the most probable token always stays). Ties at a threshold are all kept.

  Args:
    logits: `(..., V)` logits over the last axis.
    top_k: keep this many (a Python int in [1, V]), or None for all.
    top_p: nucleus mass in (0, 1], possibly traced, or None for all.

  Returns:
    Logits of `logits`' shape and dtype.
  """
  neg_inf = jnp.full_like(logits, -jnp.inf)
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, neg_inf, logits)
  if top_p is not None:
    ordered = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens more likely than each
    kept = jnp.sum(before < top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    logits = jnp.where(logits < threshold, neg_inf, logits)
  return logits


def _pattern_layers(model: Any) -> list[LinenLayer]:
  """The linen layers of a model's pattern (of either front end), one per position, built
  without parameters; factories other than ssmkit's layer classes or partials of them are
  skipped."""
  layers = []
  for make in layer_pattern(model.layer):
    cls = getattr(make, "func", make)
    cls = getattr(cls, "linen", cls)  # an NNX front end's linen layer
    if isinstance(cls, type) and issubclass(cls, LinenLayer):
      layers.append(cls(**getattr(make, "keywords", {}), parent=None))
  return layers


def _global_attention_cache(model: Any) -> int | None:
  """The smallest `cache_size` of the global (window None) attention layers of a model of either
  front end, None without one."""
  return min((layer.cache_size for layer in _pattern_layers(model)
              if isinstance(layer, Attention) and layer.window is None), default=None)


def start_value_residual(model: Any, x: Array) -> ValueResidual | None:
  """The value residual a model of either front end threads through its blocks, for block
  inputs `x` `(..., T, H)` or `(*batch, H)`; None when no layer of its pattern shares values.

  Raises:
    ValueError: naming `layer` when its sharing layers share different numbers of channels.
  """
  widths = {layer.maths.value_width(layer, model.features) for layer in _pattern_layers(model)
            if shares_values(layer)}
  if len(widths) > 1:
    raise ValueError(f"`layer`: the layers that share values (RWKV7) must share as many channels "
                     f"(`value_dim`), got {sorted(widths)}.")
  return ValueResidual.start(x, widths.pop()) if widths else None


def _is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def tokens_in_vocabulary(x: Array, vocab_size: int, name: str) -> Array:
  """Token ids `x` for an embedding of `vocab_size` rows.

  Ids known at trace time must lie in [0, `vocab_size`), else a ValueError names `name` and the
  vocabulary. Traced ids outside it (under `jit`) become `vocab_size`, which the embedding reads
  as a row of NaN: that step's logits, and the later steps its state reaches (up to a reset),
  are NaN, never those of another token (as a negative id wrapped around would give).
  """
  if _is_concrete(x):
    if x.size:
      tokens = np.asarray(x)  # in NumPy: inside a jit, jnp.min would be staged
      low, high = int(tokens.min()), int(tokens.max())
      if low < 0 or high >= vocab_size:
        raise ValueError(f"`{name}` tokens must lie in [0, {vocab_size}) (`vocab_size`), got "
                         f"tokens in [{low}, {high}].")
    return x
  return jnp.where((x >= 0) & (x < vocab_size), x, vocab_size)


def generate(model: SequenceModel, variables: Any, prompt: Array, num_steps: int, *,
             rng: Array | None = None, temperature: float | Array = 1.0, top_k: int | None = None,
             top_p: float | Array | None = None, eos_token: int | Array | None = None) -> Array:
  """Continues token sequences with a causal `SequenceModel`.

  The prompt runs as one sequence (in any scan mode's parallel form), then the model continues
  one step at a time from its last state: each next token is drawn from
  softmax(logits / temperature) restricted to the `top_k` most likely tokens (ties at the
  k-th kept) and then to the nucleus of mass `top_p` (the most likely tokens whose
  probabilities first sum to `top_p` or more), or taken greedily when `temperature` is 0.
  The whole continuation is one jitted program, compiled once per model, shapes and
  `top_k`: later calls with other prompts, variables, keys, temperatures, `top_p` or
  `eos_token` of the same shapes reuse it.

  Args:
    model: a `SequenceModel` with `vocab_size` set and pooling "none".
    variables: its variables (`{"params": ...}`, plus "batch_stats" with BatchNorm).
    prompt: `(*batch, P)` int tokens, P >= 1.
    num_steps: number of tokens to generate (a Python int).
    rng: PRNG key for sampling; needed unless `temperature` is 0.
    temperature: softmax temperature >= 0, a number or a traced scalar; 0 for greedy
      decoding (then `top_k` and `top_p` change nothing).
    top_k: sample among the `top_k` most likely tokens (a Python int); 1 is greedy.
    top_p: sample within the nucleus of probability mass `top_p` in (0, 1].
    eos_token: the end token: a sequence that has generated it continues with it, so each
      sequence stops at its own end.

  Returns:
    `(*batch, num_steps)` int32 generated tokens.
  """
  arguments = generation_arguments(model, prompt, num_steps, rng=rng, temperature=temperature,
                                   top_k=top_k, top_p=top_p, eos_token=eos_token)
  return _generate(model, variables, **arguments)


def generation_arguments(model: Any, prompt: Array, num_steps: int, *, rng: Array | None,
                         temperature: float | Array, top_k: int | None,
                         top_p: float | Array | None, eos_token: int | Array | None
                         ) -> dict[str, Any]:
  """Checks the arguments of `generate` (either front end's) and returns them as `sample` takes them.

  Raises:
    ValueError: naming the argument that does not fit `model` (read: `vocab_size`, `pooling`,
      `num_outputs`).
  """
  if model.vocab_size is None or model.pooling != "none":
    raise ValueError("`model` must have `vocab_size` set and pooling='none' to generate tokens.")
  prompt = jnp.asarray(prompt)
  if not jnp.issubdtype(prompt.dtype, jnp.integer) or prompt.ndim < 1 or prompt.shape[-1] < 1:
    raise ValueError(f"`prompt` must be integer tokens `(*batch, P)` with P >= 1, got {prompt.dtype} "
                     f"{prompt.shape}.")
  prompt = tokens_in_vocabulary(prompt, model.vocab_size, "prompt")
  if not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
    raise ValueError(f"`num_steps` must be a non-negative int, got {num_steps!r}.")
  cache = _global_attention_cache(model)
  if cache is not None and prompt.shape[-1] + num_steps - 1 > cache:
    raise ValueError(
        f"`prompt` ({prompt.shape[-1]} tokens) and `num_steps` ({num_steps}) reach past the "
        f"key/value cache of the model's global attention ({cache} entries: `cache_size`), which "
        "would drop its oldest keys; build the attention with a larger `cache_size`.")
  greedy = _is_concrete(temperature) and np.all(np.asarray(temperature) == 0)
  if _is_concrete(temperature) and np.any(np.asarray(temperature) < 0):
    raise ValueError(f"`temperature` must be >= 0, got {temperature}.")
  if rng is None and not greedy:
    raise ValueError("`rng` is needed to sample unless `temperature` is 0.")
  if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                            or not 1 <= top_k <= model.num_outputs):
    raise ValueError(f"`top_k` must be an int in [1, {model.num_outputs}] or None, got {top_k!r}.")
  if top_p is not None and _is_concrete(top_p) and not 0 < float(top_p) <= 1:
    raise ValueError(f"`top_p` must lie in (0, 1], got {top_p}.")
  if eos_token is not None and _is_concrete(eos_token) and not 0 <= int(eos_token) < model.num_outputs:
    raise ValueError(f"`eos_token` must be a token in [0, {model.num_outputs}), got {eos_token}.")
  return dict(prompt=prompt, num_steps=int(num_steps),
              rng=jax.random.key(0) if rng is None else rng,
              temperature=jnp.asarray(temperature, jnp.float32),
              top_k=None if top_k is None else int(top_k), top_p=top_p, eos_token=eos_token)


@functools.partial(jax.jit, static_argnames=("model", "num_steps", "top_k"))
def _generate(model: SequenceModel, variables: Any, prompt: Array, num_steps: int, rng: Array,
              temperature: Array, top_k: int | None, top_p: Array | None,
              eos_token: Array | None) -> Array:
  """`generate` after its checks: one program per model, shapes and `top_k`."""
  return sample(lambda tokens: model.apply(variables, tokens, return_state=True),
                lambda state, token: model.apply(variables, state, token, method="step"),
                prompt, num_steps, rng, temperature, top_k, top_p, eos_token)


def sample(prefill: Callable[[Array], tuple[Array, Any]],
           step: Callable[[Any, Array], tuple[Any, Array]], prompt: Array, num_steps: int,
           rng: Array, temperature: Array, top_k: int | None, top_p: Array | None,
           eos_token: Array | None) -> Array:
  """The continuation of `generate` from a model's two calls, traced inside a front end's jit.

  Args:
    prefill: `prefill(prompt) -> (logits (*batch, P, V), state)`, the model over the prompt.
    step: `step(state, token) -> (state, logits (*batch, V))`, one step of the model.
    prompt, num_steps, rng, temperature, top_k, top_p, eos_token: as `generation_arguments`
      returns them.

  Returns:
    `(*batch, num_steps)` int32 generated tokens.
  """
  logits, state = prefill(prompt)
  sampling = temperature > 0
  scale = jnp.where(sampling, temperature, 1.0)

  def draw(carry, key):
    state, logits, done = carry
    greedy = jnp.argmax(logits, axis=-1)
    filtered = _filter_logits(logits / scale.astype(logits.dtype), top_k, top_p)
    token = jnp.where(sampling, jax.random.categorical(key, filtered, axis=-1), greedy)
    token = token.astype(jnp.int32)
    if eos_token is not None:
      token = jnp.where(done, eos_token, token)
      done = done | (token == eos_token)
    state, logits = step(state, token)
    return (state, logits, done), token

  done = jnp.zeros(prompt.shape[:-1], bool)
  keys = jax.random.split(rng, num_steps)
  _, generated = jax.lax.scan(draw, (state, logits[..., -1, :], done), keys)
  return jnp.moveaxis(generated, 0, -1)
