"""Multi-device tests on any machine: the default backend's devices, or else the CPU's.

tests/conftest.py asks JAX for 8 CPU devices (`jax_num_cpu_devices`). On a CPU-only machine
they are the default backend's devices; on a machine with one GPU they are not, and the
tests that need several devices run on the CPU backend's instead, as under
`JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import pytest

COUNT = 8


@contextlib.contextmanager
def on_host_devices(count: int = COUNT) -> Iterator[None]:
  """Runs the block with `count` devices: the default backend's if it has them, else the CPU's.

  On the CPU backend, `jax.devices()` and the other device queries that name no backend answer
  for the CPU backend (so does code that builds its mesh from them, as `ssmkit train`),
  `jax.default_backend()` is "cpu", and new arrays and computations default to the first CPU
  device. Skips the test, naming what it needs, where neither backend has `count` devices.
  """
  if jax.device_count() >= count:
    yield
    return
  devices, device_count = jax.devices, jax.device_count
  local_devices, local_device_count = jax.local_devices, jax.local_device_count
  cpu = devices("cpu")
  if len(cpu) < count:
    pytest.skip(
        f"needs {count} devices: the default backend has {device_count()} "
        f"({jax.default_backend()}) and the CPU backend {len(cpu)}"
    )
  with pytest.MonkeyPatch.context() as patch, jax.default_device(cpu[0]):
    patch.setattr(jax, "devices", lambda backend=None: devices(backend or "cpu"))
    patch.setattr(jax, "device_count", lambda backend=None: device_count(backend or "cpu"))
    patch.setattr(
        jax, "local_devices",
        lambda process_index=None, backend=None, host_id=None: local_devices(
            process_index, backend or "cpu", host_id),
    )
    patch.setattr(jax, "local_device_count", lambda backend=None: local_device_count(backend or "cpu"))
    patch.setattr(jax, "default_backend", lambda: "cpu")
    yield
