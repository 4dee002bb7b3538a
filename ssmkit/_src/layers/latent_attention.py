"""Multi-head latent attention (DeepSeek-V2's MLA, Kimi Linear's attention): keys and values
come up from one low-rank latent per step, so the cache holds the latent, not every head's
keys and values."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common, functional
from ssmkit._src.layers.attention import AttentionState, Core, attend, capacity
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.layers.norms import rms_norm
from ssmkit._src.modes import Mode

Array = jax.Array


def _check(cfg: Any) -> None:
  for name in ("num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "cache_size"):
    common.check_positive_int(getattr(cfg, name), name)
  for name in ("q_lora_rank", "window"):
    if getattr(cfg, name) is not None:
      common.check_positive_int(getattr(cfg, name), name)
  rope = cfg.qk_rope_head_dim
  if isinstance(rope, bool) or not isinstance(rope, int) or rope < 0 or (
      rope % 2 and cfg.rope_base is not None):
    raise ValueError(f"`qk_rope_head_dim` must be an int >= 0, even where it rotates "
                     f"(`rope_base` given), got {rope!r}.")
  if cfg.rope_base is not None and not cfg.rope_base > 0:
    raise ValueError(f"`rope_base` must be > 0 or None, got {cfg.rope_base!r}.")
  for name in ("scale", "logit_cap"):
    if getattr(cfg, name) is not None and not getattr(cfg, name) > 0:
      raise ValueError(f"`{name}` must be > 0 or None, got {getattr(cfg, name)!r}.")
  if not cfg.norm_eps > 0:
    raise ValueError(f"`norm_eps` must be > 0, got {cfg.norm_eps!r}.")


def param_specs(cfg: Any, features: int) -> dict[str, ParamSpec]:
  """The projections (and latent norms, biases) of latent attention over `features` channels."""
  _check(cfg)
  heads, rank = cfg.num_heads, cfg.kv_lora_rank
  qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  lecun = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
  ones, zeros = nn.initializers.ones, nn.initializers.zeros
  specs = {}
  if cfg.q_lora_rank is None:
    specs["q_proj"] = ParamSpec((features, heads * qk), lecun)
  else:
    specs.update(q_down=ParamSpec((features, cfg.q_lora_rank), lecun),
                 q_norm=ParamSpec((cfg.q_lora_rank,), ones),
                 q_up=ParamSpec((cfg.q_lora_rank, heads * qk), lecun))
    if cfg.use_bias:
      specs["q_down_bias"] = ParamSpec((cfg.q_lora_rank,), zeros)
  specs.update(kv_down=ParamSpec((features, rank + cfg.qk_rope_head_dim), lecun),
               kv_norm=ParamSpec((rank,), ones),
               kv_up=ParamSpec((rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)), lecun),
               o_proj=ParamSpec((heads * cfg.v_head_dim, features), lecun))
  if cfg.use_bias:
    specs.update(kv_down_bias=ParamSpec((rank + cfg.qk_rope_head_dim,), zeros),
                 o_bias=ParamSpec((features,), zeros))
  return specs


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> AttentionState:
  """An empty cache for inputs `(*batch, H)`: per step the latent with the shared rotary key,
  `(qk_rope_head_dim + kv_lora_rank)` keys and `kv_lora_rank` values, one head."""
  *batch, _ = input_shape
  size, rank = capacity(cfg), cfg.kv_lora_rank
  return AttentionState(jnp.zeros((*batch, size, 1, cfg.qk_rope_head_dim + rank), jnp.float32),
                        jnp.zeros((*batch, size, 1, rank), jnp.float32),
                        jnp.zeros((*batch, size), bool), jnp.zeros(tuple(batch), jnp.int32))


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: AttentionState | None = None,
             axis_name: Hashable | None = None) -> tuple[Array, AttentionState]:
  """Latent attention over `(..., T, H)` inputs (`mode` unused): `(y, cache after the last step)`."""
  del mode
  *batch, length, features = x.shape
  rows = math.prod(batch)
  state = functional.starting_state(initialize_state, cfg, x, initial_state)
  state = jax.tree.map(lambda s: s.reshape((rows, *s.shape[len(batch):])), state)
  if length == 0:
    unflat = jax.tree.map(lambda s: s.reshape((*batch, *s.shape[1:])), state)
    return jnp.zeros(x.shape, x.dtype), unflat
  heads, rank = cfg.num_heads, cfg.kv_lora_rank
  nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  xf = x.reshape(rows, length, features)
  dtype = common.computation_dtype(x.dtype)
  reset = jnp.zeros((rows, length), bool) if reset is None else reset.reshape(rows, length)

  def dense(u: Array, name: str) -> Array:
    y = common.project(u, params[name], dtype)
    return y + common.leading_ones(params[f"{name}_bias"], y.ndim) if f"{name}_bias" in params else y

  if cfg.q_lora_rank is None:
    q = dense(xf, "q_proj")
  else:
    q = dense(rms_norm(dense(xf, "q_down"), params["q_norm"], cfg.norm_eps), "q_up")
  q = q.reshape(rows, length, heads, nope + rope)
  latent, k_rot = jnp.split(dense(xf, "kv_down"), [rank], axis=-1)
  latent = rms_norm(latent, params["kv_norm"], cfg.norm_eps)
  up = params["kv_up"].reshape(rank, heads, nope + v_dim).astype(dtype)
  # The key up-projection moves onto the queries: q_nope . (W_k c) = (W_k^T q_nope) . c, so every
  # head reads the one latent per step that the cache holds, [rotary key | latent].
  absorbed = jnp.einsum("bthn,rhn->bthr", q[..., :nope].astype(dtype), up[..., :nope],
                        preferred_element_type=latent.dtype)
  queries = jnp.concatenate([q[..., nope:], absorbed], axis=-1)
  keys = jnp.concatenate([k_rot, latent], axis=-1)[:, :, None]
  core = Core(cfg.window, cfg.cache_size, cfg.logit_cap,
              (nope + rope) ** -0.5 if cfg.scale is None else cfg.scale,
              10_000.0 if cfg.rope_base is None else cfg.rope_base)
  out, final = attend(core, queries, keys, latent[:, :, None], reset, state,
                      cached=initial_state is not None, axis_name=axis_name,
                      width=0 if cfg.rope_base is None else rope)
  # ... and the value up-projection follows the weighted latents.
  out = jnp.einsum("bthr,rhv->bthv", out.astype(dtype), up[..., nope:],
                   preferred_element_type=out.dtype)
  y = dense(out.reshape(rows, length, heads * v_dim), "o_proj")
  final = jax.tree.map(lambda s: s.reshape((*batch, *s.shape[1:])), final)
  return y.reshape(*batch, length, features).astype(x.dtype), final


def step(cfg: Any, params: dict[str, Array], state: AttentionState, x_t: Array,
         reset: Array | None = None) -> tuple[AttentionState, Array]:
  """One decoding step on `(*batch, H)` inputs: `(cache, y_t)`."""
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class LatentAttention(functional.LinenLayer):
  """Multi-head latent attention: `(..., T, H)` -> `(..., T, H)`.

  Per step, each of `num_heads` heads has a query of `qk_nope_head_dim` + `qk_rope_head_dim`
  channels (a projection of the input, or with `q_lora_rank` one through a normalised
  bottleneck); one latent c = RMSNorm(W_dkv x) of `kv_lora_rank` channels and one rotary key
  k_r of `qk_rope_head_dim` channels, shared by the heads, come from the input; each head's key
  is [W_k,h c | k_r] and its value W_v,h c (`kv_up` holds [W_k,h | W_v,h] per head). Logits are
  q.k (qk_nope_head_dim + qk_rope_head_dim)^-1/2 (or `scale`), causal within each document
  (and the last `window` steps if set); the heads' outputs are projected back to H.

  It is computed with the key up-projection moved onto the queries and the value
  up-projection after the weights (DeepSeek-V2's absorbed form), so the state is a cache of
  `cache_size` (or `window`) steps of what MLA compresses: per step the rotary key and the
  latent, `qk_rope_head_dim + kv_lora_rank` channels as keys and the latent again as values
  (`AttentionState` with one key/value head), against `num_heads` x (qk + v) channels of
  multi-head attention. Every step attends over `kv_lora_rank + qk_rope_head_dim` channels per
  head; training pays that against the expanded form's `qk_nope + qk_rope`.

  The rotary key and the queries' last `qk_rope_head_dim` channels turn by rotary positions
  of base `rope_base` (rotate-half layout), or not at all for None (Kimi Linear's MLA, whose
  positions come from its delta-rule layers). Resets start documents, a NaN reaches only the
  outputs that attend to it, and sequence parallelism splits time as `Attention`'s.

  Attributes:
    num_heads: query heads.
    qk_nope_head_dim: each head's query/key channels without positions.
    qk_rope_head_dim: each head's query/key channels with rotary positions (0: none).
    v_head_dim: each head's value channels.
    kv_lora_rank: the latent's channels.
    q_lora_rank: the queries' bottleneck; None: a plain projection.
    rope_base: the rotary base; None: no positions.
    window: local attention over this many steps; None: global.
    cache_size: the decoding cache of global attention, in steps.
    logit_cap: soft cap of the logits; None: none.
    scale: the logits' factor; None: (qk_nope_head_dim + qk_rope_head_dim)^-1/2.
    norm_eps: the epsilon of the latent's (and the queries' bottleneck's) RMSNorm.
    use_bias: biases on the down-projections and the output projection.
    param_dtype: dtype of the parameters.

  References:
    DeepSeek-AI, "DeepSeek-V2: a strong, economical, and efficient mixture-of-experts
    language model", 2024 (arXiv:2405.04434); Kimi Team, "Kimi Linear", 2025
    (arXiv:2510.26692); `transformers`' `KimiLinearAttention`.
  """

  num_heads: int = 4
  qk_nope_head_dim: int = 32
  qk_rope_head_dim: int = 16
  v_head_dim: int = 32
  kv_lora_rank: int = 64
  q_lora_rank: int | None = None
  rope_base: float | None = 10_000.0
  window: int | None = None
  cache_size: int = 2048
  logit_cap: float | None = None
  scale: float | None = None
  norm_eps: float = 1e-6
  use_bias: bool = False
  param_dtype: jnp.dtype = jnp.float32

  parameter_groups = common.ParameterGroups(no_decay=frozenset(
      {"q_norm", "kv_norm", "q_down_bias", "kv_down_bias", "o_bias"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)
