"""`SequenceModel` and `generate` as Flax NNX: the linen model's stack with NNX modules."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ssmkit._src.layers.experts import Experts
from ssmkit._src.layers.model import (
  block_layer,
  block_options,
  check_inputs,
  check_model,
  check_step_inputs,
  check_step_state,
  generation_arguments,
  layer_pattern,
  output_logits,
  pattern_state,
  pool,
  sample,
  scale_embeddings,
  scanned_counts,
  start_value_residual,
  tokens_in_vocabulary,
)
from ssmkit._src.modes import Mode
from ssmkit._src.nnx.block import MixerBlock, SSMBlock, make_norm, normalize
from ssmkit._src.nnx.layers import LRU

Array = jax.Array


def _stacked_blocks(make: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
  """`count` blocks as one whose parameters are stacked on a leading axis, each drawn apart."""

  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs: nnx.Rngs) -> nnx.Module:
    return make(rngs)

  return create(rngs)


class SequenceModel(nnx.Module):
  """`ssmkit.layers.SequenceModel` as an NNX module: encoder, residual blocks, norm, pooling, decoder.

  `SequenceModel(in_features, num_outputs, layer=ssmkit.nnx.LRU, ..., rngs=nnx.Rngs(0))` for
  real inputs `(..., T, in_features)`, or `SequenceModel(None, num_outputs, vocab_size=V, ...)`
  for tokens `(..., T)`; the other options are the linen model's, `layer` a factory or a
  pattern of them cycled over the blocks. Each block builds its layer as
  `layer(features, rngs=rngs)`. Dropout and BatchNorm follow NNX's modes (`model.train()`,
  the mode a new module starts in, and `model.eval()`, see `SSMBlock`); `step` is always
  inference.

  Attributes:
    encoder: `nnx.Linear` for real inputs, `nnx.Embed` for tokens.
    blocks: an `nnx.List` of blocks (`SSMBlock` or `MixerBlock`); with `scan_blocks`, one
      block whose parameters are stacked on a leading axis of size `num_blocks`, or for a
      pattern an `nnx.List` of one such block per pattern position over the whole repeats.
    tail: with `scan_blocks` and a pattern whose length does not divide `num_blocks`, an
      `nnx.List` of the blocks left, each stacked on an axis of size 1; else None.
    head: with `scan_blocks` and `head_blocks`, an `nnx.List` of the head's blocks, each
      stacked on an axis of size 1 (`blocks` and `tail` then of the places after them); else
      None.
    final_norm: the norm after the blocks (with `prenorm`), else None.
    decoder: `nnx.Linear` to `num_outputs`, or None with `tie_embeddings`.
  """

  def __init__(self, in_features: int | None, num_outputs: int, *,
               layer: Callable[..., nnx.Module] | Sequence[Callable[..., nnx.Module]] = LRU,
               features: int = 64, num_blocks: int = 2, vocab_size: int | None = None,
               pooling: str = "mean", block: str = "ssm", norm: str = "layer",
               norm_eps: float | None = None, activation: str = "glu", mlp: str = "none",
               mlp_expansion: float = 4.0, mlp_bias: bool = False, experts: Experts | None = None,
               dropout_rate: float = 0.0, prenorm: bool = True, scan_blocks: bool = False,
               head_blocks: int = 0, tie_embeddings: bool = False, decoder_bias: bool = True,
               scale_embeddings: bool | float = False, logit_cap: float | None = None,
               logits_scaling: float = 1.0, residual_scale: float = 1.0,
               mlp_scales: tuple[float, float] = (1.0, 1.0),
               norm_position: str | tuple[str, ...] = "input", dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    """Builds the model.

    Args:
      in_features: the width F of real inputs; None with `vocab_size` for token inputs.
      num_outputs: classes, or the output vocabulary of a language model.
      layer: factory of the sequence layer, e.g. `functools.partial(ssmkit.nnx.S5, d_state=32)`,
        or a sequence of factories cycled over the blocks.
      features: model width H.
      num_blocks: number of residual blocks.
      vocab_size: input vocabulary for token inputs; None for real-valued inputs.
      pooling: "mean" or "last" over the real steps of `mask`, or "none".
      block: "ssm" (`SSMBlock`) or "mixer" (`MixerBlock`).
      norm: "layer", "batch", "rms" or "rms_plus_one".
      norm_eps: the epsilon of every norm; None: flax's default.
      activation: "gelu", "glu" or "half_glu" (block "ssm").
      mlp: "none", "gelu", "geglu", "swiglu" or "experts" (block "mixer").
      mlp_expansion: the MLP's hidden width over `features` (block "mixer").
      mlp_bias: biases in the MLP's projections (block "mixer").
      experts: the mixture of experts of `mlp="experts"` (`ssmkit.layers.Experts`).
      dropout_rate: dropout inside the blocks in training mode.
      prenorm: normalise block inputs (True) or residual sums (False; block "ssm" only).
      scan_blocks: run the blocks with `nnx.scan` over parameters stacked on a leading axis,
        so compile time does not grow with depth (see `ssmkit.layers.SequenceModel`).
      head_blocks: how many first places of the pattern are the first blocks' alone, the
        blocks after them cycling over the places after them (see
        `ssmkit.layers.SequenceModel`).
      tie_embeddings: decode with the transposed token embedding (`vocab_size` equal to
        `num_outputs`).
      decoder_bias: a bias on the decoder (untied heads).
      scale_embeddings: multiply token embeddings by sqrt(`features`) (True) or by this number.
      logit_cap: soft-cap the outputs to `logit_cap * tanh(y / logit_cap)`; None: no cap.
      logits_scaling: divide the decoder's outputs by this, before the cap.
      residual_scale: the factor on each mixer block's branches (block "mixer").
      mlp_scales: (a, b): each dense MLP's activation input times a, its output times b
        (block "mixer").
      norm_position: "input" or "output", or one per layer of the pattern (block "mixer"; see
        `ssmkit.layers.SequenceModel`).
      dtype: the computation dtype of the activations, embeddings, norms and projections
        (e.g. `jnp.bfloat16`); None: that of the inputs and parameters.
      param_dtype: the dtype of the model's own parameters (the layers have their own).
      rngs: the parameters' and dropout's random streams.
    """
    if (in_features is None) == (vocab_size is None):
      raise ValueError("give `in_features` for real inputs or `vocab_size` for tokens, not both: got "
                       f"in_features={in_features!r}, vocab_size={vocab_size!r}.")
    self.in_features = in_features
    self.num_outputs = num_outputs
    self.layer = layer if callable(layer) else tuple(layer)
    self.features = features
    self.num_blocks = num_blocks
    self.vocab_size = vocab_size
    self.pooling = pooling
    self.block = block
    self.norm = norm
    self.norm_eps = norm_eps
    self.activation = activation
    self.mlp = mlp
    self.mlp_expansion = mlp_expansion
    self.mlp_bias = mlp_bias
    self.experts = experts
    self.dropout_rate = dropout_rate
    self.prenorm = prenorm
    self.scan_blocks = scan_blocks
    self.head_blocks = head_blocks
    self.tie_embeddings = tie_embeddings
    self.decoder_bias = decoder_bias
    self.scale_embeddings = scale_embeddings
    self.logit_cap = logit_cap
    self.logits_scaling = logits_scaling
    self.residual_scale = residual_scale
    self.mlp_scales = tuple(mlp_scales)
    self.norm_position = norm_position if isinstance(norm_position, str) else tuple(norm_position)
    self.dtype, self.param_dtype = dtype, param_dtype
    check_model(self)
    precision = dict(dtype=dtype, param_dtype=param_dtype)
    if vocab_size is None:
      self.encoder = nnx.Linear(in_features, features, rngs=rngs, **precision)
    else:
      self.encoder = nnx.Embed(vocab_size, features, rngs=rngs, **precision)
    cls = SSMBlock if block == "ssm" else MixerBlock
    make_block = lambda i: functools.partial(cls, features, layer=block_layer(self, i),
                                             **block_options(self, i))
    blocks = [make_block(j) for j in range(len(layer_pattern(layer)))]  # the first repeat
    head = tail = None
    if not scan_blocks:
      self.blocks = nnx.List([make_block(i)(rngs=rngs) for i in range(num_blocks)])
    elif callable(layer):
      self.blocks = _stacked_blocks(lambda rngs: blocks[0](rngs=rngs), num_blocks, rngs)
    else:
      repeats, rest = scanned_counts(self)
      stack = lambda make, count: _stacked_blocks(lambda rngs: make(rngs=rngs), count, rngs)
      head = nnx.List([stack(make, 1) for make in blocks[:head_blocks]]) if head_blocks else None
      period = blocks[head_blocks:]
      self.blocks = nnx.List([stack(make, repeats) for make in period])
      tail = nnx.List([stack(make, 1) for make in period[:rest]]) if rest else None
    self.head, self.tail = head, tail
    self.final_norm = make_norm(norm, features, rngs, eps=norm_eps, **precision) if prenorm else None
    self.decoder = None if tie_embeddings else nnx.Linear(
        features, num_outputs, use_bias=decoder_bias, rngs=rngs, **precision)

  def _run_blocks(self, x: Array, mask: Array | None, reset: Array | None, state: Any,
                  **flags: Any) -> tuple[Array, Any]:
    shared = start_value_residual(self, x)
    if not self.scan_blocks:
      states = []
      for i, block in enumerate(self.blocks):
        (block_state, shared), x = block.forward(x, mask, reset, None if state is None else state[i],
                                                 value_residual=shared, **flags)
        states.append(block_state)
      return x, tuple(states)

    @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def through(blocks: Any, carry: tuple[Array, Any], block_state: Any) -> tuple[Any, Any]:
      x, shared = carry
      if not isinstance(blocks, nnx.List):
        (block_state, shared), x = blocks.forward(x, mask, reset, block_state, value_residual=shared,
                                                  **flags)
        return (x, shared), block_state
      states = []
      for j, block in enumerate(blocks):
        (state_j, shared), x = block.forward(
            x, mask, reset, None if block_state is None else block_state[j], value_residual=shared,
            **flags)
        states.append(state_j)
      return (x, shared), tuple(states)

    if callable(self.layer):
      (x, _), state = through(self.blocks, (x, shared), state)
      return x, state
    state = (None,) * (2 if self.head is None else 3) if state is None else state
    heads = ()
    if self.head is not None:
      (x, shared), heads = through(self.head, (x, shared), state[0])
    state = state[-2:]
    (x, shared), repeated = through(self.blocks, (x, shared), state[0])
    tail = ()
    if self.tail is not None:
      (x, _), tail = through(self.tail, (x, shared), state[1])
    return x, (() if self.head is None else (heads,)) + (repeated, tail)

  def _forward(self, x: Array, mask: Array | None, reset: Array | None, state: Any, *,
               single_step: bool, return_state: bool, mode: str | Mode,
               axis_name: Hashable | None = None) -> tuple[Any, Array]:
    """The model on one step, or on a sequence (from `state` unless None), and the blocks' state."""
    if self.vocab_size is not None:
      x = tokens_in_vocabulary(x, self.vocab_size, "x_t" if single_step else "x")
    x = scale_embeddings(self, self.encoder(x))
    x, state = self._run_blocks(x, mask, reset, state, single_step=single_step,
                                return_state=return_state, mode=mode, axis_name=axis_name)
    if self.final_norm is not None:
      x = normalize(self.final_norm, x, mask, inference=single_step, axis_name=axis_name)
    if not single_step:
      x = pool(x, mask, self.pooling, axis_name)
    y = self.encoder.attend(x) if self.tie_embeddings else self.decoder(x)
    return state, output_logits(self, y)

  def __call__(self, x: Array, mask: Array | None = None, reset: Array | None = None, *,
               initial_state: Any = None, return_state: bool = False, mode: str | Mode = "auto",
               axis_name: Hashable | None = None) -> Array | tuple[Array, Any]:
    """Runs the model over whole sequences, as the linen model does.

    Args:
      x: `(..., T, F)` real inputs, or `(..., T)` integer tokens when `vocab_size` is set:
        ids outside [0, vocab_size) are refused where known (outside `jit`), and under `jit`
        embed as NaN (`tokens_in_vocabulary`), never as another token.
      mask: optional `(..., T)` booleans, True on real steps (batch axes of size 1
        broadcast); see `ssmkit.layers.SequenceModel` for padding.
      reset: optional `(..., T)` booleans; True clears every block's state before that step.
      initial_state: optional state to start from, as `initialize_state` or `step` makes it;
        default zeros.
      return_state: also return the state after the last step (padding included).
      mode: scan mode of the layers.
      axis_name: sequence parallelism, as for the linen model.

    Returns:
      `(..., num_outputs)` with pooling, else `(..., T, num_outputs)`; with `return_state`,
      `(outputs, state)`.
    """
    x, mask, reset = check_inputs(self, x, mask, reset)
    state, y = self._forward(x, mask, reset, initial_state, single_step=False,
                             return_state=return_state, mode=mode, axis_name=axis_name)
    return (y, state) if return_state else y

  def initialize_state(self, input_shape: tuple[int, ...]) -> Any:
    """The zero state of every block for one step of input: `(*batch, F)`, or `(*batch,)` tokens
    (structured as `ssmkit.layers.SequenceModel.initialize_state` describes)."""
    batch = tuple(input_shape) if self.vocab_size is not None else tuple(input_shape)[:-1]
    shape = (*batch, self.features)
    # Zero states need no parameters: a stacked block gives one block's.
    if not self.scan_blocks:
      pattern = self.blocks[:len(layer_pattern(self.layer))]
      states = tuple(block.initialize_state(shape) for block in pattern)
    elif callable(self.layer):
      states = (self.blocks.initialize_state(shape),)
    else:
      states = tuple(block.initialize_state(shape) for block in (*(self.head or ()), *self.blocks))
    return pattern_state(self, states)
  def step(self, state: Any, x_t: Array, reset: Array | None = None) -> tuple[Any, Array]:
    """Advances one step at inference; needs pooling "none". Call it compiled:
    `step = nnx.jit(lambda model, state, token: model.step(state, token))`, then
    `state, logits = step(model, state, token)` (`generate` runs the whole loop compiled).

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
    return self._forward(x_t, None, reset, state, single_step=True, return_state=True, mode="auto")


def generate(model: SequenceModel, prompt: Array, num_steps: int, *, rng: Array | None = None,
             temperature: float | Array = 1.0, top_k: int | None = None,
             top_p: float | Array | None = None, eos_token: int | Array | None = None) -> Array:
  """Continues token sequences with a causal NNX `SequenceModel`, as `ssmkit.layers.generate`.

  The model runs in evaluation mode whatever its own mode, and is left unchanged. The whole
  continuation is one jitted program, compiled once per model structure, shapes and `top_k`.

  Args:
    model: a `SequenceModel` with `vocab_size` set and pooling "none".
    prompt: `(*batch, P)` int tokens, P >= 1.
    num_steps: number of tokens to generate (a Python int).
    rng: PRNG key for sampling; needed unless `temperature` is 0.
    temperature: softmax temperature >= 0, a number or a traced scalar; 0 for greedy decoding.
    top_k: sample among the `top_k` most likely tokens (a Python int); 1 is greedy.
    top_p: sample within the nucleus of probability mass `top_p` in (0, 1].
    eos_token: the end token: a sequence that has generated it continues with it.

  Returns:
    `(*batch, num_steps)` int32 generated tokens.
  """
  arguments = generation_arguments(model, prompt, num_steps, rng=rng, temperature=temperature,
                                   top_k=top_k, top_p=top_p, eos_token=eos_token)
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, **arguments)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps", "top_k"))
def _generate(graphdef: nnx.GraphDef, state: nnx.State, prompt: Array, num_steps: int, rng: Array,
              temperature: Array, top_k: int | None, top_p: Array | None,
              eos_token: Array | None) -> Array:
  """`generate` after its checks, on copies of the model in evaluation mode."""

  def model() -> SequenceModel:
    # A copy for each trace (the prompt's, the loop body's): NNX transforms inside the model,
    # such as the scan over stacked blocks, take only modules of their own trace.
    copy = nnx.merge(graphdef, state, copy=True)
    copy.eval()
    return copy

  return sample(lambda tokens: model()(tokens, return_state=True),
                lambda carry, token: model().step(carry, token), prompt, num_steps, rng,
                temperature, top_k, top_p, eos_token)
