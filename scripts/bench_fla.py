"""ssmkit's chunked matrix-state functions beside flash-linear-attention's Triton kernels.

On one CUDA GPU, for each function that flash-linear-attention (FLA) also has, times the
forward pass and the gradient with respect to every input (of sum(o * w), w ~ N(0, 1)) of:

- `ssmkit auto` (jitted JAX), in float32 and in bfloat16;
- `ssmkit pallas`, ssmkit's Pallas kernels (`impl="pallas"`, Triton), in bfloat16, for the
  functions that have them (linear attention, the gated delta rule, KDA);
- FLA's chunked kernel (`chunk_simple_gla`, `chunk_gated_delta_rule`, `chunk_kda`,
  `chunk_dplr_delta_rule`, `chunk_gated_delta_product` with two Householder steps) in
  bfloat16, FLA's own benchmark dtype (`benchmarks/ops/run.py`);
- one plain `lax.scan` over the state, differentiated by JAX (float32), at the shape
  where `ssmkit bench linear-attention` judges the speed bounds only.

The inputs are those of `ssmkit bench linear-attention` (unit keys, q scaled by K^-1/2,
log-decays in [-0.3, -0.01], RWKV-7's a = -k, b = k * alpha), passed to both libraries
alike: FLA gets `scale=1` and no in-kernel normalisation. Shapes: the bench's judged
shape, then FLA's `SHAPE_CONFIGS` (`benchmarks/ops/registry.py`) that fit the time budget.
Memory is what the gradient holds beyond its inputs: XLA's temporary and output bytes
for ssmkit, the peak allocated above the inputs for FLA; both include the gradients.
"diff" is the largest difference of a row's outputs from FLA's, over FLA's largest output.

This script needs torch and fla-core, which ssmkit does not depend on; run it where
they are installed, from the repository root, with JAX's preallocation off:

    pip install fla-core
    XLA_PYTHON_CLIENT_PREALLOCATE=false python scripts/bench_fla.py --markdown
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from fla.ops.gated_delta_product import chunk_gated_delta_product
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule
from fla.ops.kda import chunk_kda
from fla.ops.simple_gla import chunk_simple_gla

from ssmkit.bench import _timing
from ssmkit.bench import linear_attention as bench

JUDGED = bench.Shape(2, 4096, 4, 64)
FLA_SHAPES = (  # FLA's SHAPE_CONFIGS, smallest first
    bench.Shape(8, 1024, 8, 64), bench.Shape(4, 2048, 16, 128), bench.Shape(2, 16384, 16, 128),
    bench.Shape(4, 4096, 64, 128),
)


def _fla_call(function: str, q, k, v, g, *rest):
  """FLA's kernel for `function` on `bench.inputs`' arrays (as torch tensors): o."""
  if function == "linear_attention":
    return chunk_simple_gla(q, k, v, g, scale=1.0)[0]
  if function == "delta_rule":
    return chunk_gated_delta_rule(q, k, v, g, rest[0], scale=1.0)[0]
  if function == "kda":
    return chunk_kda(q, k, v, g, rest[0], scale=1.0)[0]
  if function == "generalized_delta_rule":
    return chunk_dplr_delta_rule(q, k, v, rest[0], rest[1], g, scale=1.0)[0]
  # delta_product: FLA interleaves a token's steps along time.
  steps = lambda x: x.flatten(1, 2)
  return chunk_gated_delta_product(q, steps(k), steps(v), g, steps(rest[0]),
                                   num_householder=k.shape[2], scale=1.0)[0]


def _torch(x: jax.Array, dtype: torch.dtype) -> torch.Tensor:
  return torch.from_numpy(np.array(x, np.float32)).to("cuda", dtype).requires_grad_()


def _fla_method(function: str, args, w):
  """FLA's forward and gradient thunks, its output, and its gradient's peak bytes.

  The gradient thunk and bytes are None where FLA refuses the backward pass (its gated
  `chunk_bwd_dqkwg` on Hopper GPUs with Triton 3.4 to 3.7.0).
  """
  xs = [_torch(a, torch.bfloat16) for a in args]
  ws = _torch(w, torch.bfloat16).detach()

  def forward():
    with torch.no_grad():
      _fla_call(function, *xs)
    torch.cuda.synchronize()

  def gradient():
    torch.autograd.grad(_fla_call(function, *xs), xs, ws)
    torch.cuda.synchronize()

  forward()  # Triton compiles and autotunes here
  with torch.no_grad():
    out = _fla_call(function, *xs).float().cpu().numpy()
  try:
    gradient()
  except RuntimeError as error:
    print(f"FLA refuses the gradient of {function}: {error}", file=sys.stderr, flush=True)
    return forward, None, out, None
  torch.cuda.reset_peak_memory_stats()
  held = torch.cuda.memory_allocated()
  gradient()
  return forward, gradient, out, torch.cuda.max_memory_allocated() - held


def _jax_method(method, args, w):
  """A JAX method's compiled forward and gradient thunks, its output, and its gradient's bytes."""
  count = len(args)
  loss = lambda *a: jnp.sum(method(*a[:count]).astype(jnp.float32) * a[count])
  forward, _ = _timing.compile_timed(method, *args)
  gradient, _ = _timing.compile_timed(jax.grad(loss, argnums=tuple(range(count))), *args, w)
  memory = gradient.memory_analysis()
  held = None if memory is None else memory.temp_size_in_bytes + memory.output_size_in_bytes
  return (lambda: forward(*args), lambda: gradient(*args, w),
          np.asarray(forward(*args), np.float32), held)


def _case(function: str, shape: bench.Shape, repeats: int) -> list[tuple[str, ...]]:
  args, w = bench.inputs(function, shape, jax.random.key(0))
  scan, ours = bench._FUNCTIONS[function]  # the bench's own pairs of baseline and function
  bf16 = lambda xs: tuple(x.astype(jnp.bfloat16) for x in xs)
  methods = {}
  start = time.monotonic()
  say = lambda what: print(f"  {time.monotonic() - start:.0f} s: {what}", file=sys.stderr, flush=True)
  if shape == JUDGED:
    methods["lax.scan", "float32"] = _jax_method(scan, args, w)
    say("lax.scan compiled")
  methods["ssmkit auto", "float32"] = _jax_method(ours("auto"), args, w)
  say("ssmkit float32 compiled")
  methods["ssmkit auto", "bfloat16"] = _jax_method(ours("auto"), bf16(args), w.astype(jnp.bfloat16))
  say("ssmkit bfloat16 compiled")
  if bench.kernel(function) is not None:
    methods[bench.PALLAS, "bfloat16"] = _jax_method(bench.kernel(function), bf16(args),
                                                    w.astype(jnp.bfloat16))
    say("ssmkit's kernels compiled")
  fla_key = ("FLA chunk", "bfloat16")
  methods[fla_key] = _fla_method(function, args, w)
  say("FLA compiled")
  thunks = {}
  for key, (forward, gradient, _, _) in methods.items():
    thunks[key, "forward"] = forward
    if gradient is not None:
      thunks[key, "gradient"] = gradient
  seconds = _timing.interleaved_medians(thunks, repeats=repeats)
  ms = lambda key: (_timing.significant(seconds[key] * 1e3) if key in seconds else "refused")
  fla_out = methods[fla_key][2]
  scale = np.abs(fla_out).max()
  rows = []
  ratio = lambda a, b: f"{seconds[a] / seconds[b]:.2f}" if {a, b} <= set(seconds) else "n/a"
  for key, (_, _, out, held) in methods.items():
    rows.append((function, str(shape), *key, ms((key, "forward")), ms((key, "gradient")),
                 ratio((key, "forward"), (fla_key, "forward")),
                 ratio((key, "gradient"), (fla_key, "forward")),
                 ratio((fla_key, "gradient"), (key, "gradient")),
                 "n/a" if held is None else _timing.significant(held / 2**20),
                 f"{np.abs(out - fla_out).max() / scale:.1e}"))
  return rows


HEADERS = ("function", "shape", "method", "dtype", "fwd ms", "fwd+bwd ms", "fwd / FLA fwd",
           "fwd+bwd / FLA fwd", "x FLA fwd+bwd", "memory MiB", "diff")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--functions", nargs="+", default=[
      "linear_attention", "delta_rule", "kda", "generalized_delta_rule", "delta_product"])
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--shapes", type=int, default=len(FLA_SHAPES),
                      help="how many of FLA's shapes, smallest first")
  parser.add_argument("--skip-judged", action="store_true",
                      help="FLA's shapes only, without the bench's judged shape")
  parser.add_argument("--shape", action="append", default=[], metavar="B,T,H,D",
                      help="these shapes instead (repeatable), e.g. 8,2048,16,128")
  parser.add_argument("--budget-s", type=float, default=300.0,
                      help="start no new shape after this many seconds")
  parser.add_argument("--markdown", action="store_true")
  args = parser.parse_args()
  device = jax.devices()[0]
  print(f"jax {jax.__version__} on {device.device_kind}; torch {torch.__version__} on "
        f"{torch.cuda.get_device_name()}; median of {args.repeats} samples, methods taking turns. "
        "fwd / FLA fwd, fwd+bwd / FLA fwd: the row's times over FLA's forward; x FLA fwd+bwd: FLA's "
        "gradient time over the row's.\n", flush=True)
  shapes = FLA_SHAPES[:args.shapes] if args.skip_judged else (JUDGED, *FLA_SHAPES[:args.shapes])
  if args.shape:
    shapes = tuple(bench.Shape(*map(int, text.split(","))) for text in args.shape)
  table = _timing.StreamedTable(
      HEADERS, [args.functions, [str(s) for s in shapes],
                ["lax.scan", "ssmkit auto", bench.PALLAS, "FLA chunk"], ["float32", "bfloat16"]],
      markdown=args.markdown)
  start = time.monotonic()
  for shape in shapes:
    if time.monotonic() - start > args.budget_s:
      print(f"(budget spent: {shape} and larger skipped)", flush=True)
      break
    for function in args.functions:
      print(f"{time.monotonic() - start:.0f} s: {function} {shape}", file=sys.stderr, flush=True)
      try:
        table.add(_case(function, shape, args.repeats))
      except Exception as error:  # one failed cell must not lose the table
        print(f"| {function} | {shape} | failed: {type(error).__name__}: {str(error)[:200]} |",
              flush=True)


if __name__ == "__main__":
  main()
