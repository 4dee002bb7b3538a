"""Test configuration: 8 host devices, strict rank promotion, exact float32 matrix products,
float64 available for references."""

import jax
import pytest

import multi_device

# Set before anything initialises the backend. The sequence-parallel tests split time over
# these devices; every other test runs on the first one, as with a single device. Where the
# default backend has fewer devices (one GPU), the multi-device tests run on these through
# the `host_devices` fixture.
jax.config.update("jax_num_cpu_devices", multi_device.COUNT)
jax.config.update("jax_numpy_rank_promotion", "raise")
# The tests compare float32 results with float64 references at float32 tolerances. GPUs run
# float32 matrix products in TF32 and TPUs in bfloat16 passes by default (docs/precision.md):
# ask every backend for full float32, as the CPU computes anyway.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _float64_available():
  """Lets a test build float64 inputs; float32 inputs stay float32."""
  with jax.enable_x64(True):
    yield


@pytest.fixture(scope="module")
def host_devices():
  """The module's tests run on 8 devices: the default backend's, or else the CPU's host devices."""
  with multi_device.on_host_devices():
    yield
