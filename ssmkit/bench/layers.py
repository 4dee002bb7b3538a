"""`ssmkit bench layers`: throughput and memory of each SSM layer per mode, the compile
time of deep models with their blocks unrolled or scanned, and the same model through the
linen and the NNX front end.

Each layer maps float32 inputs `(B, T, H)` ~ N(0, 1) to outputs of the same shape; the
forward pass and the gradient of sum(y * w) with respect to the parameters and the inputs
(w ~ N(0, 1)) are timed for every mode. "parallel" runs the recurrence through
`lax.associative_scan`, as the S5 and LRU reference implementations do, so the
"x parallel" column is the speed over that way of writing the layer. Every mode is first
checked against the sequential mode, so the table compares equal results.

The front-end table times one `SequenceModel` (LRU blocks) with the same parameters as a
linen module under `jax.jit` and as an `ssmkit.nnx` module under `nnx.jit`, each called as
its users call it: the forward pass, and the gradient of the cross-entropy with respect to
the parameters. NNX's own work on every call (walking the module's graph) is in its times.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ssmkit import layers
from ssmkit import nnx as ssmkit_nnx
from ssmkit._src.layers import registry
from ssmkit._src.layers.model import layer_pattern
from ssmkit.bench import _timing

Array = jax.Array

SCAN_MODES = ("auto", "sequential", "parallel", "chunked")
REFERENCE = "parallel"
_RTOL = 1e-3

# Every registered layer, by its class name, at its defaults.
LAYERS: dict[str, Callable[..., nn.Module]] = {
    entry.layer.__name__: entry.layer for entry in registry.LAYERS.values()
}


def modes(layer: str) -> tuple[str, ...]:
  """Every mode of `layer`."""
  return (*SCAN_MODES, "convolution") if layer == "S4D" else SCAN_MODES


@dataclasses.dataclass(frozen=True)
class Shape:
  """Inputs `(batch, length, features)`."""

  batch: int
  length: int
  features: int

  def __str__(self) -> str:
    return f"B={self.batch} T={self.length} H={self.features}"


@dataclasses.dataclass(frozen=True)
class Suite:
  """Layer shapes and modes, and the depths and shape of the compile-time comparison."""

  shapes: tuple[Shape, ...]
  depths: tuple[int, ...]
  model_shape: Shape
  only_modes: tuple[str, ...] | None = None  # None: every mode of each layer
  only_layers: tuple[str, ...] | None = None  # None: every layer of `LAYERS`


SUITES = {
    "full": Suite(
        (Shape(16, 256, 64), Shape(8, 2048, 64), Shape(1, 16384, 64)), (2, 8, 32), Shape(8, 256, 64)
    ),
    "small": Suite((Shape(2, 17, 16),), (3,), Shape(2, 9, 4), only_modes=("sequential", REFERENCE),
                   only_layers=("LRU",)),
    # Long single sequences, where attention's quadratic cost shows: no depth sweep.
    "long": Suite((Shape(1, 4096, 64), Shape(1, 16384, 64)), (), Shape(1, 4096, 64),
                  only_modes=("auto",)),
}


@dataclasses.dataclass(frozen=True)
class Result:
  """One row: seconds per call and temp bytes, forward and forward+backward."""

  layer: str
  shape: Shape
  mode: str
  forward_s: float
  backward_s: float
  forward_bytes: int | None
  backward_bytes: int | None


def _functions(layer: nn.Module, mode: str, w: Array) -> tuple[Callable[..., Array], Callable[..., Any]]:
  forward = lambda params, x: layer.apply(params, x, mode=mode)
  loss = lambda params, x: jnp.sum(forward(params, x) * w)
  return forward, jax.grad(loss, argnums=(0, 1))


def _bench_layer(name: str, shape: Shape, suite: Suite, repeats: int, key: Array) -> list[Result]:
  k_x, k_w, k_p = jax.random.split(key, 3)
  dims = (shape.batch, shape.length, shape.features)
  x, w = jax.random.normal(k_x, dims), jax.random.normal(k_w, dims)
  layer = LAYERS[name]()
  params = jax.jit(layer.init)(k_p, x)
  compiled = {}
  for mode in suite.only_modes or modes(name):
    forward, gradient = _functions(layer, mode, w)
    compiled[mode] = (_timing.compile_timed(forward, params, x)[0],
                      _timing.compile_timed(gradient, params, x)[0])
  checked = "sequential" if "sequential" in compiled else next(iter(compiled))
  want = np.asarray(compiled[checked][0](params, x))
  for mode, (forward, _) in compiled.items():
    got = np.asarray(forward(params, x))
    if not np.all(np.abs(got - want) <= _RTOL * (np.abs(want) + np.abs(want).max())):
      raise RuntimeError(f"{name} mode {mode} disagrees with the {checked} mode at {shape}.")
  times = [
      _timing.interleaved_medians(
          {mode: functools.partial(fns[i], params, x) for mode, fns in compiled.items()},
          repeats=repeats,
      )
      for i in (0, 1)
  ]
  return [
      Result(name, shape, mode, times[0][mode], times[1][mode], _timing.temp_bytes(fwd),
             _timing.temp_bytes(bwd))
      for mode, (fwd, bwd) in compiled.items()
  ]


def _mib(n: int | None) -> str:
  return "n/a" if n is None else _timing.significant(n / 2**20)


LAYER_HEADERS = ("layer", "shape", "mode", "fwd Mtok/s", "x parallel", "fwd+bwd Mtok/s",
                 "x parallel", "fwd temp MiB", "fwd+bwd temp MiB")


def _layer_rows(group: list[Result]) -> list[tuple[str, ...]]:
  """The table rows of one layer at one shape ("n/a" over the reference mode where it was not run)."""
  base = next((r for r in group if r.mode == REFERENCE), None)
  ratio = lambda base_s, s: "n/a" if base is None else f"{base_s / s:.2f}"
  return [
      (
          r.layer,
          str(r.shape),
          r.mode,
          _timing.significant(r.shape.batch * r.shape.length / r.forward_s / 1e6),
          ratio(base and base.forward_s, r.forward_s),
          _timing.significant(r.shape.batch * r.shape.length / r.backward_s / 1e6),
          ratio(base and base.backward_s, r.backward_s),
          _mib(r.forward_bytes),
          _mib(r.backward_bytes),
      )
      for r in group
  ]


@dataclasses.dataclass(frozen=True)
class DepthResult:
  """Compile and step time of one training step of a deep model."""

  depth: int
  pattern: str
  blocks: str
  compile_s: float
  step_s: float
  init_s: float


# The models of the compile-time comparison: LRU blocks, and Griffin's hybrid pattern (two
# recurrent blocks per local-attention block, pre-norm blocks with GeGLU MLPs).
DEPTH_MODELS: dict[str, dict[str, Any]] = {
    "LRU": dict(layer=LAYERS["LRU"]),
    "LRU, LRU, Attention": dict(
        layer=(LAYERS["LRU"], LAYERS["LRU"], functools.partial(LAYERS["Attention"], window=64)),
        block="mixer", norm="rms", mlp="geglu", mlp_expansion=2.0),
}


def _bench_depth(depth: int, shape: Shape, repeats: int, key: Array) -> list[DepthResult]:
  """Gradient of `depth`-block classifiers of each of `DEPTH_MODELS` (those whose pattern fits in
  `depth` blocks), unrolled and `nn.scan`."""
  x = jax.random.normal(key, (shape.batch, shape.length, shape.features))
  labels = jnp.arange(shape.batch) % 10
  results, steps = [], {}
  for pattern, options in DEPTH_MODELS.items():
    if depth < len(layer_pattern(options["layer"])):  # not one whole pattern
      continue
    for scan_blocks in (False, True):
      model = layers.SequenceModel(num_outputs=10, features=shape.features, num_blocks=depth,
                                   scan_blocks=scan_blocks, **options)
      start = time.perf_counter()
      params = jax.block_until_ready(model.init(key, x))  # a new model: compiled for it
      init_s = time.perf_counter() - start

      def loss(params, x, model=model):
        logits = model.apply(params, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

      name = "nn.scan" if scan_blocks else "unrolled"
      compiled, seconds = _timing.compile_timed(jax.grad(loss), params, x)
      steps[pattern, name] = functools.partial(compiled, params, x)
      results.append(DepthResult(depth, pattern, name, seconds, 0.0, init_s))
  times = _timing.interleaved_medians(steps, repeats=repeats)
  return [dataclasses.replace(r, step_s=times[r.pattern, r.blocks]) for r in results]


def _depth_table(results: list[DepthResult], markdown: bool) -> str:
  rows = [(str(r.depth), r.pattern, r.blocks, f"{r.init_s:.2f}", f"{r.compile_s:.2f}",
           _timing.significant(r.step_s * 1e3)) for r in results]
  return _timing.format_table(("blocks", "layer pattern", "applied as", "init s", "compile s",
                               "grad step ms"), rows, markdown=markdown, labels=3)


@dataclasses.dataclass(frozen=True)
class FrontEndResult:
  """Seconds per call of one front end: forward, and gradient of the loss (forward+backward)."""

  front_end: str
  forward_s: float
  backward_s: float


FRONT_ENDS = ("linen (jax.jit)", "nnx (nnx.jit)", "nnx (nnx.jit, graph=False)", "nnx (split, jax.jit)")


def _bench_front_ends(shape: Shape, blocks: int, repeats: int, key: Array) -> list[FrontEndResult]:
  """The same `blocks`-block LRU classifier through linen and NNX, checked equal, then timed."""
  x = jax.random.normal(key, (shape.batch, shape.length, shape.features))
  labels = jnp.arange(shape.batch) % 10
  cross_entropy = lambda logits: -jnp.mean(
      jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))
  model = ssmkit_nnx.SequenceModel(
      shape.features, 10, layer=ssmkit_nnx.LRU,
      features=shape.features, num_blocks=blocks, rngs=nnx.Rngs(0))
  module, variables = ssmkit_nnx.to_linen(model)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  linen_loss = lambda params, x: cross_entropy(module.apply({"params": params}, x))
  split_loss = lambda params, x: cross_entropy(nnx.merge(graphdef, params, rest)(x))
  nnx_loss = lambda model, x: cross_entropy(model(x))
  tree_mode = {"graph": False, "graph_updates": False}  # modules as pytrees: no graph walk
  forward = {
      FRONT_ENDS[0]: functools.partial(jax.jit(module.apply), variables, x),
      FRONT_ENDS[1]: functools.partial(nnx.jit(lambda model, x: model(x)), model, x),
      FRONT_ENDS[2]: functools.partial(nnx.jit(lambda model, x: model(x), **tree_mode), model, x),
      FRONT_ENDS[3]: functools.partial(jax.jit(lambda params, x: nnx.merge(graphdef, params, rest)(x)),
                                       params, x),
  }
  gradient = {
      FRONT_ENDS[0]: functools.partial(jax.jit(jax.grad(linen_loss)), variables["params"], x),
      FRONT_ENDS[1]: functools.partial(nnx.jit(nnx.grad(nnx_loss)), model, x),
      FRONT_ENDS[2]: functools.partial(nnx.jit(nnx.grad(nnx_loss), **tree_mode), model, x),
      FRONT_ENDS[3]: functools.partial(jax.jit(jax.grad(split_loss)), params, x),
  }
  want = np.asarray(forward[FRONT_ENDS[0]]())
  for name, run in forward.items():
    if not np.all(np.abs(np.asarray(run()) - want) <= _RTOL * (np.abs(want) + np.abs(want).max())):
      raise RuntimeError(f"{name} disagrees with the linen model at {shape}.")
  forward_s = _timing.interleaved_medians(forward, repeats=repeats)
  backward_s = _timing.interleaved_medians(gradient, repeats=repeats)
  return [FrontEndResult(name, forward_s[name], backward_s[name]) for name in FRONT_ENDS]


def _front_end_table(results: list[FrontEndResult], markdown: bool) -> str:
  base = results[0]
  rows = [(r.front_end, _timing.significant(r.forward_s * 1e3), _timing.significant(r.backward_s * 1e3),
           f"{r.forward_s / base.forward_s:.2f}", f"{r.backward_s / base.backward_s:.2f}")
          for r in results]
  return _timing.format_table(("front end", "fwd ms", "fwd+bwd ms", "fwd / linen", "fwd+bwd / linen"),
                              rows, markdown=markdown)


def run(*, shapes: str, repeats: int, markdown: bool, layers: list[str] | None = None) -> int:
  """Runs the suite `shapes` and prints its tables.

  Args:
    shapes: "full", "small" or "long" (the `auto` mode at T=4096 and 16384, no depth sweep).
    repeats: timed samples per cell.
    markdown: print markdown tables.
    layers: names of `LAYERS` to run instead of the suite's; the depth sweep (LRU models)
      runs only when "LRU" is among them.

  Returns:
    0, the exit status; 2 for an unknown layer name.
  """
  suite = SUITES[shapes]
  unknown = sorted(set(layers or ()) - set(LAYERS))
  if unknown:
    print(f"ssmkit bench layers: error: unknown layer(s) {', '.join(unknown)}; choose from "
          f"{', '.join(LAYERS)}.", file=sys.stderr)
    return 2
  names = layers or suite.only_layers or tuple(LAYERS)
  print(
      f"{_timing.device_line()}, float32; median of "
      f"{repeats} samples (fewer where they would take over {_timing.CELL_BUDGET_S:g} s), "
      "modes taking turns. Mtok/s: B*T / time. x parallel: the parallel "
      "(lax.associative_scan) mode's time over the mode's. Layers at their defaults: "
      + ", ".join(names) + "."
  )
  print()
  cells = [_Cell(name, shape) for shape in suite.shapes for name in names]
  all_modes = sorted({m for name in names for m in suite.only_modes or modes(name)}, key=len)
  table = _timing.StreamedTable(
      LAYER_HEADERS, [names, [str(s) for s in suite.shapes], all_modes], markdown=markdown
  )
  for i, cell in enumerate(_timing.within_budget(cells, "layers")):
    table.add(_layer_rows(_bench_layer(cell.layer, cell.shape, suite, repeats, jax.random.key(i))))
  depths = suite.depths if "LRU" in names else ()
  if not depths:
    return 0
  print()
  print(f"Gradient of classifiers at {suite.model_shape}, LRU blocks and Griffin's pattern (LRU "
        "for RG-LRU, attention with a window of 64, pre-norm blocks with GeGLU MLPs): blocks "
        "unrolled against nn.scan over stacked parameters (per position of the pattern, and a "
        "tail of the blocks left); init s: the first `model.init` of the model (one program, "
        "compiled); compile s: tracing, lowering and compiling the gradient.")
  print()
  depth = []
  for blocks in _timing.within_budget(depths, "layers depth"):
    depth.extend(_bench_depth(blocks, suite.model_shape, repeats, jax.random.key(blocks)))
  if depth:
    print(_depth_table(depth, markdown))
  blocks = 2
  print()
  print(f"A {blocks}-block LRU classifier at {suite.model_shape}, the same parameters through each "
        "front end: forward, and gradient of the cross-entropy; / linen: the time over linen's. "
        "nnx.jit walks the module's graph in Python on every call; with graph=False it "
        "flattens the modules as pytrees instead, and the split form (nnx.split once, "
        "nnx.merge inside jax.jit) passes only arrays.")
  print()
  for _ in _timing.within_budget(["front ends"], "layers front ends"):
    print(_front_end_table(_bench_front_ends(suite.model_shape, blocks, repeats, jax.random.key(0)),
                           markdown))
  return 0


class _Cell(NamedTuple):
  layer: str
  shape: Shape

  def __str__(self) -> str:
    return f"{self.layer} {self.shape}"
