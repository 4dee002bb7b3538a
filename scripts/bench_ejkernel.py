"""ssmkit's matrix-state functions beside ejkernel's XLA kernels, on the same inputs, on CPU.

ejkernel (erfanzar/ejkernel, the kernels of EasyDeL) ships XLA implementations that JAX users
call on CPU and TPU: `state_space_v2` (Mamba-2's SSD, one `lax.scan` over the tokens) and
`gated_delta_rule` (chunked, or recurrent with `use_chunked=False`). For each, times the
forward pass and the gradient with respect to every input (of sum(o * w), w ~ N(0, 1)) of
ejkernel's kernel and of `ssmkit auto` (`linear_attention` with one decay per head, and
`delta_rule`), float32, jitted, medians of samples taken in turns. Memory is the gradient's
temporary bytes (XLA's memory analysis). Each row's outputs are checked against ssmkit's.

The inputs are those of `ssmkit bench linear-attention` (unit keys, q scaled by K^-1/2,
log-decays in [-0.3, -0.01]); SSD is linear attention with queries C, keys B dt, values x and
log-decays A dt. ejkernel's gated delta rule gets `use_qk_l2norm=False` (the keys are unit
already) and the queries unscaled (it scales them by K^-1/2 itself). The shapes: Mamba-2's SSD
at B=2 T=2048 H=4 P=N=64, and the bench's judged shapes.

This script needs ejkernel, which ssmkit does not depend on; run it where it is installed,
from the repository root:

    pip install ejkernel
    python scripts/bench_ejkernel.py --markdown
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from ejkernel.kernels._xla.gated_delta_rule import gated_delta_rule
from ejkernel.kernels._xla.state_space_v2 import state_space_v2

import ssmkit
from ssmkit.bench import _timing
from ssmkit.bench import linear_attention as bench

SHAPES = {  # (function, shape): SSD at Mamba-2's pairing, then the bench's judged shapes
    "ssd": (bench.Shape(2, 2048, 4, 64), bench.Shape(2, 4096, 4, 64)),
    "gated_delta_rule": (bench.Shape(2, 1024, 4, 64), bench.Shape(2, 4096, 4, 64)),
}
_RTOL = 2e-3


def _ssd_inputs(shape: bench.Shape, key: jax.Array):
  """x, A, B, C, dt of Mamba-2 (one group per head), and the output weights."""
  keys = jax.random.split(key, 6)
  dims = (shape.batch, shape.length, shape.heads, shape.dim)
  x = jax.random.normal(keys[0], dims)
  b = jax.random.normal(keys[1], dims) / np.sqrt(shape.dim)
  c = jax.random.normal(keys[2], dims) / np.sqrt(shape.dim)
  a = -jax.random.uniform(keys[3], (shape.heads,), minval=0.5, maxval=2.0)
  dt = jax.random.uniform(keys[4], dims[:3], minval=0.01, maxval=0.3)
  return (x, a, b, c, dt), jax.random.normal(keys[5], dims)


def _methods(function: str):
  """`{name: fn(*args) -> o}` of ejkernel's and ssmkit's implementations of `function`."""
  if function == "ssd":
    def ejk(x, a, b, c, dt):
      out = state_space_v2(x, a, b, c, jnp.zeros_like(a), dt, n_groups=x.shape[2])[0]
      return out.reshape(x.shape)

    def ours(x, a, b, c, dt):
      return ssmkit.scan.linear_attention(c, b * dt[..., None], x, dt * a)

    return {"ejkernel state_space_v2": ejk, "ssmkit auto": ours}

  # ejkernel scales the queries by K^-1/2 itself: it gets them unscaled.
  def ejk_chunked(q, k, v, g, beta):
    return gated_delta_rule(q * q.shape[-1]**0.5, k, v, beta, g, use_qk_l2norm=False)[0]

  def ejk_recurrent(q, k, v, g, beta):
    return gated_delta_rule(q * q.shape[-1]**0.5, k, v, beta, g, use_qk_l2norm=False,
                            use_chunked=False)[0]

  def ours(q, k, v, g, beta):
    return ssmkit.scan.delta_rule(q, k, v, beta, g)

  return {"ejkernel gated_delta_rule (chunked)": ejk_chunked,
          "ejkernel gated_delta_rule (recurrent)": ejk_recurrent, "ssmkit auto": ours}


def _bench(function: str, shape: bench.Shape, repeats: int, key: jax.Array) -> list[tuple[str, ...]]:
  if function == "ssd":
    args, w = _ssd_inputs(shape, key)
  else:
    args, w = bench.inputs("delta_rule", shape, key)
  results = _timing.forward_and_gradient(
      _methods(function), args, lambda out, w: jnp.sum(out * w), (w,), reference="ssmkit auto",
      rtol=_RTOL, repeats=repeats)
  auto = results["ssmkit auto"]
  rows = []
  for name, (forward_s, gradient_s, memory) in results.items():
    rows.append((function, str(shape), name, _timing.significant(forward_s * 1e3),
                 f"{forward_s / auto[0]:.2f}", _timing.significant(gradient_s * 1e3),
                 f"{gradient_s / auto[1]:.2f}",
                 "-" if memory is None else _timing.significant(memory / 2**20)))
  return rows


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=20, help="timed samples per cell")
  parser.add_argument("--markdown", action="store_true", help="print a markdown table")
  args = parser.parse_args(argv)
  print(f"{_timing.device_line()}, float32; median of "
        f"{args.repeats} samples, methods taking turns; x ssmkit: the time over ssmkit auto's.")
  rows = []
  for i, (function, shapes) in enumerate(SHAPES.items()):
    for shape in shapes:
      rows.extend(_bench(function, shape, args.repeats, jax.random.key(i)))
      print(f"[{function} {shape}] done", file=sys.stderr)
  print(_timing.format_table(("function", "shape", "method", "fwd ms", "x ssmkit fwd",
                              "fwd+bwd ms", "x ssmkit fwd+bwd", "temp MiB"), rows,
                             markdown=args.markdown, labels=3))
  return 0


if __name__ == "__main__":
  sys.exit(main())
