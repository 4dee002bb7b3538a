"""Stacked SSM models: encoder, residual blocks, pooling and decoder; causal generation."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common
from ssmkit._src.layers.block import ModuleDef, Norm, SSMBlock, check_choice, check_mask
from ssmkit._src.layers.lru import LRU
from ssmkit._src.modes import Mode

Array = jax.Array

POOLINGS = ("mean", "last", "none")


class _ScannedBlock(nn.Module):
  """One `SSMBlock` in the carry-first form `nn.scan` applies across stacked blocks."""

  config: dict[str, Any]
  single_step: bool
  return_state: bool
  mode: str | Mode = "auto"
  train: bool = False

  def setup(self) -> None:
    self.block = SSMBlock(**self.config)

  def __call__(self, x: Array, state: Any, mask: Array | None, reset: Array | None) -> tuple[Array, Any]:
    state, x = self.block._forward(x, mask, reset, state, single_step=self.single_step,
                                   return_state=self.return_state, mode=self.mode, train=self.train)
    return x, state


class SequenceModel(nn.Module):
  """Encoder, `num_blocks` residual `SSMBlock`s, final norm, pooling and a linear decoder.

  Real inputs `(..., T, F)` are encoded by a Dense layer, token inputs `(..., T)` (int) by an
  embedding when `vocab_size` is set. With pooling "mean" or "last" the model classifies whole
  sequences, `(..., num_outputs)`; with "none" it returns per-step outputs `(..., T, num_outputs)`,
  causal when the SSM layer is, and `step` runs it one step at a time (see `generate`).

  Attributes:
    num_outputs: classes, or the output vocabulary of a language model.
    layer: factory of the SSM layer, e.g. `functools.partial(ssmkit.layers.S5, d_state=32)`.
    features: model width H.
    num_blocks: number of residual blocks.
    vocab_size: input vocabulary for token inputs; None for real-valued inputs.
    pooling: "mean" or "last" over the real steps of `mask`, or "none".
    norm: "layer", "batch" or "rms" (see `SSMBlock`).
    activation: "gelu", "glu" or "half_glu" (see `SSMBlock`).
    dropout_rate: dropout inside the blocks when `train`.
    prenorm: normalise block inputs (True) or residual sums (False).
    scan_blocks: apply the blocks with `nn.scan` over parameters stacked on a leading axis of
      size `num_blocks`, so compile time does not grow with depth.
  """

  num_outputs: int
  layer: ModuleDef = LRU
  features: int = 64
  num_blocks: int = 2
  vocab_size: int | None = None
  pooling: str = "mean"
  norm: str = "layer"
  activation: str = "glu"
  dropout_rate: float = 0.0
  prenorm: bool = True
  scan_blocks: bool = False

  def _block_config(self) -> dict[str, Any]:
    return dict(layer=self.layer, norm=self.norm, activation=self.activation,
                dropout_rate=self.dropout_rate, prenorm=self.prenorm)

  def _scanned(self, **flags: Any) -> nn.Module:
    scan = nn.scan(
        _ScannedBlock,
        variable_axes={"params": 0, "batch_stats": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(0, nn.broadcast, nn.broadcast),
        length=self.num_blocks,
    )
    return scan(self._block_config(), **flags, name="blocks")

  def _encode(self, x: Array) -> Array:
    if self.vocab_size is None:
      return nn.Dense(self.features, name="encoder")(x)
    return nn.Embed(self.vocab_size, self.features, name="encoder")(x)

  @nn.compact
  def _forward(self, x: Array, mask: Array | None, reset: Array | None, state: Any, *, single_step: bool,
               return_state: bool, mode: str | Mode, train: bool) -> tuple[Any, Array]:
    """The model on one step, or on a sequence (from `state` unless None), and the blocks' state."""
    check_choice(self.pooling, POOLINGS, "pooling")
    x = self._encode(x)
    flags = dict(single_step=single_step, return_state=return_state, mode=mode, train=train)
    if self.scan_blocks:
      x, state = self._scanned(**flags)(x, state, mask, reset)
    else:
      states = []
      for i in range(self.num_blocks):
        block = SSMBlock(**self._block_config(), name=f"block_{i}")
        block_state, x = block._forward(x, mask, reset, None if state is None else state[i], **flags)
        states.append(block_state)
      state = tuple(states)
    if self.prenorm:
      x = Norm(self.norm, name="final_norm")(x, mask, train=train)
    if not single_step:
      x = _pool(x, mask, self.pooling)
    return state, nn.Dense(self.num_outputs, name="decoder")(x)

  def _check_inputs(self, x: Array, batch_rank: int, what: str) -> Array:
    x = jnp.asarray(x)
    if self.vocab_size is None:
      return x
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.ndim < batch_rank:
      raise ValueError(
          f"`{what}` must be integer tokens with `vocab_size` set, got {x.dtype} {x.shape}.")
    return x

  def __call__(self, x: Array, mask: Array | None = None, reset: Array | None = None, *,
               initial_state: Any = None, return_state: bool = False, mode: str | Mode = "auto",
               train: bool = False) -> Array | tuple[Array, Any]:
    """Runs the model over whole sequences.

    Args:
      x: `(..., T, F)` real inputs, or `(..., T)` integer tokens when `vocab_size` is set.
      mask: optional `(..., T)` booleans, True on real steps; padding must come after them.
      reset: optional `(..., T)` booleans; True clears every block's state before that step.
      initial_state: optional state to start from, as `initialize_state` or `step` makes it
        (e.g. the state at the start of a rollout); default zeros.
      return_state: also return the state after the last step (padding included), from which
        `step` or another call continues.
      mode: scan mode of the SSM layers.
      train: dropout on and BatchNorm on batch statistics (needs a "dropout" rng when
        `dropout_rate` > 0 and a mutable "batch_stats" collection with BatchNorm).

    Returns:
      `(..., num_outputs)` with pooling, else `(..., T, num_outputs)`; with `return_state`,
      `(outputs, state)`.
    """
    x = self._check_inputs(x, 1, "x")
    steps = x.shape if self.vocab_size is not None else x.shape[:-1]
    if self.vocab_size is None:
      x, reset = common.check_sequence(x, reset)
    elif reset is not None:
      common.check_sequence(jnp.zeros((*steps, 1)), reset)
    mask = check_mask(mask, jnp.zeros((*steps, 1), bool))
    state, y = self._forward(x, mask, reset, initial_state, single_step=False,
                             return_state=return_state, mode=mode, train=train)
    return (y, state) if return_state else y

  def initialize_state(self, input_shape: tuple[int, ...]) -> Any:
    """The zero state of every block for one step of input: `(*batch, F)`, or `(*batch,)` tokens."""
    batch = tuple(input_shape) if self.vocab_size is not None else tuple(input_shape)[:-1]
    block_state = SSMBlock(**self._block_config(), parent=None).initialize_state((*batch, self.features))
    if self.scan_blocks:
      return jax.tree.map(lambda s: jnp.stack([s] * self.num_blocks), block_state)
    return tuple(block_state for _ in range(self.num_blocks))

  def step(self, state: Any, x_t: Array, reset: Array | None = None) -> tuple[Any, Array]:
    """Advances one step at inference; needs pooling "none".

    Args:
      state: from `initialize_state` or a previous `step`.
      x_t: `(*batch, F)` input, or `(*batch,)` tokens when `vocab_size` is set.
      reset: optional `(*batch,)` booleans; True clears the state before this step.

    Returns:
      `(state, y_t)` with `y_t` of shape `(*batch, num_outputs)`.
    """
    if self.pooling != "none":
      raise ValueError(f"`step` needs pooling='none', got pooling={self.pooling!r}.")
    x_t = self._check_inputs(x_t, 0, "x_t")
    if self.vocab_size is None:
      x_t, reset = common.check_step(x_t, reset)
    elif reset is not None:
      common.check_step(jnp.zeros((*x_t.shape, 1)), reset)
    return self._forward(x_t, None, reset, state, single_step=True, return_state=True, mode="auto",
                         train=False)


def _pool(x: Array, mask: Array | None, pooling: str) -> Array:
  """Pools `(..., T, H)` over the real steps of `mask` (`(..., T)`, padding last)."""
  if pooling == "none":
    return x
  if mask is None:
    return jnp.mean(x, axis=-2) if pooling == "mean" else x[..., -1, :]
  if pooling == "mean":
    count = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1).astype(x.dtype)
    return jnp.sum(jnp.where(mask[..., None], x, jnp.zeros_like(x)), axis=-2) / count
  last = jnp.maximum(jnp.sum(mask, axis=-1) - 1, 0)
  return jnp.take_along_axis(x, last[..., None, None], axis=-2)[..., 0, :]


def generate(model: SequenceModel, variables: Any, prompt: Array, num_steps: int, *,
             rng: Array | None = None, temperature: float = 1.0) -> Array:
  """Continues token sequences with a causal `SequenceModel`.

  The prompt runs as one sequence (in any scan mode's parallel form), then the model continues
  one step at a time from its last state: each next token is drawn from
  softmax(logits / temperature), or taken greedily when `temperature` is 0.

  Args:
    model: a `SequenceModel` with `vocab_size` set and pooling "none".
    variables: its variables (`{"params": ...}`, plus "batch_stats" with BatchNorm).
    prompt: `(*batch, P)` int tokens, P >= 1.
    num_steps: number of tokens to generate.
    rng: PRNG key for sampling; needed unless `temperature` is 0.
    temperature: softmax temperature; 0 for greedy decoding.

  Returns:
    `(*batch, num_steps)` int32 generated tokens.
  """
  if model.vocab_size is None or model.pooling != "none":
    raise ValueError("`model` must have `vocab_size` set and pooling='none' to generate tokens.")
  prompt = jnp.asarray(prompt)
  if not jnp.issubdtype(prompt.dtype, jnp.integer) or prompt.ndim < 1 or prompt.shape[-1] < 1:
    raise ValueError(f"`prompt` must be integer tokens `(*batch, P)` with P >= 1, got {prompt.dtype} "
                     f"{prompt.shape}.")
  if temperature < 0:
    raise ValueError(f"`temperature` must be >= 0, got {temperature}.")
  if temperature > 0 and rng is None:
    raise ValueError("`rng` is needed to sample with `temperature` > 0.")
  step = lambda state, token: model.apply(variables, state, token, method="step")
  logits, state = model.apply(variables, prompt, return_state=True)
  keys = jax.random.split(jax.random.key(0) if rng is None else rng, num_steps)

  def sample(carry, key):
    state, logits = carry
    if temperature == 0:
      token = jnp.argmax(logits, axis=-1)
    else:
      token = jax.random.categorical(key, logits / temperature, axis=-1)
    token = token.astype(jnp.int32)
    return step(state, token), token

  _, generated = jax.lax.scan(sample, (state, logits[..., -1, :]), keys)
  return jnp.moveaxis(generated, 0, -1)
