"""Whether flax's NNX imports beside the installed jax, with an error that says which pairing."""

from __future__ import annotations

import importlib.metadata


def require_nnx() -> None:
  """Imports `flax.nnx`, or raises an ImportError naming the installed flax and jax.

  flax releases are made against the jax of their day: flax 0.12.8 cannot import its NNX
  under jax 0.11 (`jax.experimental.hijax` has no `HiPrimitive` there), where flax 0.12.10 can.
  """
  try:
    import flax.nnx  # noqa: F401
  except ImportError as error:
    versions = ", ".join(f"{name} {_version(name)}" for name in ("flax", "jax", "jaxlib"))
    raise ImportError(
        f"ssmkit.nnx needs flax's NNX, which fails to import with {versions}: {error}. Install a "
        "flax release made for this jax (pip install -U flax), or a jax that this flax supports; "
        "ssmkit.scan, ssmkit.rl and the linen layers (ssmkit.layers) work without it."
    ) from error


def _version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "(not installed)"
