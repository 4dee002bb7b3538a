"""`ssmkit bench training`: one optimizer step of every shipped language-model config, and the
memory per device of a 1B-parameter language model under fully sharded data parallelism.

Throughput: each `lm_*` config's model and optimizer, built as `ssmkit train` builds them, takes
one jitted `train_step` (forward, backward, gradient clipping and AdamW) on a batch of the
config's shape (`data.batch_size` rows of `data.seq_len` byte tokens, documents starting at
random steps); the table gives the median time of a step, tokens per second and XLA's
temporary memory of the step.

Memory: `lm_gated_deltanet` widened to 2048 with 17 blocks under `nn.scan` (1.0B parameters)
is compiled, not run, for a train step of one 2048-token row per device on meshes of
`data` x `fsdp` devices: the parameters and AdamW state each device holds (from the run's own
shardings, `mesh.fsdp`), and XLA's arguments and temporary buffers of the compiled step per
device.

Families: a model of about 1B parameters of each family `ssmkit.pretrained` loads (its
config.json fields in `FAMILIES`, built as `load(..., scan_blocks=True)` builds it: blocks
under `nn.scan`, one period of its layer pattern per repeat) is compiled the same way, fully
sharded over every device, as a fine-tuning run from such a checkpoint trains it; the families
with experts once more with them split over an "expert" axis of `EXPERT_SPLIT` devices.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ssmkit import data, layers, train
from ssmkit._src.layers.model import layer_pattern, with_scanned_blocks
from ssmkit._src.layers.registry import registry_name
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.load import MODEL_TYPES
from ssmkit._src.train.core import parallel
from ssmkit._src.train.core.model import build_model, layer_names
from ssmkit._src.train.supervised.optim import make_optimizer
from ssmkit._src.train.supervised.steps import create_train_state, train_step
from ssmkit.bench import _timing

# Overrides of the configs per suite: "small" shrinks every model and batch to seconds.
SUITES: dict[str, tuple[str, ...]] = {
    "full": (),
    "small": ("model.features=16", "model.num_blocks=2", "data.batch_size=2", "data.seq_len=16"),
}
# The 1B-parameter model of the memory table, and its "small" stand-in.
LARGE: dict[str, tuple[str, ...]] = {
    "full": ("model.features=2048", "model.num_blocks=17", "model.layer_kwargs.num_heads=8",
             "model.scan_blocks=true", "data.seq_len=2048"),
    "small": ("model.features=16", "model.num_blocks=2", "model.scan_blocks=true",
              "data.seq_len=16"),
}
# A model of about 1B parameters of each family `ssmkit.pretrained` loads, as its config.json
# fields (a vocabulary of 32,000), and the families of the "small" suite (shrunk to seconds).
_WIDE = {"vocab_size": 32000, "hidden_size": 2048, "rms_norm_eps": 1e-6}
_MAMBA2 = {"mamba_n_heads": 64, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
           "mamba_d_conv": 4, "mamba_expand": 2}
_QWEN = {**_WIDE, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
         "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
         "linear_value_head_dim": 128}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "Qwen3.5": ("qwen3_5_text", {**_QWEN, "num_hidden_layers": 16, "intermediate_size": 6144}),
    "Qwen3-Next": ("qwen3_next", {**_QWEN, "num_hidden_layers": 8, "intermediate_size": 6144,
                                  "num_experts": 32, "num_experts_per_tok": 4,
                                  "moe_intermediate_size": 512,
                                  "shared_expert_intermediate_size": 1024}),
    "Bamba": ("bamba", {**_WIDE, **_MAMBA2, "num_hidden_layers": 24, "intermediate_size": 4096,
                        "num_attention_heads": 16, "num_key_value_heads": 4,
                        "attn_layer_indices": [6, 12, 18]}),
    "Granite 4.0": ("granitemoehybrid", {
        **_WIDE, **_MAMBA2, "num_hidden_layers": 12, "intermediate_size": 512,
        "num_attention_heads": 16, "num_key_value_heads": 4, "num_local_experts": 16,
        "num_experts_per_tok": 4, "shared_intermediate_size": 1024,
        "position_embedding_type": "rope", "layer_types": ["linear_attention"] * 5
        + ["full_attention"] + ["linear_attention"] * 5 + ["full_attention"]}),
    "Nemotron-H": ("nemotron_h", {
        **_WIDE, "hybrid_override_pattern": "M-M-M*-M-M-M*-M-M-M*-", "intermediate_size": 8192,
        "mlp_hidden_act": "relu2", "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 128, "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8,
        "ssm_state_size": 128}),
    "Jamba": ("jamba", {**_WIDE, "num_hidden_layers": 8, "intermediate_size": 4096,
                        "num_attention_heads": 16, "num_key_value_heads": 4, "num_experts": 8,
                        "num_experts_per_tok": 2, "attn_layer_period": 4,
                        "attn_layer_offset": 2, "expert_layer_period": 2,
                        "expert_layer_offset": 1}),
    "LFM2": ("lfm2", {**_WIDE, "num_hidden_layers": 16, "intermediate_size": 12288,
                      "num_attention_heads": 32, "num_key_value_heads": 8,
                      "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv"
                                      for i in range(16)]}),
    "OLMo Hybrid": ("olmo_hybrid", {**_WIDE, "num_hidden_layers": 16, "intermediate_size": 6144,
                                    "num_attention_heads": 16, "linear_num_key_heads": 16,
                                    "linear_num_value_heads": 16, "linear_key_head_dim": 96,
                                    "linear_value_head_dim": 192,
                                    "rope_parameters": {"rope_theta": None}}),
    "Kimi Linear": ("kimi_linear", {
        **_WIDE, "num_hidden_layers": 8, "intermediate_size": 6144, "num_attention_heads": 16,
        "num_key_value_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "linear_num_heads": 16,
        "linear_head_dim": 128, "num_experts": 32, "num_experts_per_token": 4,
        "moe_intermediate_size": 512, "num_shared_experts": 1, "num_expert_group": 1,
        "routed_scaling_factor": 2.446}),
    "Falcon-H1": ("falcon_h1", {**_WIDE, "num_hidden_layers": 18, "intermediate_size": 4096,
                                "num_attention_heads": 8, "num_key_value_heads": 2,
                                "head_dim": 128, "mamba_d_ssm": 3072, "mamba_n_heads": 48,
                                "mamba_d_head": 64, "mamba_d_state": 256}),
}
_SMALL_FAMILIES = {"Qwen3-Next": {"hidden_size": 32, "head_dim": 16, "linear_key_head_dim": 8,
                                  "linear_value_head_dim": 8, "num_hidden_layers": 4,
                                  "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8},
                   "Nemotron-H": {"hidden_size": 32, "hybrid_override_pattern": "ME*-",
                                  "intermediate_size": 16, "head_dim": 8, "mamba_num_heads": 4,
                                  "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 8,
                                  "n_routed_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 8,
                                  "moe_shared_expert_intermediate_size": 8}}
# The "expert" axis of the family rows whose mixtures are split over it (of 8 devices).
EXPERT_SPLIT = 4
_HOW_TO_GET_DEVICES = "XLA_FLAGS=--xla_force_host_platform_device_count=8 ssmkit bench training"
_MIB = 2**20


def _setup(config: Any, model: Any = None) -> tuple[Any, dict[str, jax.Array]]:
  """The initial train state of `config`'s model (or of `model`, a pretrained family's) and
  optimizer, and a batch of its shape."""
  if model is None:
    vocab = data.ByteTokenizer().vocab_size
    model, kinds = build_model(config.model, vocab, vocab), layer_names(config.model)
  else:
    vocab, kinds = model.vocab_size, tuple(registry_name(make) for make in
                                           layer_pattern(model.layer))
  tx = make_optimizer(config.optimizer, kinds, config.train.steps, model.head_blocks)
  shape = (config.data.batch_size, config.data.seq_len)
  keys = jax.random.split(jax.random.key(0), 3)
  tokens = jax.random.randint(keys[0], shape, 0, vocab)
  batch = {"x": tokens, "y": jnp.roll(tokens, -1, axis=1),
           "reset": jax.random.bernoulli(keys[1], 1 / 512, shape).at[:, 0].set(True)}
  state = create_train_state(model, tx, {"x": tokens[:1]}, keys[2], config.model.mode)
  return state, batch


def _throughput_rows(names: list[str], overrides: tuple[str, ...], repeats: int
                     ) -> list[tuple[str, ...]]:
  """Times one train step of each config, the configs taking turns."""
  thunks, cells = {}, {}
  for name in names:
    config = train.load_config(name, list(overrides))
    state, batch = _setup(config)
    rng = jax.random.key(1)
    step, _ = _timing.compile_timed(train_step, state, batch, rng)
    thunks[name] = functools.partial(step, state, batch, rng)
    cells[name] = (config, _count(state.params), _timing.temp_bytes(step))
  seconds = _timing.interleaved_medians(thunks, repeats=repeats)
  rows = []
  for name in names:
    config, params, temp = cells[name]
    tokens = config.data.batch_size * config.data.seq_len
    rows.append((name, f"{params:,}", f"{config.data.batch_size}x{config.data.seq_len}",
                 _timing.significant(seconds[name] * 1e3),
                 f"{tokens / seconds[name]:,.0f}",
                 "-" if temp is None else _timing.significant(temp / _MIB)))
  return rows


def _count(tree: Any) -> int:
  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


def _held_bytes(tree: Any, shardings: Any) -> int:
  """Bytes of `tree` (shapes) that one device holds under `shardings`."""
  held = jax.tree.map(lambda leaf, where: int(np.prod(where.shard_shape(leaf.shape)))
                      * leaf.dtype.itemsize, tree, shardings)
  return sum(jax.tree.leaves(held))


def _family_model(name: str, shapes: str) -> Any:
  """The `SequenceModel` of the family `name`, as `ssmkit.pretrained.load(...,
  scan_blocks=True)` builds it from the config.json fields of `FAMILIES` (shrunk for the
  "small" suite): its blocks under `nn.scan`, one period of its layer pattern per repeat."""
  model_type, values = FAMILIES[name]
  if shapes == "small":
    values = {**values, **_SMALL_FAMILIES[name], "vocab_size": 64}
  options = MODEL_TYPES[model_type].options(Fields(values, f"FAMILIES[{name!r}]"))
  return with_scanned_blocks(layers.SequenceModel(**options))


def _has_experts(model: Any) -> bool:
  """Whether `model` has a mixture of experts: its blocks' MLP, or a `FeedForward` layer's."""
  return model.mlp == "experts" or any(getattr(make, "keywords", {}).get("kind") == "experts"
                                       for make in layer_pattern(model.layer))


def _memory_row(config: Any, devices: list[jax.Device], fsdp: int, model: Any = None,
                expert: int = 1) -> tuple[str, ...]:
  """Compiles the train step of `config` (of `model` if given) on a data x expert x fsdp mesh
  of `devices`, without running it."""
  mesh = parallel.make_mesh(parallel.MeshConfig(data=len(devices) // (fsdp * expert), fsdp=fsdp,
                                                expert=expert), len(devices), "rows")
  abstract = jax.eval_shape(lambda: _setup(config, model))
  state, batch = abstract
  shardings = parallel.state_shardings(mesh, state)
  args = (parallel.shapes(state, shardings), parallel.shapes(batch, parallel.split(mesh)),
          jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=parallel.replicated(mesh)))
  compiled = jax.jit(train_step, out_shardings=(shardings, parallel.replicated(mesh))).lower(
      *args).compile()
  analysis = compiled.memory_analysis()
  held = _held_bytes((state.params, state.opt_state), (shardings.params, shardings.opt_state))
  xla = lambda field: "-" if analysis is None else _timing.significant(
      getattr(analysis, field) / _MIB)
  split = f"data={len(devices) // (fsdp * expert)}" + (f" expert={expert}" if expert > 1 else "")
  return (f"{split} fsdp={fsdp}", _timing.significant(held / _MIB),
          xla("argument_size_in_bytes"), xla("temp_size_in_bytes"))


def run(*, shapes: str, repeats: int, markdown: bool, configs: list[str] | None = None) -> int:
  """Runs both tables of the suite named `shapes`, printing rows as they are measured.

  Args:
    shapes: "full" (the configs' own shapes and a 1B model) or "small" (seconds).
    repeats: timed samples per config, the configs taking turns; the median is shown.
    markdown: print GitHub markdown tables instead of plain text.
    configs: the shipped lm configs of the throughput table; None for every one.

  Returns:
    0, the exit status; 2 when `configs` names a config that is not a shipped lm config.
  """
  shipped = train.shipped_configs("lm")
  unknown = sorted(set(configs or ()) - set(shipped))
  if unknown:
    print(f"ssmkit bench training: error: `--configs` {unknown} are not shipped lm configs "
          f"({', '.join(shipped)}).", file=sys.stderr)
    return 2
  names = [name for name in shipped if name in configs] if configs else shipped
  print(f"{_timing.device_line()}, float32 parameters; "
        f"median of {repeats} samples per step (fewer where they would take over "
        f"{_timing.CELL_BUDGET_S:g} s), the configs taking turns.")
  print("One optimizer step (forward, backward, AdamW) of each shipped lm config at its batch "
        "shape; temp MiB: XLA's temporary buffers of the step.")
  print()
  table = _timing.StreamedTable(("config", "params", "batch", "step ms", "tokens/s", "temp MiB"),
                                [names], markdown=markdown)
  table.add(_throughput_rows(names, SUITES[shapes], repeats))
  config = train.load_config("lm_gated_deltanet", list(LARGE[shapes]))
  devices = jax.devices()[:8]
  params = _count(jax.eval_shape(lambda: _setup(config))[0].params)
  print()
  print(f"Memory per device of a train step of lm_gated_deltanet at width {config.model.features} "
        f"with {config.model.num_blocks} blocks ({params:,} parameters), one row of "
        f"{config.data.seq_len} tokens per device, compiled for {len(devices)} device(s): "
        "params+Adam MiB: the parameters and AdamW moments each device holds; XLA args and "
        "temp MiB: the compiled step's arguments and temporary buffers per device.")
  if len(devices) < 8:
    print(f"Only {len(devices)} device(s): for the 8-device rows on a CPU host, ask XLA for "
          f"host devices:\n  {_HOW_TO_GET_DEVICES}")
  print()
  fsdps = [n for n in (1, 2, 4, 8) if n <= len(devices)]
  if shapes == "small":  # the two ends: a whole copy per device, and the state cut the most
    fsdps = sorted({fsdps[0], fsdps[-1]})
  config.data.batch_size = len(devices)
  table = _timing.StreamedTable(("mesh", "params+Adam MiB", "XLA args MiB", "XLA temp MiB"),
                                [[f"data={len(devices) // n} fsdp={n}" for n in fsdps]],
                                markdown=markdown)
  for fsdp in _timing.within_budget(fsdps, "training"):
    table.add([_memory_row(config, devices, fsdp)])
  families = list(FAMILIES) if shapes == "full" else list(_SMALL_FAMILIES)
  print()
  print(f"Memory per device of a train step of a model of each family ssmkit.pretrained loads "
        f"(about 1B parameters; blocks under nn.scan, one period of the layer pattern per "
        f"repeat), one row of {config.data.seq_len} tokens per device, fully sharded over "
        f"{len(devices)} device(s) (fsdp={len(devices)}); in the rows "
        f"\"(expert={EXPERT_SPLIT})\" the experts are split over {EXPERT_SPLIT} of them "
        f"(mesh.expert) and fsdp over the rest.")
  print()
  models = {name: _family_model(name, shapes) for name in families}
  rows = [(name, name, 1) for name in families]
  if shapes == "full" and len(devices) % EXPERT_SPLIT == 0:  # and experts split over "expert"
    rows += [(f"{name} (expert={EXPERT_SPLIT})", name, EXPERT_SPLIT) for name in families
             if _has_experts(models[name])]
  table = _timing.StreamedTable(("family", "params", "params+Adam MiB", "XLA args MiB",
                                 "XLA temp MiB"), [[label for label, _, _ in rows]],
                                markdown=markdown)
  for label, name, expert in _timing.within_budget(rows, "training"):
    model = models[name]
    params = _count(jax.eval_shape(lambda model=model: _setup(config, model))[0].params)
    row = _memory_row(config, devices, len(devices) // expert, model, expert)
    table.add([(label, f"{params:,}", *row[1:])])
  return 0
