"""Exports every Pallas kernel of the matrix-state family for CUDA, as a GPU would compile it.

Run by `test_kernels.py` in a process of its own: the Triton lowering drives GPU code paths of a
CPU jaxlib (Triton's MLIR dialects), which the test workers' own compiles need not share.
Prints one line per program: its name and whether its exported module holds a Triton kernel.
"""

import jax
import jax.numpy as jnp

from ssmkit._src.matrix_state.kernels import chunked
from ssmkit.scan import delta_rule, linear_attention

# Channels (24, 40) and a chunk (48) that are not powers of two, bfloat16 inputs.
Q = jax.ShapeDtypeStruct((2, 100, 2, 24), jnp.bfloat16)
V = jax.ShapeDtypeStruct((2, 100, 2, 40), jnp.bfloat16)
TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def program(function: str, per_key: bool):
  def f(q, k, v):
    decay = -jnp.ones(q.shape if per_key else q.shape[:3], q.dtype)
    if function == "delta":
      return delta_rule(q, k, v, jnp.ones(q.shape[:3], q.dtype), decay, impl="pallas",
                        chunk_size=48)
    return linear_attention(q, k, v, decay, impl="pallas", chunk_size=48)

  return f


if __name__ == "__main__":
  # Only when run: pytest's --doctest-modules imports this file into the test workers too.
  chunked.interpreted = lambda: False  # what runs interpreted on this machine, compiled
  for function in ("linear", "delta"):
    for per_key in (False, True):
      f = program(function, per_key)
      loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32))
      for name, fn in (("forward", f), ("gradient", jax.grad(loss, argnums=(0, 1, 2)))):
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                     disabled_checks=[TRITON])(Q, Q, V)
        print(function, "per-key" if per_key else "per-head", name,
              "triton" if "xla.gpu.triton" in exported.mlir_module() else "xla", flush=True)
