"""Training on many devices and processes: the mesh, joining a multi-process run, placing arrays.

A run's mesh has four axes. Every batch is split over the devices of "data", "fsdp" and
"expert" together; the parameters and the optimizer state are replicated over "data" and
sharded over "fsdp" (fully sharded data parallelism: each weight is cut along one of its axes,
and `jax.jit`'s partitioner gathers it where a block uses it, inside the scan over blocks one
block at a time, and reduces its gradient onto the shards). The experts of every mixture are
split over "expert" (expert parallelism: each device holds its share of the experts and their
optimizer state; the other parameters are replicated over that axis). Every sequence is split over
"seq" (sequence parallelism): the model runs inside `jax.shard_map` over that axis with
`axis_name="seq"`, so each device holds the activations of a slice of time.
`jax.jit` then runs the step over the whole batch, its gradient means and BatchNorm statistics
reduced over every device, so the run computes what one device would, up to float rounding.
Every process of a multi-process run holds the same host values (the dataset, and the data order,
which depends only on the seed) and places on its own devices only the parts they hold.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ssmkit._src.train.core.errors import ConfigError

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
EXPERT_AXIS = "expert"
SEQ_AXIS = "seq"
# The parameters of a mixture of experts that hold one matrix per expert (the experts' axis the
# third from the end), beside its `router`.
_PER_EXPERT = ("gate", "up", "down")
# Environment variables that `initialize_distributed` reads when its argument is None.
COORDINATOR_ADDRESS_ENV = "SSMKIT_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "SSMKIT_NUM_PROCESSES"
PROCESS_ID_ENV = "SSMKIT_PROCESS_ID"


@dataclasses.dataclass
class MeshConfig:
  """The devices a run uses: a `jax.sharding.Mesh` of axes "data", "fsdp" and "expert" that
  split every batch, and "seq" that splits every sequence.

  Parameters and optimizer state are replicated over "data" and "seq" and sharded over "fsdp";
  the experts of every mixture are split over "expert". A run may resume on another mesh.
  """

  # Devices on the "data" axis, which replicates the parameters; -1: every device of every
  # process over `fsdp` x `expert` x `seq`. The mesh is the first data x fsdp x expert x seq
  # devices of `jax.devices()`, and data x fsdp x expert must divide the batch size; a
  # multi-process run uses every device.
  data: int = -1
  # Devices on the "fsdp" axis, over which each parameter and its optimizer state are cut
  # along their largest axis that it divides (left whole where none does).
  fsdp: int = 1
  # Devices on the "expert" axis, over which the experts of every mixture of experts are split
  # (each device holds num_experts / expert of them, which it must divide); it splits the batch
  # too, and replicates the other parameters.
  expert: int = 1
  # Devices on the "seq" axis, over which the time axis of every sequence is split: each holds
  # the activations of 1 / seq of the steps (docs/sequence_parallel.md). It must divide the
  # sequence length; BatchNorm's batch statistics cannot be split.
  seq: int = 1


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Joins a multi-process run with `jax.distributed.initialize`, before any other JAX call.

  Each argument left None comes from its environment variable (`SSMKIT_COORDINATOR_ADDRESS`,
  `SSMKIT_NUM_PROCESSES`, `SSMKIT_PROCESS_ID`); whatever is still None, JAX detects on the
  clusters it knows (Slurm, Open MPI, Kubernetes, Cloud TPU). CPU devices exchange data through
  gloo.

  Args:
    coordinator_address: "host:port" of process 0, which every process can reach.
    num_processes: the number of processes of the run.
    process_id: this process's index in [0, num_processes).

  Raises:
    ConfigError: if an environment variable that should hold a number does not.
  """
  coordinator_address = coordinator_address or os.environ.get(COORDINATOR_ADDRESS_ENV)
  num_processes = _int_from_env(num_processes, NUM_PROCESSES_ENV)
  process_id = _int_from_env(process_id, PROCESS_ID_ENV)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes, process_id)


def _int_from_env(value: int | None, name: str) -> int | None:
  if value is not None or name not in os.environ:
    return value
  try:
    return int(os.environ[name])
  except ValueError:
    raise ConfigError(f"the environment variable {name} must be an integer, got {os.environ[name]!r}.") \
        from None


def make_mesh(config: MeshConfig, batch_size: int, batch_key: str) -> Mesh:
  """The mesh of the `mesh` section, checked against the batch it will split.

  Args:
    config: the `mesh` section.
    batch_size: the number of sequences every batch holds.
    batch_key: the config key of `batch_size`, for error messages.

  Raises:
    ConfigError: if `mesh.fsdp`, `mesh.expert` or `mesh.seq` is below 1, `mesh.data` is
      neither -1 nor a positive count, data x fsdp x expert x seq is more devices than this
      run has, is not every device of a multi-process run, or data x fsdp x expert does not
      divide `batch_size`.
  """
  devices = jax.devices()
  for name in ("fsdp", "expert", "seq"):
    if getattr(config, name) < 1:
      raise ConfigError(f"`mesh.{name}` must be a device count >= 1, got {getattr(config, name)}.")
  if config.data == 0 or config.data < -1:
    raise ConfigError(f"`mesh.data` must be -1 (every device) or a device count, got {config.data}.")
  others = config.fsdp * config.expert * config.seq
  if config.data == -1 and len(devices) % others:
    raise ConfigError(f"`mesh.fsdp` x `mesh.expert` x `mesh.seq`={others} must divide the "
                      f"{len(devices)} devices this run has when `mesh.data` is -1.")
  data = len(devices) // others if config.data == -1 else config.data
  size = data * others
  axes = "`mesh.data` x `mesh.fsdp` x `mesh.expert` x `mesh.seq`"
  if size > len(devices):
    raise ConfigError(f"{axes}={size} asks for more devices than the {len(devices)} this run has "
                      f"({devices[0].platform}).")
  if jax.process_count() > 1 and size != len(devices):
    raise ConfigError(f"{axes} must be {len(devices)} in a run of {jax.process_count()} "
                      f"processes, which uses every device; got {size}.")
  splitting = data * config.fsdp * config.expert
  if batch_size % splitting:
    raise ConfigError(f"`{batch_key}`={batch_size} must be a multiple of `mesh.data` x "
                      f"`mesh.fsdp` x `mesh.expert`, {splitting} devices.")
  # "expert" before "fsdp": in the other order, with "seq" split too, XLA 0.10's partitioner
  # aborts on a failed check (spmd_partitioner_util.cc: replica groups).
  return Mesh(np.array(devices[:size]).reshape(data, config.expert, config.fsdp, config.seq),
              (DATA_AXIS, EXPERT_AXIS, FSDP_AXIS, SEQ_AXIS))


def describe(mesh: Mesh) -> str:
  """`mesh` for a run's header: "8 cpu device(s) (data 2 x fsdp 2 x seq 2)", the axes of one
  device left out."""
  split = " x ".join(f"{name} {size}" for name, size in mesh.shape.items() if size > 1)
  return f"{mesh.size} {mesh.devices.flat[0].platform} device(s)" + (f" ({split})" if split else "")


def replicated(mesh: Mesh) -> NamedSharding:
  """A whole copy on every device (the data order, keys, metrics)."""
  return NamedSharding(mesh, PartitionSpec())


def split(mesh: Mesh) -> NamedSharding:
  """The sharding of batches: the leading axis split over the devices of "data", "expert" and
  "fsdp"."""
  return NamedSharding(mesh, PartitionSpec((DATA_AXIS, EXPERT_AXIS, FSDP_AXIS)))


def over_time(apply_fn: Any, mesh: Mesh, per_step: bool) -> Any:
  """`apply_fn` (a `SequenceModel`'s `apply`) with the time axis of its inputs split over the
  mesh axis "seq": inside `jax.shard_map` over that axis alone (the others stay with
  `jax.jit`'s partitioner), with `axis_name="seq"`.

  Args:
    apply_fn: `(variables, x, mask, reset, **options) -> outputs`, or `(outputs, updates)` with
      `mutable`.
    mesh: the run's mesh.
    per_step: the outputs are per step `(B, T, ...)` (split like the inputs), else pooled `(B, ...)`.

  Returns:
    A function of `apply_fn`'s arguments; the same function when "seq" has one device.
  """
  if mesh.shape[SEQ_AXIS] == 1:
    return apply_fn
  time = PartitionSpec(None, SEQ_AXIS)
  outputs = time if per_step else PartitionSpec()

  def apply(variables, x, mask=None, reset=None, **options):
    local = lambda variables, x, mask, reset: apply_fn(variables, x, mask, reset, axis_name=SEQ_AXIS,
                                                       **options)
    out_specs = (outputs, PartitionSpec()) if options.get("mutable") else outputs
    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), time, time, time),
                         out_specs=out_specs, axis_names={SEQ_AXIS})(variables, x, mask, reset)

  return apply


def state_shardings(mesh: Mesh, tree: Any) -> Any:
  """The sharding of each leaf of parameters or optimizer state: fully sharded over "fsdp",
  the experts of every mixture split over "expert".

  The per-expert matrices of a mixture of experts (its `gate`, `up` and `down` beside its
  `router`, of any model, stacked under `nn.scan` or not, and their optimizer state) are cut
  over the "expert" axis along their experts' axis. Any leaf is cut over the "fsdp" axis along
  its largest other axis that the axis's size divides (the last of equals); a leaf with no such
  axis (a scalar, a bias of odd width) is whole on every device of that axis. Every leaf is
  replicated over "data" and "seq".

  Args:
    mesh: a mesh of `make_mesh`.
    tree: a pytree of arrays or `jax.ShapeDtypeStruct`s.

  Returns:
    A pytree of `NamedSharding`s of the structure of `tree`.

  Raises:
    ConfigError: naming `mesh.expert` when it does not divide a mixture's experts.
  """
  size, experts = mesh.shape[FSDP_AXIS], mesh.shape.get(EXPERT_AXIS, 1)
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  mixtures = {path[:-1] for path in paths if _key(path[-1]) == "router"}

  def sharding(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
    shape = np.shape(leaf)
    spec: list[str | None] = [None] * len(shape)
    if experts > 1 and path[:-1] in mixtures and _key(path[-1]) in _PER_EXPERT:
      axis = len(shape) - 3
      if shape[axis] % experts:
        raise ConfigError(f"`mesh.expert`={experts} must divide the {shape[axis]} experts of "
                          f"every mixture of experts.")
      spec[axis] = EXPERT_AXIS
    axes = [axis for axis, n in enumerate(shape)
            if size > 1 and n % size == 0 and spec[axis] is None]
    if axes:
      spec[max(axes, key=lambda a: (shape[a], a))] = FSDP_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))

  return jax.tree_util.tree_map_with_path(sharding, tree)


def _key(entry: Any) -> Any:
  """The name of a path entry: a dict key or an attribute name (NNX state, optax states)."""
  return getattr(entry, "key", getattr(entry, "name", entry))


def shapes(tree: Any, sharding: NamedSharding | Any) -> Any:
  """What `place(tree, sharding)` would make, as `jax.ShapeDtypeStruct`s with their shardings:
  nothing computed or copied (the template of a checkpoint to restore).

  Args:
    tree: a pytree of arrays or `jax.ShapeDtypeStruct`s.
    sharding: the sharding of every leaf, or a pytree of shardings of the structure of `tree`.
  """
  shape = lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where)
  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda leaf: shape(leaf, sharding), tree)
  return jax.tree.map(shape, tree, sharding)


def place(tree: Any, sharding: NamedSharding | Any) -> Any:
  """Global arrays of `sharding` from the same host values on every process.

  Each process copies to its own devices only the slices they hold, so this works for one
  process and for many.

  Args:
    tree: a pytree of arrays (PRNG keys included) with the same values in every process.
    sharding: the sharding of every leaf, or a pytree of shardings of the structure of `tree`.
  """

  def put(leaf: Any, where: NamedSharding) -> jax.Array:
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
      return jax.random.wrap_key_data(put(jax.random.key_data(leaf), where),
                                      impl=jax.random.key_impl(leaf))
    value = np.asarray(leaf)
    return jax.make_array_from_callback(value.shape, where, lambda index: value[index])

  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda leaf: put(leaf, sharding), tree)
  return jax.tree.map(put, tree, sharding)


def is_primary() -> bool:
  """Whether this is process 0, the one that writes the workdir's files and shows progress."""
  return jax.process_index() == 0
