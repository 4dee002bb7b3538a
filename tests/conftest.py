"""Test configuration: strict rank promotion everywhere, float64 available for references."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _float64_available():
  """Lets a test build float64 inputs; float32 inputs stay float32."""
  with jax.enable_x64(True):
    yield
