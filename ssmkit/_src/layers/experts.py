"""A mixture of experts in place of a block's MLP: a router picks `top_k` of `num_experts`
MLPs per token, whose outputs it weighs and sums, beside optional shared experts that every
token passes.

The maths are pure functions of an `Experts` configuration and a dict of parameters
(`param_specs`, `mixture`); `MixtureOfExperts` is the linen module a `MixerBlock` builds with
`mlp="experts"` (and `ssmkit.layers.FeedForward(kind="experts")` a layer of them), and
`ssmkit.nnx` has its twin. The chosen experts run as grouped matrix
products (`jax.lax.ragged_dot`): the token copies sorted by expert, each expert's rows one group,
no loop over experts and no capacity (no token is dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ssmkit._src.layers import common
from ssmkit._src.layers.common import ParamSpec
from ssmkit._src.linear_recurrence import accumulation_dtype

Array = jax.Array

SCORINGS = ("softmax", "sigmoid")
# Each expert's MLP: down(silu(gate x) * up x), or down(relu(up x)^2) (Nemotron-H's).
ACTIVATIONS = ("swiglu", "relu2")
# The collection and name under which the load-balancing loss of each mixture is sown.
AUX_LOSS = "aux_loss"


@dataclasses.dataclass(frozen=True)
class Experts:
  """The configuration of a mixture of experts (`SequenceModel(mlp="experts", experts=...)`).

  Per token x, the router's logits are l = x W_r (`num_experts` of them) and its scores
  s = softmax(l) or sigmoid(l) (`scoring`, in float32 for bfloat16 tokens). The `top_k`
  experts of the largest s + b are chosen (b: a learned `score_bias` that moves the choice
  only, DeepSeek-V3's correction; with `groups` > 1 the experts are split into that many
  groups, each scored by the sum of its two largest, and the choice is among the experts of
  the best `top_groups` groups). Their weights are their scores s, divided by their sum if
  `normalize`, times `routed_scale`; the output is

    y = sum over chosen e of w_e mlp_e(x) + [sigmoid(x w_s) if `shared_gate`] * shared(x),

  each expert an MLP of hidden `width`, the shared experts one of `shared_width` (0: none),
  without biases: SwiGLU, down(silu(gate x) * up x), or with `activation` "relu2"
  down(relu(up x)^2), Nemotron-H's.

  The load-balancing loss of Switch Transformer, E sum_e f_e P_e (f_e the fraction of chosen
  (token, slot) pairs that went to e over `top_k`, P_e the mean score; 1 when balanced) times
  `balance_weight`, is sown in the "aux_loss" collection, which `ssmkit.train` adds to its loss.

  Every leading axis of the inputs is a token axis. `jax.vmap` works where the parameters are
  mapped too (an ensemble); over tokens with shared parameters, jax's `ragged_dot` (0.10,
  0.11) has no batching rule, and a `NotImplementedError` says so: give the mapped axis to the
  mixture as a leading axis instead.

  Attributes:
    num_experts: the routed experts E.
    top_k: experts per token.
    width: each expert's hidden width.
    shared_width: the shared experts' hidden width; 0: none.
    shared_gate: scale the shared experts' output by sigmoid of a learned projection of the
      token (Qwen3-Next's `shared_expert_gate`).
    scoring: "softmax" or "sigmoid" scores.
    normalize: divide the chosen weights by their sum (`norm_topk_prob`).
    routed_scale: the factor on the chosen weights (`routed_scaling_factor`).
    score_bias: a learned per-expert bias added to the scores for the choice alone.
    groups: expert groups of the grouped choice; 1: none.
    top_groups: the groups the choice keeps, with `groups` > 1.
    balance_weight: the weight of the load-balancing loss; 0: none is sown.
    activation: the experts' MLP, "swiglu" or "relu2".
  """

  num_experts: int = 8
  top_k: int = 2
  width: int = 256
  shared_width: int = 0
  shared_gate: bool = False
  scoring: str = "softmax"
  normalize: bool = True
  routed_scale: float = 1.0
  score_bias: bool = False
  groups: int = 1
  top_groups: int = 1
  balance_weight: float = 0.0
  activation: str = "swiglu"

  def __post_init__(self):
    for name in ("num_experts", "top_k", "width", "groups", "top_groups"):
      common.check_positive_int(getattr(self, name), name)
    if isinstance(self.shared_width, bool) or not isinstance(self.shared_width, int) or (
        self.shared_width < 0):
      raise ValueError(f"`shared_width` must be an int >= 0, got {self.shared_width!r}.")
    if self.scoring not in SCORINGS:
      raise ValueError(f"`scoring` must be one of {SCORINGS}, got {self.scoring!r}.")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"`activation` must be one of {ACTIVATIONS}, got {self.activation!r}.")
    if self.top_k > self.num_experts:
      raise ValueError(f"`top_k`={self.top_k} must be at most `num_experts`={self.num_experts}.")
    if self.num_experts % self.groups or self.top_groups > self.groups:
      raise ValueError(f"`groups`={self.groups} must divide `num_experts`={self.num_experts} and "
                       f"be at least `top_groups`={self.top_groups}.")
    if self.groups > 1 and self.top_k > self.top_groups * (self.num_experts // self.groups):
      raise ValueError(f"`top_k`={self.top_k} must be at most the experts of the `top_groups`="
                       f"{self.top_groups} groups kept.")
    if not self.routed_scale > 0 or not self.balance_weight >= 0:
      raise ValueError(f"`routed_scale` must be > 0 and `balance_weight` >= 0, got "
                       f"{self.routed_scale!r} and {self.balance_weight!r}.")
    if self.shared_gate and not self.shared_width:
      raise ValueError("`shared_gate` gates the shared experts: it needs `shared_width` > 0.")


def param_specs(config: Experts, features: int) -> dict[str, ParamSpec]:
  """The router's, experts' and shared experts' parameters for `features` channels, drawn as
  flax's `Dense` kernels (LeCun normal over each matrix's input width)."""
  lecun = nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=-2, out_axis=-1)
  experts, width = config.num_experts, config.width
  specs = {"router": ParamSpec((features, experts), lecun)}
  if config.score_bias:
    specs["score_bias"] = ParamSpec((experts,), nn.initializers.zeros)
  gated = config.activation == "swiglu"
  if gated:
    specs["gate"] = ParamSpec((experts, features, width), lecun)
  specs.update(up=ParamSpec((experts, features, width), lecun),
               down=ParamSpec((experts, width, features), lecun))
  if config.shared_width:
    shared = config.shared_width
    if gated:
      specs["shared_gate"] = ParamSpec((features, shared), lecun)
    specs.update(shared_up=ParamSpec((features, shared), lecun),
                 shared_down=ParamSpec((shared, features), lecun))
    if config.shared_gate:
      specs["shared_router"] = ParamSpec((features, 1), lecun)
  return specs


def route(config: Experts, params: dict[str, Array], x: Array) -> tuple[Array, Array, Array]:
  """The choice of each token of `x` `(N, H)`: `(weights (N, top_k), experts (N, top_k) int32,
  scores (N, E))`, the weights and scores in x's accumulation dtype (float32 for bfloat16)."""
  logits = common.project(x, params["router"], x.dtype)
  scores = jax.nn.softmax(logits) if config.scoring == "softmax" else jax.nn.sigmoid(logits)
  choice = scores + params["score_bias"][None] if config.score_bias else scores
  if config.groups > 1:
    grouped = choice.reshape(*choice.shape[:-1], config.groups, config.num_experts // config.groups)
    best = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(-1), config.top_groups)[1]
    kept = jnp.zeros(grouped.shape[:-1], bool).at[
        jnp.arange(grouped.shape[0])[:, None], best].set(True)
    choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
  _, experts = jax.lax.top_k(choice, config.top_k)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if config.normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights * config.routed_scale, experts.astype(jnp.int32), scores


def mixture(config: Experts, params: dict[str, Array], x: Array, dtype: Any,
            axis_name: Hashable | None = None) -> tuple[Array, Array]:
  """The mixture over `(..., H)` inputs: `(y (..., H) in x's accumulation dtype, load-balancing
  loss () float32)`.

  Args:
    config: the mixture's configuration.
    params: its parameters (`param_specs`).
    x: the tokens, any leading axes.
    dtype: the computation dtype of the products (`common.computation_dtype`).
    axis_name: the mesh axis the tokens' time axis is split over, if any: the loss's counts
      and mean scores are taken over every device's tokens.
  """
  shape = x.shape
  tokens = x.reshape(-1, shape[-1]).astype(dtype)
  weights, experts, scores = route(config, params, tokens)
  # Each (token, slot) pair once, sorted by expert: one group of rows per expert.
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  rows = tokens[order // config.top_k]
  sizes = jnp.bincount(flat, length=config.num_experts).astype(jnp.int32)
  wide = accumulation_dtype(dtype)

  def grouped(a: Array, name: str) -> Array:
    try:
      return jax.lax.ragged_dot(a.astype(dtype), params[name].astype(dtype), sizes,
                                preferred_element_type=wide)
    except NotImplementedError as error:
      if "vmap" not in str(error):
        raise
      raise NotImplementedError(
          "A mixture of experts under `jax.vmap` over its tokens, with parameters shared across "
          "the mapped axis: jax's `ragged_dot` has no batching rule for that. Give the mapped "
          "axis to the model as a leading axis of its inputs instead (every leading axis is a "
          "token axis).") from error

  out = _mlp(config, rows, grouped, "") * weights.reshape(-1)[order][:, None].astype(wide)
  y = jnp.zeros_like(out).at[order].set(out).reshape(*experts.shape, out.shape[-1]).sum(axis=-2)
  if config.shared_width:
    project = lambda a, name: common.project(a, params[name], dtype)
    shared = _mlp(config, tokens, project, "shared_")
    if config.shared_gate:
      shared = shared * jax.nn.sigmoid(project(tokens, "shared_router"))
    y = y + shared
  return y.reshape(*shape[:-1], y.shape[-1]), _balance(config, sizes, scores, axis_name)


def _mlp(config: Experts, x: Array, product: Any, prefix: str) -> Array:
  """An expert's MLP of `config.activation` on `x`, `product(a, name)` multiplying by the
  parameter `prefix + name`."""
  if config.activation == "relu2":
    return product(jnp.square(jax.nn.relu(product(x, prefix + "up"))), prefix + "down")
  hidden = jax.nn.silu(product(x, prefix + "gate")) * product(x, prefix + "up")
  return product(hidden, prefix + "down")


def _balance(config: Experts, sizes: Array, scores: Array, axis_name: Hashable | None) -> Array:
  """Switch Transformer's load-balancing loss E sum_e f_e P_e / top_k: f_e the tokens routed to
  e over all tokens (summing to top_k), P_e the mean score of e."""
  counts = jnp.stack([sizes.astype(jnp.float32), scores.sum(0)])
  total = jnp.asarray(scores.shape[0], jnp.float32)
  if axis_name is not None:
    counts, total = jax.lax.psum((counts, total), axis_name)
  share, mean = counts / jnp.maximum(total, 1.0)
  return config.num_experts * jnp.sum(share * mean) / config.top_k


def sow_balance(owner: Any, config: Experts, balance: Array) -> None:
  """Sows `config.balance_weight` x `balance` on `owner`, a linen module (appended to
  "aux_loss"/"load_balancing", read with `mutable=["aux_loss"]`) or an NNX one (the
  `nnx.Intermediate` "load_balancing", which each call replaces, so that its state keeps one
  shape across calls); nothing when the weight is 0."""
  if not config.balance_weight:
    return
  value = config.balance_weight * balance
  if isinstance(owner, nn.Module):
    owner.sow(AUX_LOSS, "load_balancing", value)
    return
  from flax import nnx

  owner.sow(nnx.Intermediate, "load_balancing", value, init_fn=lambda: jnp.zeros((), value.dtype),
            reduce_fn=lambda _, new: new)


class MixtureOfExperts(nn.Module):
  """A mixture of experts as a linen module: `(..., H)` -> `(..., H)` (see `Experts`).

  Sows its weighted load-balancing loss in the collection "aux_loss" when
  `config.balance_weight` > 0 (pass `mutable=["aux_loss"]` to `apply` to read it;
  `sow_balance`).

  Attributes:
    config: the mixture's configuration.
    dtype: the computation dtype; None: the inputs'.
    param_dtype: the parameters' dtype.
  """

  config: Experts
  dtype: Any = None
  param_dtype: Any = jnp.float32

  parameter_groups = common.ParameterGroups(no_decay=frozenset({"score_bias"}))

  @nn.compact
  def __call__(self, x: Array, axis_name: Hashable | None = None) -> Array:
    params = common.linen_params(self, param_specs(self.config, x.shape[-1]), self.param_dtype)
    dtype = common.computation_dtype(x.dtype if self.dtype is None else self.dtype)
    y, balance = mixture(self.config, params, x, dtype, axis_name)
    sow_balance(self, self.config, balance)
    return y.astype(x.dtype if self.dtype is None else self.dtype)
