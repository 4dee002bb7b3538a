"""Chunk sizes side by side: ssmkit's chunked linear attention and gated delta rule per shape.

The default chunk sizes of `ssmkit.scan.linear_attention` and `ssmkit.scan.delta_rule` on CPU
(32 or 64 steps, by the number of sequences and the size of a head's K x V state) were chosen
from this comparison. For each shape and chunk size: the forward pass and the gradient with
respect to every input (of sum(sin(o))), `mode="chunked"`, one decay per head in [-0.3,
-0.01], float32, jitted, medians of samples taken in turns; memory is the gradient's temporary
bytes (XLA's memory analysis). The outputs of the chunk sizes are checked against each other.

From the repository root, e.g. the heads of a width of 2048 in 8 (K=256, V=512):

    python scripts/bench_chunk_sizes.py --function delta_rule --shape 1 2048 8 256 512
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import ssmkit
from ssmkit.bench import _timing

_RTOL = 1e-3


def _inputs(function: str, shape: tuple[int, ...], key: jax.Array) -> tuple[jax.Array, ...]:
  """q, k, v, log-decays and (delta rule) write strengths at `(B, T, H, K, V)`: unit keys for
  the delta rule, q and k scaled by K^-1/2 for linear attention."""
  batch, length, heads, dim_k, dim_v = shape
  keys = jax.random.split(key, 5)
  q = jax.random.normal(keys[0], (batch, length, heads, dim_k)) / np.sqrt(dim_k)
  k = jax.random.normal(keys[1], (batch, length, heads, dim_k))
  v = jax.random.normal(keys[2], (batch, length, heads, dim_v))
  g = -jax.random.uniform(keys[3], (batch, length, heads), minval=0.01, maxval=0.3)
  if function == "linear_attention":
    return q, k / np.sqrt(dim_k), v, g
  beta = jax.random.uniform(keys[4], (batch, length, heads))
  return q, k / jnp.linalg.norm(k, axis=-1, keepdims=True), v, g, beta


def _function(function: str, chunk_size: int):
  if function == "linear_attention":
    return lambda q, k, v, g: ssmkit.scan.linear_attention(q, k, v, g, mode="chunked",
                                                           chunk_size=chunk_size)
  return lambda q, k, v, g, beta: ssmkit.scan.delta_rule(q, k, v, beta, g, mode="chunked",
                                                         chunk_size=chunk_size)


def _bench(function: str, shape: tuple[int, ...], sizes: list[int], repeats: int,
           key: jax.Array) -> list[tuple[str, ...]]:
  args = _inputs(function, shape, key)
  results = _timing.forward_and_gradient(
      {size: _function(function, size) for size in sizes}, args,
      lambda out: jnp.sum(jnp.sin(out)), reference=sizes[0], rtol=_RTOL, repeats=repeats)
  label = "B={} T={} H={} K={} V={}".format(*shape)
  return [(function, label, str(size), _timing.significant(forward_s * 1e3),
           _timing.significant(gradient_s * 1e3),
           "-" if memory is None else _timing.significant(memory / 2**20))
          for size, (forward_s, gradient_s, memory) in results.items()]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--function", choices=("linear_attention", "delta_rule"), required=True)
  parser.add_argument("--shape", type=int, nargs=5, action="append", required=True,
                      metavar=("B", "T", "H", "K", "V"), help="a shape to time; repeatable")
  parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 64])
  parser.add_argument("--repeats", type=int, default=9, help="timed samples per cell")
  parser.add_argument("--markdown", action="store_true", help="print a markdown table")
  args = parser.parse_args(argv)
  print(f"{_timing.device_line()}, float32; median of "
        f"{args.repeats} samples, the chunk sizes taking turns.")
  rows = []
  for i, shape in enumerate(args.shape):
    rows.extend(_bench(args.function, tuple(shape), args.chunk_sizes, args.repeats,
                       jax.random.key(i)))
  print(_timing.format_table(("function", "shape", "chunk", "fwd ms", "fwd+bwd ms", "temp MiB"),
                             rows, markdown=args.markdown, labels=3))
  return 0


if __name__ == "__main__":
  sys.exit(main())
