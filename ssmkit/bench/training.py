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
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ssmkit import data, train
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
_HOW_TO_GET_DEVICES = "XLA_FLAGS=--xla_force_host_platform_device_count=8 ssmkit bench training"
_MIB = 2**20


def _setup(config: Any) -> tuple[Any, dict[str, jax.Array]]:
  """The initial train state of `config`'s model and optimizer, and a batch of its shape."""
  vocab = data.ByteTokenizer().vocab_size
  model = build_model(config.model, vocab, vocab)
  tx = make_optimizer(config.optimizer, layer_names(config.model), config.train.steps)
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


def _memory_row(config: Any, devices: list[jax.Device], fsdp: int) -> tuple[str, ...]:
  """Compiles the train step of `config` on a data x fsdp mesh of `devices`, without running it."""
  mesh = parallel.make_mesh(parallel.MeshConfig(data=len(devices) // fsdp, fsdp=fsdp),
                            len(devices), "rows")
  abstract = jax.eval_shape(lambda: _setup(config))
  state, batch = abstract
  shardings = parallel.state_shardings(mesh, state)
  split = parallel.split(mesh)
  place = lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where)
  args = (jax.tree.map(place, state, shardings),
          jax.tree.map(lambda leaf: place(leaf, split), batch),
          jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=parallel.replicated(mesh)))
  compiled = jax.jit(train_step, out_shardings=(shardings, parallel.replicated(mesh))).lower(
      *args).compile()
  analysis = compiled.memory_analysis()
  held = _held_bytes((state.params, state.opt_state), (shardings.params, shardings.opt_state))
  xla = lambda field: "-" if analysis is None else _timing.significant(
      getattr(analysis, field) / _MIB)
  return (f"data={len(devices) // fsdp} fsdp={fsdp}", _timing.significant(held / _MIB),
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
  device = jax.devices()[0]
  print(f"jax {jax.__version__}, {device.platform} ({device.device_kind}), float32 parameters; "
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
  return 0
