"""Training on many devices and processes: the "data" mesh, joining a multi-process run, placing arrays.

A run shards every batch over the mesh axis "data" and replicates the parameters and the optimizer
state; `jax.jit` then runs the step data-parallel, its gradient means and BatchNorm statistics
reduced over the whole batch, so the run computes what one device would, up to float rounding.
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
# Environment variables that `initialize_distributed` reads when its argument is None.
COORDINATOR_ADDRESS_ENV = "SSMKIT_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "SSMKIT_NUM_PROCESSES"
PROCESS_ID_ENV = "SSMKIT_PROCESS_ID"


@dataclasses.dataclass
class MeshConfig:
  """The devices a run uses: a one-axis `jax.sharding.Mesh` named "data" that splits every batch.

  Parameters and optimizer state are replicated on every device of the mesh. A run may resume on
  another number of devices.
  """

  # Devices on the "data" axis, the first ones of `jax.devices()`; -1: every device of every
  # process. Must divide the batch size; a multi-process run uses every device.
  data: int = -1


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


def data_mesh(config: MeshConfig, batch_size: int, batch_key: str) -> Mesh:
  """The one-axis mesh of the `mesh` section, checked against the batch it will split.

  Args:
    config: the `mesh` section.
    batch_size: the number of sequences every batch holds.
    batch_key: the config key of `batch_size`, for error messages.

  Raises:
    ConfigError: if `mesh.data` is neither -1 nor a device count this run has, is not every
      device of a multi-process run, or does not divide `batch_size`.
  """
  devices = jax.devices()
  if config.data == 0 or config.data < -1:
    raise ConfigError(f"`mesh.data` must be -1 (every device) or a device count, got {config.data}.")
  size = len(devices) if config.data == -1 else config.data
  if size > len(devices):
    raise ConfigError(
        f"`mesh.data`={size} asks for more devices than the {len(devices)} this run has "
        f"({devices[0].platform})."
    )
  if jax.process_count() > 1 and size != len(devices):
    raise ConfigError(
        f"`mesh.data` must be -1 or {len(devices)} in a run of {jax.process_count()} processes, which "
        f"uses every device; got {size}."
    )
  if batch_size % size:
    raise ConfigError(f"`{batch_key}`={batch_size} must be a multiple of `mesh.data`, {size} devices.")
  return Mesh(np.array(devices[:size]), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
  """The sharding of parameters and optimizer state: a whole copy on every device."""
  return NamedSharding(mesh, PartitionSpec())


def split(mesh: Mesh) -> NamedSharding:
  """The sharding of batches: the leading axis split over the "data" axis."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def place(tree: Any, sharding: NamedSharding) -> Any:
  """Global arrays of `sharding` from the same host values on every process.

  Each process copies to its own devices only the slices they hold, so this works for one
  process and for many.

  Args:
    tree: a pytree of arrays (PRNG keys included) with the same values in every process.
    sharding: the sharding of every leaf.
  """

  def put(leaf: Any) -> jax.Array:
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
      return jax.random.wrap_key_data(put(jax.random.key_data(leaf)), impl=jax.random.key_impl(leaf))
    value = np.asarray(leaf)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  return jax.tree.map(put, tree)


def is_primary() -> bool:
  """Whether this is process 0, the one that writes the workdir's files and shows progress."""
  return jax.process_index() == 0
