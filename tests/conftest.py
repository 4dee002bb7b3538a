"""Test configuration: 8 host devices, strict rank promotion, float64 available for references."""

import jax
import pytest

# Set before anything initialises the backend. The sequence-parallel tests split time over
# these devices; every other test runs on the first one, as with a single device.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _float64_available():
  """Lets a test build float64 inputs; float32 inputs stay float32."""
  with jax.enable_x64(True):
    yield
