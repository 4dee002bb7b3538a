"""`KimiLinearForCausalLM` checkpoints (moonshotai/Kimi-Linear-48B-A3B-*) as a `SequenceModel`.

Kimi Linear interleaves Kimi Delta Attention with multi-head latent attention by
`layer_types`, each followed by a SwiGLU MLP (the first `first_k_dense_replace` layers, or
"dense" in `mlp_layer_types`) or DeepSeek-V3's mixture of experts; RMSNorms of `rms_norm_eps`
and an untied head. Each layer is two ssmkit blocks, as Jamba's are:

- a mixer block of `ssmkit.layers.KimiDeltaAttention(num_heads=linear_num_heads,
  d_state=linear_head_dim, gate_bias=False)` or `ssmkit.layers.LatentAttention(rope_base=
  None)` (transformers' MLA turns no positions; its latent and query norms have epsilon 1e-6),
  without an MLP;
- a block of `ssmkit.layers.FeedForward`: `kind="swiglu"` of `intermediate_size`, or
  `kind="experts"` with `Experts(scoring="sigmoid", score_bias=True, groups=num_expert_group,
  top_groups=topk_group, routed_scale=routed_scaling_factor, normalize=moe_renormalize,
  shared_width=moe_intermediate_size * num_shared_experts)`.

Its config.json names several fields otherwise than `transformers`' attributes
(`num_experts`, `num_experts_per_token`, `num_expert_group`, `num_shared_experts`,
`moe_renormalize`; the published ones keep the delta-rule layers' sizes in
`linear_attn_config`); `load` reads either, `save` writes what transformers writes. The weights
are the published names: `block_sparse_moe.*` with each expert's `w1`, `w3`, `w2`, the
convolutions apart (`q_conv1d` ...) and the forget gate's `f_a_proj`, `f_b_proj`, `A_log`,
`dt_bias` beside the attention's.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ssmkit._src.layers.experts import Experts
from ssmkit._src.layers.feed_forward import FeedForward
from ssmkit._src.layers.kimi_delta_attention import KimiDeltaAttention
from ssmkit._src.layers.latent_attention import LatentAttention
from ssmkit._src.pretrained import parts
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import CheckpointError, Tensors
from ssmkit._src.pretrained.mamba import FLAX_RMS_EPS, head

ARCHITECTURE = "KimiLinearForCausalLM"
MODEL_TYPE = "kimi_linear"  # what `transformers` reads to pick the architecture
# The tensors that `transformers` keeps in float32 whatever the model's dtype (parts of the
# names in its `_keep_in_fp32_modules_strict`): the routers, their correction biases and the
# delta attention's `dt_bias`.
FLOAT32_TENSORS = ("e_score_correction_bias", "gate.weight", "dt_bias")
# The layers of its models, and the model options it has (`save` checks them).
LAYERS = (KimiDeltaAttention, LatentAttention, FeedForward)
REQUIRED = {"block": "mixer", "norm": "rms", "mlp": "none", "prenorm": True, "pooling": "none",
            "decoder_bias": False, "scale_embeddings": False, "logit_cap": None}
# The epsilon of the latent attention's own norms, whatever the config's.
LATENT_EPS = 1e-6
# Config fields that the checkpoints name otherwise than transformers' attributes: (written,
# attribute).
_NAMES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
          "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
          "moe_renormalize": "norm_topk_prob"}


def _get(fields: Fields, written: str, default: Any) -> Any:
  """The field by its written name, or by transformers' attribute name."""
  return fields.get(written, fields.get(_NAMES[written], default))


def _count(fields: Fields, written: str, default: int) -> int:
  value = _get(fields, written, default)
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise CheckpointError(f"{fields.source}: `{written}` (`{_NAMES[written]}`) must be a positive "
                          f"integer, got {value!r}.")
  return value


def _kinds(fields: Fields, layers: int) -> tuple[list[str], list[str]]:
  """Each layer's mixer ("linear_attention", "full_attention") and MLP ("dense", "sparse")."""
  linear = fields.get("linear_attn_config", {})
  kinds = fields.get("layer_types", None)
  if kinds is None and {"full_attn_layers", "kda_layers"} <= set(linear):
    kinds = [None] * layers
    for name, numbers in (("full_attention", linear["full_attn_layers"]),
                          ("linear_attention", linear["kda_layers"])):
      for number in numbers:  # counted from 1
        if isinstance(number, int) and 1 <= number <= layers:
          kinds[number - 1] = name
  if kinds is None:
    kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
  if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {
      "linear_attention", "full_attention"}:
    raise CheckpointError(f"{fields.source}: `layer_types` (or `linear_attn_config`'s "
                          f"`full_attn_layers` and `kda_layers`) must give 'linear_attention' or "
                          f"'full_attention' for each of the {layers} layers, got {kinds!r}.")
  dense = fields.get("first_k_dense_replace", 1)
  mlps = fields.get("mlp_layer_types", ["dense" if i < dense else "sparse" for i in range(layers)])
  if not isinstance(mlps, list) or len(mlps) != layers or not set(mlps) <= {"dense", "sparse"}:
    raise CheckpointError(f"{fields.source}: `mlp_layer_types` must give 'dense' or 'sparse' for "
                          f"each of the {layers} layers, got {mlps!r}.")
  return kinds, mlps


def options(fields: Fields) -> dict[str, Any]:
  """The `SequenceModel` keyword arguments of a Kimi Linear `config.json`.

  Raises:
    CheckpointError: naming a field whose value ssmkit cannot compute exactly.
  """
  fields.require("hidden_act", "silu")
  features, layers = fields.int("hidden_size"), fields.int("num_hidden_layers")
  eps = fields.float("rms_norm_eps", 1e-5)
  linear = Fields({**fields.values, **{f"linear_{k}": v for k, v in fields.get(
      "linear_attn_config", {}).items()}}, fields.source)
  deltanet = functools.partial(
      KimiDeltaAttention, num_heads=linear.int("linear_num_heads", 32),
      d_state=linear.int("linear_head_dim", 128), expand_v=1,
      d_conv=linear.int("linear_short_conv_kernel_size",
                        fields.int("linear_conv_kernel_dim", 4)),
      norm_eps=eps, gate_bias=False)
  heads = fields.int("num_attention_heads")
  if fields.int("num_key_value_heads", heads) != heads:
    raise CheckpointError(f"{fields.source}: `num_key_value_heads`="
                          f"{fields.get('num_key_value_heads')} is not supported: Kimi Linear's "
                          f"latent attention gives every one of the {heads} heads its key.")
  rope = fields.get("qk_rope_head_dim", 64)
  if isinstance(rope, bool) or not isinstance(rope, int) or rope < 0:
    raise CheckpointError(f"{fields.source}: `qk_rope_head_dim` must be an integer >= 0, got "
                          f"{rope!r}.")
  attention = functools.partial(
      LatentAttention, num_heads=heads, qk_nope_head_dim=fields.int("qk_nope_head_dim", 128),
      qk_rope_head_dim=rope, v_head_dim=fields.int("v_head_dim", 128),
      kv_lora_rank=fields.int("kv_lora_rank", 512),
      q_lora_rank=fields.int("q_lora_rank") if fields.get("q_lora_rank", None) else None,
      rope_base=None, norm_eps=LATENT_EPS, use_bias=bool(fields.get("attention_bias", False)))
  width = fields.int("moe_intermediate_size", 1024)
  try:
    experts = Experts(
        num_experts=_count(fields, "num_experts", 256),
        top_k=_count(fields, "num_experts_per_token", 8), width=width,
        shared_width=width * int(_get(fields, "num_shared_experts", 1) or 0),
        scoring="sigmoid", normalize=bool(_get(fields, "moe_renormalize", True)),
        routed_scale=fields.float("routed_scaling_factor", 1.0), score_bias=True,
        groups=_count(fields, "num_expert_group", 1),
        top_groups=fields.int("topk_group", 1),
        balance_weight=float(fields.get("router_aux_loss_coef", 0.001))
        if fields.get("output_router_logits", False) else 0.0)
  except ValueError as error:
    raise CheckpointError(f"{fields.source} gives experts ssmkit cannot build: {error}") from None
  feed = {"dense": functools.partial(FeedForward, kind="swiglu",
                                     width=fields.int("intermediate_size")),
          "sparse": functools.partial(FeedForward, kind="experts", experts=experts)}
  kinds, mlps = _kinds(fields, layers)
  pattern = []
  for kind, mlp in zip(kinds, mlps, strict=True):
    pattern += [deltanet if kind == "linear_attention" else attention, feed[mlp]]
  vocab = fields.int("vocab_size")
  return dict(num_outputs=vocab, vocab_size=vocab, features=features, num_blocks=2 * layers,
              layer=tuple(pattern), pooling="none", block="mixer", norm="rms", norm_eps=eps,
              mlp="none", tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
              decoder_bias=False)


def params(tensors: Tensors, fields: Fields, model: Any) -> dict[str, Any]:
  """ssmkit's parameters of `model` (from `options`) from the checkpoint's tensors."""
  del fields
  features = model.features

  def read(prefix: str, which: int, layer: Any) -> tuple[str, dict[str, Any]]:
    if which:
      return (f"{prefix}.post_attention_layernorm.weight",
              _feed_forward_params(tensors, f"{prefix}.block_sparse_moe", layer, features))
    mixer = _deltanet_params if isinstance(layer, KimiDeltaAttention) else _latent_params
    return f"{prefix}.input_layernorm.weight", mixer(tensors, f"{prefix}.self_attn", layer,
                                                     features)

  tree = parts.paired_blocks(tensors, model, "model.norm.weight", read)
  return {**tree, **head(tensors, model)}


def _deltanet_params(tensors: Tensors, where: str, layer: KimiDeltaAttention, features: int
                     ) -> dict[str, Any]:
  heads, k = layer.num_heads, layer.d_state
  width = heads * k
  take = lambda name, shape: tensors.take(f"{where}.{name}", shape)
  tree = {f"{n}_proj": take(f"{n}_proj.weight", (width, features)).T for n in "qkv"}
  tree.update({f"{n}_conv": take(f"{n}_conv1d.weight", (width, 1, layer.d_conv))[:, 0, :].T
               for n in "qkv"})
  return {**tree, "f_down": take("f_a_proj.weight", (k, features)).T,
          "f_up": take("f_b_proj.weight", (width, k)).T,
          "b_proj": take("b_proj.weight", (heads, features)).T,
          "A_log": take("A_log", (1, 1, heads, 1)).reshape(heads),
          "dt_bias": take("dt_bias", (width,)),
          "g_down": take("g_a_proj.weight", (k, features)).T,
          "g_up": take("g_b_proj.weight", (width, k)).T,
          "norm_scale": take("o_norm.weight", (k,)),
          "o_proj": take("o_proj.weight", (features, width)).T}


def _latent_params(tensors: Tensors, where: str, layer: LatentAttention, features: int
                   ) -> dict[str, Any]:
  heads, rank, rope = layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim
  qk, v = layer.qk_nope_head_dim + rope, layer.v_head_dim
  take = lambda name, shape: tensors.take(f"{where}.{name}", shape)
  tree = {"kv_down": take("kv_a_proj_with_mqa.weight", (rank + rope, features)).T,
          "kv_norm": take("kv_a_layernorm.weight", (rank,)),
          "kv_up": take("kv_b_proj.weight", (heads * (layer.qk_nope_head_dim + v), rank)).T,
          "o_proj": take("o_proj.weight", (features, heads * v)).T}
  if layer.q_lora_rank is None:
    tree["q_proj"] = take("q_proj.weight", (heads * qk, features)).T
  else:
    tree.update(q_down=take("q_a_proj.weight", (layer.q_lora_rank, features)).T,
                q_norm=take("q_a_layernorm.weight", (layer.q_lora_rank,)),
                q_up=take("q_b_proj.weight", (heads * qk, layer.q_lora_rank)).T)
  if layer.use_bias:
    tree.update(kv_down_bias=take("kv_a_proj_with_mqa.bias", (rank + rope,)),
                o_bias=take("o_proj.bias", (features,)))
    if layer.q_lora_rank is not None:
      tree["q_down_bias"] = take("q_a_proj.bias", (layer.q_lora_rank,))
  return tree


def _feed_forward_params(tensors: Tensors, where: str, layer: FeedForward, features: int
                         ) -> dict[str, Any]:
  take = lambda name, shape: tensors.take(f"{where}.{name}.weight", shape).T
  if layer.kind != "experts":
    return parts.swiglu_feed_forward_params(take, layer.width, features)
  config = layer.experts
  width, shared = config.width, config.shared_width
  stack = lambda name, shape: np.stack([take(f"experts.{e}.{name}", shape)
                                        for e in range(config.num_experts)])
  tree = {"router": take("gate", (config.num_experts, features)),
          "score_bias": tensors.take(f"{where}.gate.e_score_correction_bias",
                                     (config.num_experts,)),
          "gate": stack("w1", (width, features)), "up": stack("w3", (width, features)),
          "down": stack("w2", (features, width))}
  if shared:
    tree.update(shared_gate=take("shared_experts.gate_proj", (shared, features)),
                shared_up=take("shared_experts.up_proj", (shared, features)),
                shared_down=take("shared_experts.down_proj", (features, shared)))
  return tree


def checkpoint(model: Any, blocks: list[dict[str, Any]], params: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """`(config.json fields, tensors)` of Kimi Linear's layers.

  Raises:
    CheckpointError: naming the option that `transformers`' Kimi Linear does not have.
  """
  features = model.features
  made = parts.pattern_layers(model)
  layers = model.num_blocks // 2
  mixers = [made[(2 * i) % len(made)] for i in range(layers)]
  feeds = [made[(2 * i + 1) % len(made)] for i in range(layers)]
  eps = FLAX_RMS_EPS if model.norm_eps is None else model.norm_eps
  _expect(model.num_blocks % 2 == 0 and all(not isinstance(m, FeedForward) for m in mixers)
          and all(isinstance(f, FeedForward) for f in feeds), "layer",
          "a pattern alternating KimiDeltaAttention or LatentAttention with FeedForward")
  fields: dict[str, Any] = {
      "model_type": MODEL_TYPE, "hidden_size": features, "num_hidden_layers": layers,
      "rms_norm_eps": eps, "hidden_act": "silu", "tie_word_embeddings": model.tie_embeddings,
      "layer_types": ["linear_attention" if isinstance(m, KimiDeltaAttention)
                      else "full_attention" for m in mixers],
      "mlp_layer_types": ["sparse" if f.kind == "experts" else "dense" for f in feeds]}
  deltanets = {_deltanet_settings(m) for m in mixers if isinstance(m, KimiDeltaAttention)}
  _expect(len(deltanets) <= 1 and all(s[3:] == (1, None, None, False, eps, False)
                                      for s in deltanets), "KimiDeltaAttention",
          f"the same in every layer, d_state given, expand_v=1, one value head per head, "
          f"without lower_bound, allow_neg_eigval or gate_bias, norm_eps={eps}")
  for heads, k, d_conv, *_ in deltanets:
    fields.update(linear_num_heads=heads, linear_head_dim=k, linear_conv_kernel_dim=d_conv)
  latents = {_latent_settings(m) for m in mixers if isinstance(m, LatentAttention)}
  _expect(len(latents) <= 1 and all(s[7:] == (None, None, None, None, LATENT_EPS)
                                    for s in latents), "LatentAttention",
          f"the same in every layer, global, without rotary positions (rope_base None), "
          f"logit_cap or scale, norm_eps={LATENT_EPS}")
  for heads, nope, rope, v, rank, q_rank, use_bias, *_ in latents:
    fields.update(num_attention_heads=heads, num_key_value_heads=heads, qk_nope_head_dim=nope,
                  qk_rope_head_dim=rope, v_head_dim=v, kv_lora_rank=rank, q_lora_rank=q_rank,
                  attention_bias=use_bias)
  for feed in feeds:
    if feed.kind == "experts":
      config = feed.experts
      _expect((config.scoring, config.score_bias, config.activation, config.shared_gate) == (
          "sigmoid", True, "swiglu", False) and config.shared_width % config.width == 0,
              "the experts", "sigmoid-scored SwiGLU experts with a score bias, their shared "
              "experts ungated and a multiple of their width")
      fields.update(num_experts=config.num_experts, num_experts_per_token=config.top_k,
                    moe_intermediate_size=config.width,
                    num_shared_experts=config.shared_width // config.width,
                    moe_renormalize=config.normalize,
                    routed_scaling_factor=config.routed_scale, num_expert_group=config.groups,
                    topk_group=config.top_groups, output_router_logits=bool(config.balance_weight),
                    router_aux_loss_coef=config.balance_weight or 0.001)
    else:
      _expect(feed.kind == "swiglu" and not feed.use_bias, "FeedForward",
              "kind='swiglu' without biases, or experts")
      fields["intermediate_size"] = feed.width or 4 * features
  tensors = parts.embedding_norm_and_head_tensors(model, params, "model.norm.weight")
  for i in range(layers):
    prefix, first, second = f"model.layers.{i}", blocks[2 * i], blocks[2 * i + 1]
    mixer = first["mixer"]
    named = _deltanet_tensors(mixer) if "A_log" in mixer else _latent_tensors(mixer)
    tensors.update({f"{prefix}.input_layernorm.weight": first["norm"]["RMSNorm_0"]["scale"],
                    f"{prefix}.post_attention_layernorm.weight":
                        second["norm"]["RMSNorm_0"]["scale"],
                    **parts.scoped(f"{prefix}.self_attn", named),
                    **parts.scoped(f"{prefix}.block_sparse_moe",
                                   _feed_forward_tensors(second["mixer"]))})
  return fields, tensors


def _deltanet_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  tensors = {f"{n}_proj.weight": mixer[f"{n}_proj"].T for n in "qkvb"}
  tensors.update({f"{n}_conv1d.weight": mixer[f"{n}_conv"].T[:, None, :] for n in "qkv"})
  tensors.update({"f_a_proj.weight": mixer["f_down"].T, "f_b_proj.weight": mixer["f_up"].T,
                  "A_log": mixer["A_log"].reshape(1, 1, -1, 1), "dt_bias": mixer["dt_bias"],
                  "g_a_proj.weight": mixer["g_down"].T, "g_b_proj.weight": mixer["g_up"].T,
                  "o_norm.weight": mixer["norm_scale"], "o_proj.weight": mixer["o_proj"].T})
  return tensors


def _latent_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  names = {"q_proj": "q_proj.weight", "q_down": "q_a_proj.weight",
           "q_up": "q_b_proj.weight", "kv_down": "kv_a_proj_with_mqa.weight",
           "kv_up": "kv_b_proj.weight", "o_proj": "o_proj.weight"}
  tensors = {name: mixer[key].T for key, name in names.items() if key in mixer}
  tensors.update({name: mixer[key] for key, name in (
      ("q_norm", "q_a_layernorm.weight"), ("kv_norm", "kv_a_layernorm.weight"),
      ("q_down_bias", "q_a_proj.bias"), ("kv_down_bias", "kv_a_proj_with_mqa.bias"),
      ("o_bias", "o_proj.bias")) if key in mixer})
  return tensors


def _feed_forward_tensors(mixer: dict[str, Any]) -> dict[str, np.ndarray]:
  if "router" not in mixer:
    return parts.swiglu_feed_forward_tensors(mixer)
  tensors = {"gate.weight": mixer["router"].T,
             "gate.e_score_correction_bias": mixer["score_bias"]}
  for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
    for e, weight in enumerate(mixer[ours]):
      tensors[f"experts.{e}.{theirs}.weight"] = weight.T
  for name in ("gate", "up", "down"):
    if f"shared_{name}" in mixer:
      tensors[f"shared_experts.{name}_proj.weight"] = mixer[f"shared_{name}"].T
  return tensors


def _deltanet_settings(layer: KimiDeltaAttention) -> tuple[Any, ...]:
  return (layer.num_heads, layer.d_state, layer.d_conv, layer.expand_v,
          None if layer.num_v_heads in (None, layer.num_heads) else layer.num_v_heads,
          layer.lower_bound, layer.allow_neg_eigval, layer.norm_eps, layer.gate_bias)


def _latent_settings(layer: LatentAttention) -> tuple[Any, ...]:
  return (layer.num_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim,
          layer.kv_lora_rank, layer.q_lora_rank, layer.use_bias, layer.rope_base, layer.window,
          layer.logit_cap, layer.scale, layer.norm_eps)


_expect = functools.partial(parts.expect, ARCHITECTURE)
