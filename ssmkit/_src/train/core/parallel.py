"""Training on many devices and processes: the mesh, joining a multi-process run, placing arrays.

A run's mesh has two axes. Every batch is split over all its devices ("data" and "fsdp"
together); the parameters and the optimizer state are replicated over "data" and sharded over
"fsdp" (fully sharded data parallelism: each weight is cut along one of its axes, and
`jax.jit`'s partitioner gathers it where a block uses it, inside the scan over blocks one
block at a time, and reduces its gradient onto the shards).
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
# Environment variables that `initialize_distributed` reads when its argument is None.
COORDINATOR_ADDRESS_ENV = "SSMKIT_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "SSMKIT_NUM_PROCESSES"
PROCESS_ID_ENV = "SSMKIT_PROCESS_ID"


@dataclasses.dataclass
class MeshConfig:
  """The devices a run uses: a `jax.sharding.Mesh` of axes "data" and "fsdp" that split every batch.

  Parameters and optimizer state are replicated over "data" and sharded over "fsdp". A run may
  resume on another mesh.
  """

  # Devices on the "data" axis, which replicates the parameters; -1: every device of every
  # process over `fsdp`. The mesh is the first data x fsdp devices of `jax.devices()`, and
  # data x fsdp must divide the batch size; a multi-process run uses every device.
  data: int = -1
  # Devices on the "fsdp" axis, over which each parameter and its optimizer state are cut
  # along their largest axis that it divides (left whole where none does).
  fsdp: int = 1


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
    ConfigError: if `mesh.fsdp` is below 1, `mesh.data` is neither -1 nor a positive count,
      data x fsdp is more devices than this run has, is not every device of a multi-process
      run, or does not divide `batch_size`.
  """
  devices = jax.devices()
  if config.fsdp < 1:
    raise ConfigError(f"`mesh.fsdp` must be a device count >= 1, got {config.fsdp}.")
  if config.data == 0 or config.data < -1:
    raise ConfigError(f"`mesh.data` must be -1 (every device) or a device count, got {config.data}.")
  if config.data == -1 and len(devices) % config.fsdp:
    raise ConfigError(f"`mesh.fsdp`={config.fsdp} must divide the {len(devices)} devices this run "
                      "has when `mesh.data` is -1.")
  data = len(devices) // config.fsdp if config.data == -1 else config.data
  size = data * config.fsdp
  if size > len(devices):
    raise ConfigError(
        f"`mesh.data` x `mesh.fsdp`={size} asks for more devices than the {len(devices)} this "
        f"run has ({devices[0].platform})."
    )
  if jax.process_count() > 1 and size != len(devices):
    raise ConfigError(
        f"`mesh.data` x `mesh.fsdp` must be {len(devices)} in a run of {jax.process_count()} "
        f"processes, which uses every device; got {size}."
    )
  if batch_size % size:
    raise ConfigError(f"`{batch_key}`={batch_size} must be a multiple of `mesh.data` x "
                      f"`mesh.fsdp`, {size} devices.")
  return Mesh(np.array(devices[:size]).reshape(data, config.fsdp), (DATA_AXIS, FSDP_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  """A whole copy on every device (the data order, keys, metrics)."""
  return NamedSharding(mesh, PartitionSpec())


def split(mesh: Mesh) -> NamedSharding:
  """The sharding of batches: the leading axis split over every device of the mesh."""
  return NamedSharding(mesh, PartitionSpec((DATA_AXIS, FSDP_AXIS)))


def state_shardings(mesh: Mesh, tree: Any) -> Any:
  """The sharding of each leaf of parameters or optimizer state: fully sharded over "fsdp".

  A leaf is cut over the "fsdp" axis along its largest axis that the axis's size divides (the
  last of equals), and replicated over "data"; a leaf with no such axis (a scalar, a bias of
  odd width) is whole on every device.

  Args:
    mesh: a mesh of `make_mesh`.
    tree: a pytree of arrays or `jax.ShapeDtypeStruct`s.

  Returns:
    A pytree of `NamedSharding`s of the structure of `tree`.
  """
  size = mesh.shape[FSDP_AXIS]

  def sharding(leaf: Any) -> NamedSharding:
    shape = np.shape(leaf)
    axes = [axis for axis, n in enumerate(shape) if size > 1 and n % size == 0]
    if not axes:
      return replicated(mesh)
    axis = max(axes, key=lambda a: (shape[a], a))
    return NamedSharding(mesh, PartitionSpec(*[FSDP_AXIS if a == axis else None
                                               for a in range(len(shape))]))

  return jax.tree.map(sharding, tree)


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
