"""Causal self-attention as a layer like the recurrent ones: grouped key/value heads, rotary
positions, an optional sliding window, resets that start documents, and a key/value cache of
fixed capacity as its state."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ssmkit._src.engine import axis_position, from_device
from ssmkit._src.layers import common, functional
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.layers.norms import EPS, rms_norm, rms_norm_plus_one
from ssmkit._src.modes import Mode

Array = jax.Array

# Queries per block: a sequence longer than this attends block by block, each block's logits
# rematerialised in the backward pass, so memory holds BLOCK x keys logits, not T x keys.
BLOCK = 512


class AttentionState(NamedTuple):
  """The key/value cache of `Attention`: the last `capacity` steps, oldest first.

  The capacity is the `window` of local attention, else `cache_size`.

  Attributes:
    k: `(*batch, capacity, num_kv_heads, head_dim)` float32 keys, rotary positions applied.
    v: `(*batch, capacity, num_kv_heads, head_dim)` float32 values.
    valid: `(*batch, capacity)` bool, True for the entries of the current document.
    position: `(*batch,)` int32, the rotary position of the next step in its document.
  """

  k: Array
  v: Array
  valid: Array
  position: Array


def _heads(cfg: Any, features: int) -> tuple[int, int, int]:
  """(query heads, key/value heads, head width)."""
  kv = cfg.num_heads if cfg.num_kv_heads is None else cfg.num_kv_heads
  return cfg.num_heads, kv, features // cfg.num_heads if cfg.head_dim is None else cfg.head_dim


def capacity(cfg: Any) -> int:
  """The steps the cache holds: the window, or `cache_size` for global attention."""
  return cfg.cache_size if cfg.window is None else cfg.window


def _rotary_width(cfg: Any, head_dim: int) -> int:
  """The channels of a head that rotate: `rope_fraction` of them, an even number."""
  return int(head_dim * cfg.rope_fraction) // 2 * 2


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The projections (and biases, q/k norm scales) of attention over `features` channels."""
  common.check_positive_int(cfg.num_heads, "num_heads")
  for name in ("num_kv_heads", "head_dim", "window"):
    if getattr(cfg, name) is not None:
      common.check_positive_int(getattr(cfg, name), name)
  common.check_positive_int(cfg.cache_size, "cache_size")
  heads, kv, head_dim = _heads(cfg, features)
  if heads % kv:
    raise ValueError(f"`num_kv_heads`={kv} must divide `num_heads`={heads}.")
  if cfg.head_dim is None and features % heads:
    raise ValueError(f"`num_heads`={heads} must divide the width {features}, or set `head_dim`.")
  if not 0 <= cfg.rope_fraction <= 1:
    raise ValueError(f"`rope_fraction` must lie in [0, 1], got {cfg.rope_fraction}.")
  if not cfg.rope_base > 0:
    raise ValueError(f"`rope_base` must be > 0, got {cfg.rope_base}.")
  if cfg.logit_cap is not None and not cfg.logit_cap > 0:
    raise ValueError(f"`logit_cap` must be > 0 or None, got {cfg.logit_cap}.")
  if cfg.scale is not None and not cfg.scale > 0:
    raise ValueError(f"`scale` must be > 0 or None, got {cfg.scale!r}.")
  norm = _qk_norm(cfg)
  if not cfg.qk_norm_eps > 0:
    raise ValueError(f"`qk_norm_eps` must be > 0, got {cfg.qk_norm_eps!r}.")
  lecun = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
  specs = {}
  projections = [("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)]
  if cfg.output_gate:
    projections.append(("gate", heads * head_dim))
  for name, width in projections:
    specs[f"{name}_proj"] = ParamSpec((features, width), lecun)
    if cfg.use_bias:
      specs[f"{name}_bias"] = ParamSpec((width,), nn.initializers.zeros)
  specs["o_proj"] = ParamSpec((heads * head_dim, features), lecun)
  if cfg.use_bias if cfg.out_bias is None else cfg.out_bias:
    specs["o_bias"] = ParamSpec((features,), nn.initializers.zeros)
  common.check_choice(cfg.qk_norm_scope, QK_NORM_SCOPES, "qk_norm_scope")
  if norm is not None:
    start = nn.initializers.zeros if norm == "rms_plus_one" else nn.initializers.ones
    every = cfg.qk_norm_scope == "all"
    specs["q_norm"] = ParamSpec((heads * head_dim if every else head_dim,), start)
    specs["k_norm"] = ParamSpec((kv * head_dim if every else head_dim,), start)
  return specs


_QK_NORMS = ("rms", "rms_plus_one")
QK_NORM_SCOPES = ("head", "all")


def _qk_norm(cfg: Any) -> str | None:
  """The queries' and keys' norm: None, "rms" (scale w) or "rms_plus_one" (scale 1 + w).

  Raises:
    ValueError: naming `qk_norm` for another value.
  """
  norm = {False: None, None: None, True: "rms"}.get(cfg.qk_norm, cfg.qk_norm)
  if norm is not None and norm not in _QK_NORMS:
    raise ValueError(f"`qk_norm` must be False, True, 'rms' or 'rms_plus_one', got "
                     f"{cfg.qk_norm!r}.")
  return norm


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> AttentionState:
  """An empty cache for inputs `(*batch, H)`."""
  *batch, features = input_shape
  _, kv, head_dim = _heads(cfg, features)
  entries = (*batch, capacity(cfg), kv, head_dim)
  return AttentionState(jnp.zeros(entries, jnp.float32), jnp.zeros(entries, jnp.float32),
                        jnp.zeros((*batch, capacity(cfg)), bool), jnp.zeros(tuple(batch), jnp.int32))


def rotary(x: Array, positions: Array, width: int, base: float) -> Array:
  """Rotary position embedding of the first `width` channels of `x` `(B, T, heads, D)`.

  Channel i < width / 2 pairs with channel i + width / 2 and the pair turns by
  positions * base^(-2 i / width) (the "rotate half" layout of transformers and
  recurrentgemma); the channels from `width` on are left as they are.
  """
  half = width // 2
  if half == 0:
    return x
  frequencies = base ** (-2.0 * np.arange(half) / width)
  angle = positions[..., None, None].astype(jnp.float32) * common.leading_ones(
      jnp.asarray(frequencies, jnp.float32), positions.ndim + 2)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  first, second = x[..., :half], x[..., half:width]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin, x[..., width:]],
                         axis=-1)


def _attend(cfg: Any, q: Array, k: Array, v: Array, mask: Array) -> Array:
  """softmax(q k^T / sqrt(D) [soft-capped], masked) v for `(B, T, N, D)` queries, `(B, S, K, D)`
  keys and values and a `(B, T, S)` mask in which every query sees at least one key."""
  if cfg.logit_cap is None and q.dtype != jnp.float64 and v.shape[-1] == q.shape[-1]:
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=cfg.scale)
  # Soft-capping has no argument in jax.nn.dot_product_attention, which takes the softmax in
  # float32 whatever the inputs and values as wide as the keys: here the logits are formed in
  # the inputs' dtype.
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  logits = jnp.einsum("btnd,bsnd->bnts", q, k)
  logits = logits / math.sqrt(q.shape[-1]) if cfg.scale is None else logits * cfg.scale
  if cfg.logit_cap is not None:
    logits = cfg.logit_cap * jnp.tanh(logits / cfg.logit_cap)
  weights = jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), axis=-1)
  return jnp.einsum("bnts,bsnd->btnd", weights, v)


class _Keys(NamedTuple):
  """What a query needs of every key `(B, S, ...)`: its step, document and whether it is valid."""

  k: Array
  v: Array
  step: Array  # (S,) int32: the step index, negative for the cache's entries
  document: Array  # (B, S) int32: the number of resets before it (0 for the cache)
  valid: Array  # (B, S) bool


def _blockwise(cfg: Any, q: Array, first_step: Array, document: Array, keys: _Keys,
               keys_before: Array | int) -> Array:
  """Attention of `(B, T, N, D)` queries at steps `first_step` + 0..T-1 over `keys`, block by
  block; the first query's own key is entry `keys_before` of `keys`."""
  length = q.shape[1]
  block = min(length, BLOCK)
  count = -(-length // block)
  span = keys.k.shape[1]
  if cfg.window is not None:  # a block of queries reaches back window - 1 steps at most
    span = min(span, block + cfg.window - 1)
  pad = count * block - length
  q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  document = jnp.pad(document, ((0, 0), (0, pad)), constant_values=-1)

  def one(start: Array) -> Array:
    steps = first_step + start + jnp.arange(block)
    first = jnp.clip(start + block - span + keys_before, 0, keys.k.shape[1] - span)
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, first, span, axis=1)
    key_step = jax.lax.dynamic_slice_in_dim(keys.step, first, span)
    doc = jax.lax.dynamic_slice_in_dim(document, start, block, axis=1)
    mask = take(keys.valid)[:, None, :] & (take(keys.document)[:, None, :] == doc[:, :, None])
    mask = mask & (key_step[None, None, :] <= steps[None, :, None])
    if cfg.window is not None:
      mask = mask & (key_step[None, None, :] > steps[None, :, None] - cfg.window)
    # Padding queries (document -1) see no key: give them one key each so no row is empty.
    mask = mask | ((doc < 0)[:, :, None] & (key_step == key_step[-1])[None, None, :])
    return _attend(cfg, jax.lax.dynamic_slice_in_dim(q, start, block, axis=1), take(keys.k),
                   take(keys.v), mask)

  if count == 1:
    return one(jnp.int32(0))[:, :length]
  out = jax.lax.map(jax.checkpoint(one), jnp.arange(count, dtype=jnp.int32) * block)
  out = jnp.moveaxis(out, 0, 1).reshape((q.shape[0], count * block, *out.shape[3:]))
  return out[:, :length]


def _non_finite(x: Array) -> Array:
  """`(B, T)` flags of the steps of `(B, T, heads, D)` `x` with a non-finite entry."""
  return ~jnp.all(jnp.isfinite(x), axis=(2, 3))


def _zeroed(x: Array) -> Array:
  """`x` with its non-finite entries zeroed."""
  return jnp.where(jnp.isfinite(x), x, 0)


class _Slice(NamedTuple):
  """Where this device's slice of time lies in the whole sequence (one device: all of it).

  Attributes:
    offset: the step of the slice's first step.
    document: `(B, T)` the resets at or before each step, counted from the sequence's start.
    last_reset: `(B, T)` the step of the last reset at or before each step, -1 if none.
    flagged_before: `(B,)` the last step before the slice with a non-finite key or value,
      the int32 minimum if none (the cache's entries are not counted here).
  """

  offset: Array
  document: Array
  last_reset: Array
  flagged_before: Array


_LOWEST = np.iinfo(np.int32).min


def _earlier(values: Array, axis_name: Hashable | None, combine, empty) -> Array:
  """`combine` over the `(B,)` `values` of the devices before this one along `axis_name`."""
  if axis_name is None:
    return jnp.full_like(values, empty)
  index, size = axis_position(axis_name)
  every = jax.lax.all_gather(values, axis_name)
  before = (jnp.arange(size) < index).reshape(size, *(1,) * values.ndim)
  return combine(jnp.where(before, every, empty), axis=0)


def _locate(reset: Array, flagged: Array, axis_name: Hashable | None) -> _Slice:
  """This slice's place in the whole sequence, from each slice's resets and flagged keys."""
  length = reset.shape[1]
  offset = jnp.int32(0) if axis_name is None else axis_position(axis_name)[0] * length
  step = offset + jnp.arange(length, dtype=jnp.int32)
  document = jnp.cumsum(reset, axis=-1, dtype=jnp.int32)
  document = document + _earlier(document[:, -1], axis_name, jnp.sum, 0)[:, None]
  last_reset = jax.lax.cummax(jnp.where(reset, step[None], -1), axis=1)
  last_reset = jnp.maximum(last_reset, _earlier(last_reset[:, -1], axis_name, jnp.max, -1)[:, None])
  latest = jnp.max(jnp.where(flagged, step[None], _LOWEST), axis=1)
  return _Slice(offset, document, last_reset, _earlier(latest, axis_name, jnp.max, _LOWEST))


def _time_axis(a: Array) -> int:
  """The time axis of a field of `_Keys`: 0 of `step`, 1 of the `(B, S, ...)` others."""
  return 0 if a.ndim == 1 else 1


def _join(*parts: _Keys) -> _Keys:
  """The keys of `parts` one after another."""
  return _Keys(*(jnp.concatenate(fields, axis=_time_axis(fields[0]))
                 for fields in zip(*parts, strict=True)))


def _visible(cfg: Any, own: _Keys, cache: _Keys | None, axis_name: Hashable | None
             ) -> tuple[_Keys, Array | int]:
  """The keys this slice's queries may read: the cache's (if any), every earlier slice's and
  its own, in step order, and the index of its first step among them.

  Global attention all-gathers every slice's keys and values (the later ones masked); local
  attention receives only the slices its window reaches back into, each by one `ppermute`,
  and where such a slice would lie before the sequence, the cache's entries stand in for it.
  """
  entries = 0 if cache is None else cache.k.shape[1]
  if axis_name is None:
    return (own, 0) if cache is None else (_join(cache, own), entries)
  index, size = axis_position(axis_name)
  length = own.k.shape[1]
  if cfg.window is None:
    every = _Keys(*(jax.lax.all_gather(a, axis_name, axis=_time_axis(a), tiled=True) for a in own))
    return (every if cache is None else _join(cache, every)), index * length + entries
  reach = 0 if length == 0 else min(size - 1, math.ceil((cfg.window - 1) / length))
  # The cache as the steps -reach * length .. -1, invalid where it has no entry.
  pad = max(0, reach * length - entries)
  padded = [jnp.pad(a, [(0, 0), (pad, 0)] + [(0, 0)] * (a.ndim - 2))[:, -reach * length:]
            for a in (cache.k, cache.v, cache.document, cache.valid)]
  pieces = []
  for back in range(reach, 0, -1):
    received = [jax.lax.ppermute(a, axis_name, [(j, j + back) for j in range(size - back)])
                for a in (own.k, own.v, own.document, own.valid)]
    start = jnp.clip(index - back + reach, 0, reach - 1) * length
    k, v, document, valid = (
        jnp.where(index >= back, r, jax.lax.dynamic_slice_in_dim(c, start, length, axis=1))
        for r, c in zip(received, padded, strict=True))
    pieces.append(_Keys(k, v, own.step - back * length, document, valid))
  return _join(*pieces, own), reach * length


class Core(NamedTuple):
  """What `attend` reads of an attention layer's configuration (an `Attention` has each)."""

  window: int | None
  cache_size: int
  logit_cap: float | None
  scale: float | None
  rope_base: float


def attend(cfg: Any, q: Array, k: Array, v: Array, reset: Array, state: AttentionState, *,
           cached: bool, axis_name: Hashable | None, width: int) -> tuple[Array, AttentionState]:
  """Causal attention with a cache, as every attention layer computes it.

  Args:
    cfg: the `Core` options (an `Attention`, or a `Core` another layer makes).
    q: `(B, T, heads, D)` queries, before rotary positions.
    k: `(B, T, kv, D)` keys, before rotary positions.
    v: `(B, T, kv, Dv)` values.
    reset: `(B, T)` bool: a document starts at the step.
    state: the cache before the sequence, its batch axes flattened to B.
    cached: whether `state` was given (else it holds nothing to read).
    axis_name: the mesh axis over which time is split, or None.
    width: the channels of each query and key head that rotate, from the first.

  Returns:
    `(outputs (B, T, heads, Dv), the cache after the last step)`.
  """
  rows, length = q.shape[:2]
  size = capacity(cfg)
  flagged = _non_finite(k) | _non_finite(v)
  where = _locate(reset, flagged, axis_name)
  step = where.offset + jnp.arange(length, dtype=jnp.int32)
  positions = jnp.where(where.last_reset >= 0, step[None] - where.last_reset,
                        state.position[:, None] + step[None])
  q, k = rotary(q, positions, width, cfg.rope_base), rotary(k, positions, width, cfg.rope_base)

  own = _Keys(k, v, step, where.document, jnp.ones((rows, length), bool))
  # The cache's entries precede the sequence; without a given state there are none to read,
  # but local attention across devices reads its (then invalid) entries in place of slices.
  cache = _Keys(state.k, state.v, jnp.arange(-size, 0, dtype=jnp.int32),
                jnp.zeros((rows, size), jnp.int32), state.valid)
  if not cached and (axis_name is None or cfg.window is None):
    cache = None
  keys, before = _visible(cfg, own, cache, axis_name)
  flagged_cache = jnp.max(jnp.where((_non_finite(state.k) | _non_finite(state.v)) & state.valid,
                                    jnp.arange(-size, 0, dtype=jnp.int32)[None], _LOWEST), axis=1)
  # The cache after the last step: the last `size` steps of the cache and the sequence, valid
  # where in the last document; on the device holding the last slice, which sees them all.
  last_doc = where.document[:, -1:]
  kept = state.valid & (last_doc == 0)
  tail = lambda a, b: jnp.concatenate([a, b], axis=1)[:, -size:]
  final = AttentionState(tail(state.k, keys.k), tail(state.v, keys.v),
                         tail(kept, keys.valid & (keys.document == last_doc)), positions[:, -1] + 1)
  # A non-finite query, key or value is zeroed before the products, and the outputs that read
  # it are set to NaN after: inside a product, a masked NaN would meet its zero weight as
  # 0 * NaN and reach every query, values and gradients.
  keys = keys._replace(k=_zeroed(keys.k), v=_zeroed(keys.v))
  poisoned = _non_finite(q) | _reads(cfg, step, where, flagged, flagged_cache)
  q = _zeroed(q)
  out = _blockwise(cfg, q, where.offset, where.document, keys, before)
  out = jnp.where(poisoned[..., None, None], jnp.nan, out)

  if axis_name is not None:
    index, devices = axis_position(axis_name)
    holder = index == devices - 1
    final = final._replace(valid=final.valid.astype(jnp.int32))
    final = jax.tree.map(lambda s: from_device(s, holder, axis_name), final)
    final = final._replace(valid=final.valid.astype(bool))
  return out, final


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: AttentionState | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, AttentionState]:
  """Attention over `(..., T, H)` inputs (`mode` unused: one form): `(y, cache after the last step)`."""
  del mode
  *batch, length, features = x.shape
  heads, kv, head_dim = _heads(cfg, features)
  rows = math.prod(batch)
  state = functional.starting_state(initialize_state, cfg, x, initial_state)
  state = jax.tree.map(lambda s: s.reshape((rows, *s.shape[len(batch):])), state)
  if length == 0:  # (every slice is as long: none has a step either)
    unflat = jax.tree.map(lambda s: s.reshape((*batch, *s.shape[1:])), state)
    return jnp.zeros(x.shape, x.dtype), unflat
  xf = x.reshape(rows, length, features)
  dtype = common.computation_dtype(x.dtype)
  reset = jnp.zeros((rows, length), bool) if reset is None else reset.reshape(rows, length)

  def project(name: str, count: int) -> Array:
    y = common.project(xf, params[f"{name}_proj"], dtype)
    if f"{name}_bias" in params:
      y = y + common.leading_ones(params[f"{name}_bias"], y.ndim)
    return y.reshape(rows, length, count, head_dim)

  q, k, v = project("q", heads), project("k", kv), project("v", kv)
  norm = {"rms": rms_norm, "rms_plus_one": rms_norm_plus_one}.get(_qk_norm(cfg))
  if norm is not None:
    scoped = lambda u, scale: (norm(u, scale, cfg.qk_norm_eps) if cfg.qk_norm_scope == "head"
                               else norm(u.reshape(*u.shape[:-2], -1), scale,
                                         cfg.qk_norm_eps).reshape(u.shape))
    q, k = scoped(q, params["q_norm"]), scoped(k, params["k_norm"])
  out, final = attend(cfg, q, k, v, reset, state, cached=initial_state is not None,
                      axis_name=axis_name, width=_rotary_width(cfg, head_dim))
  if cfg.output_gate:
    out = out * jax.nn.sigmoid(project("gate", heads))
  y = common.project(out.reshape(rows, length, heads * head_dim), params["o_proj"], dtype)
  if "o_bias" in params:
    y = y + common.leading_ones(params["o_bias"], y.ndim)
  final = jax.tree.map(lambda s: s.reshape((*batch, *s.shape[1:])), final)
  return y.reshape(*batch, length, features).astype(x.dtype), final


def _reads(cfg: Any, step: Array, where: _Slice, flagged: Array, flagged_cache: Array) -> Array:
  """`(B, T)`: the queries that attend to a flagged key, in O(T) memory.

  Args:
    cfg: the layer's configuration (its `window`).
    step: `(T,)` the queries' steps.
    where: the slice's place in the sequence.
    flagged: `(B, T)` the slice's flagged keys.
    flagged_cache: `(B,)` the last of the cache's flagged valid entries (steps -C..-1), or
      the int32 minimum.
  """
  latest = jax.lax.cummax(jnp.where(flagged, step[None], _LOWEST), axis=1)
  latest = jnp.maximum(latest, jnp.maximum(where.flagged_before, flagged_cache)[:, None])
  # Counted while in the query's document; the cache is in the first one.
  start = jnp.where(where.last_reset >= 0, where.last_reset, _LOWEST + 1)
  reached = latest >= start
  if cfg.window is not None:
    reached = reached & (latest > step[None] - cfg.window)
  return reached


def step(cfg: Any, params: dict[str, Array], state: AttentionState, x_t: Array,
         reset: Array | None = None) -> tuple[AttentionState, Array]:
  """One decoding step on `(*batch, H)` inputs: `(cache, y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class Attention(functional.LinenLayer):
  """Causal multi-head self-attention with grouped key/value heads and rotary positions.

  Inputs `(..., T, H)` give outputs `(..., T, H)`. Per step, queries of `num_heads` heads and
  keys and values of `num_kv_heads` heads (MHA when equal, GQA when fewer, MQA with one) of
  `head_dim` channels are projected from the input (with biases if `use_bias`; the output
  projection's as `out_bias` says), optionally
  RMS-normalised per head (`qk_norm`), and the first `rope_fraction` of each head's channels
  turn by rotary position embeddings of base `rope_base` (RecurrentGemma rotates half). Step t
  attends to steps s <= t of its document, within the last `window` steps if `window` is set
  (local attention), with logits q.k / sqrt(head_dim) (or q.k `scale`), soft-capped to
  `logit_cap` * tanh(logit / `logit_cap`) if set. `jax.nn.dot_product_attention` computes it
  (cuDNN's fused kernels on NVIDIA GPUs, XLA elsewhere; soft-capping, which it does not take,
  and float64, which it would round to a float32 softmax, form the logits here), block by
  block of 512 queries, so that memory holds 512 x keys logits at a time; a window limits
  the keys of a block to 512 + window - 1.

  `reset` starts a document, as for the recurrent layers: no step at or after a reset attends
  to a step before it, and rotary positions restart at 0 there, so packed documents give each
  document's own outputs. `mode` is accepted and unused (attention has one form).

  The state is an `AttentionState`: the keys and values of the last `window` steps (local
  attention) or `cache_size` steps (global), so its shape never changes and decoding with
  `step` compiles once. Global attention decodes exactly for documents of up to `cache_size`
  steps; past that the oldest keys leave the cache (a sliding window of `cache_size`), which
  `generate` refuses.
  `initial_state` and `return_state` continue a sequence from a prefill. A NaN or Inf in a
  step's input reaches the outputs that attend to it and nothing else, gradients included.

  Attributes:
    num_heads: query heads.
    num_kv_heads: key/value heads, dividing `num_heads`; None: `num_heads`.
    head_dim: channels per head; None: H / `num_heads`.
    rope_base: the rotary embedding's base (its longest wavelength over 2 pi).
    rope_fraction: the fraction of each head's channels that rotate (0: no positions).
    window: local attention over this many steps (the step itself included); None: global.
    cache_size: the decoding cache of global attention, in steps.
    qk_norm: RMS-normalise queries and keys per head before the rotary positions: False, True
      or "rms" (learned scales w), or "rms_plus_one" (scales 1 + w, w from 0: Qwen3-Next's).
    qk_norm_eps: the epsilon of the query and key norms.
    qk_norm_scope: "head": each head normalised on its own, its scales shared by the heads
      (Qwen3's); "all": the queries of every head together, and the keys, each channel its
      own scale (OLMo 2's).
    output_gate: multiply each head's output by sigmoid of a projection of the input
      (`gate_proj`, as wide as the queries) before the output projection: the gated attention
      of Qwen3-Next and Qwen3.5.
    logit_cap: soft cap of the logits; None: none.
    scale: the factor of q.k in the logits; None: 1 / sqrt(head_dim) (Granite's
      `attention_multiplier` sets it).
    use_bias: biases on the four projections.
    out_bias: a bias on the output projection; None: as `use_bias` (RecurrentGemma has it
      alone, Qwen2 has the other three alone).
    param_dtype: dtype of the parameters.

  References:
    Vaswani et al., "Attention is all you need", 2017; Su et al., "RoFormer: enhanced
    transformer with rotary position embedding", 2021; Ainslie et al., "GQA", 2023; De et al.,
    "Griffin", 2024 (local attention, partial rotary, logit soft-capping).
  """

  num_heads: int = 4
  num_kv_heads: int | None = None
  head_dim: int | None = None
  rope_base: float = 10_000.0
  rope_fraction: float = 1.0
  window: int | None = None
  cache_size: int = 2048
  qk_norm: bool | str = False
  qk_norm_eps: float = EPS
  qk_norm_scope: str = "head"
  output_gate: bool = False
  logit_cap: float | None = None
  scale: float | None = None
  use_bias: bool = False
  out_bias: bool | None = None
  param_dtype: jnp.dtype = jnp.float32

  parameter_groups = common.ParameterGroups(no_decay=frozenset(
      {"q_bias", "k_bias", "v_bias", "gate_bias", "o_bias", "q_norm", "k_norm"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)
