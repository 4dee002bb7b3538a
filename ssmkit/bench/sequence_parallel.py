"""`ssmkit bench sequence-parallel`: scans and layers split over devices against one device.

Three tables, all in float32:

- `linear_recurrence`: for every shape, h_t = a_t * h_{t-1} + b_t (a_t ~ U(0.5, 1),
  b_t ~ N(0, 1)) runs on the first device alone and with time split over every device
  (`jax.shard_map` over a mesh axis "seq", `axis_name="seq"`); the forward pass and the
  gradient of sum(h * w) with respect to `a` and `b` are timed, after h, da and db are
  checked against the one-device ones.
- The devices' state maps combined by all-gather or in log2(devices) rounds of `ppermute`
  (`ssmkit._src.state_pass.across_devices`), for the chunked delta rule, whose `(K, K)` maps
  make the combine cost the most, over 2, 4, ... devices.
- Every registered layer at its defaults: the gradient of sum(layer(x) * w) on one device and
  split over every device, checked, timed, and the bytes of the results of the collectives
  in the split program (what each device holds after them).

Host (CPU) devices share the machine's cores and memory bandwidth, so on them this is a
correctness and overhead measurement, not a speed claim: it shows what the collectives and
the per-device reduction cost, while the speed-up of splitting a long sequence needs devices
with their own compute and memory (GPUs, TPUs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ssmkit._src import state_pass
from ssmkit._src.layers.registry import LAYERS
from ssmkit.bench import _timing, linear_attention
from ssmkit.scan import delta_rule, linear_recurrence

Array = jax.Array

ONE = "one device"
SPLIT = "sequence-parallel"

# Agreement with the one-device result: elementwise, relative to the largest magnitude. A
# layer's gradient passes through many more reassociated sums than one recurrence's.
_RTOL = 1e-4
_LAYER_RTOL = 2e-3
_HOW_TO_GET_DEVICES = (
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 ssmkit bench sequence-parallel"
)


@dataclasses.dataclass(frozen=True)
class Shape:
  """Input shape `(T, D)`, time on axis 0; T is rounded down to a multiple of the devices.

  Attributes:
    length: T, the number of time steps.
    features: D, the state width.
  """

  length: int
  features: int

  def __str__(self) -> str:
    return f"T={self.length} D={self.features}"


SUITES = {
    "full": (Shape(2**16, 256), Shape(2**18, 16), Shape(2**20, 1)),
    "small": (Shape(64, 2),),
}


def _loss_grad(recurrence: Callable[[Array, Array], Array]):
  """d/d(a, b) of sum(h * w); `w` is an argument so it is not baked into the program."""
  return jax.grad(lambda a, b, w: jnp.sum(recurrence(a, b) * w), argnums=(0, 1))


def _methods(mesh: Mesh) -> dict[str, Callable[[Array, Array], Array]]:
  split = jax.shard_map(
      functools.partial(linear_recurrence, axis_name="seq"),
      mesh=mesh,
      in_specs=(P("seq"), P("seq")),
      out_specs=P("seq"),
  )
  return {ONE: linear_recurrence, SPLIT: split}


def _inputs(shape: Shape, key: Array) -> tuple[Array, Array, Array]:
  dims = (shape.length, shape.features)
  key_a, key_b, key_w = jax.random.split(key, 3)
  a = jax.random.uniform(key_a, dims, jnp.float32, minval=0.5, maxval=1.0)
  b = jax.random.normal(key_b, dims, jnp.float32)
  w = jax.random.normal(key_w, dims, jnp.float32)
  return a, b, w


def _relative_error(got: tuple[Array, ...], want: tuple[Array, ...], shape: Shape) -> float:
  """The largest error of h, da and db, relative to each one's largest magnitude.

  Raises:
    RuntimeError: when one of them is past `_RTOL`.
  """
  worst = 0.0
  for label, x, y in zip(("h", "da", "db"), got, want, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    error = float(np.abs(x - y).max() / max(float(np.abs(y).max()), 1e-30))
    if error > _RTOL:
      raise RuntimeError(f"{SPLIT} disagrees with {ONE} on {label} at {shape}: error {error:.3g}.")
    worst = max(worst, error)
  return worst


@dataclasses.dataclass(frozen=True)
class Result:
  """One row of the table: times in seconds."""

  shape: Shape
  method: str
  forward_s: float
  gradient_s: float
  error: float | None


def _bench_shape(shape: Shape, mesh: Mesh, repeats: int, key: Array) -> list[Result]:
  """Checks the sequence-parallel result against one device's at `shape`, then times both."""
  a, b, w = _inputs(shape, key)
  placed = {
      ONE: (a, b, w),
      SPLIT: tuple(jax.device_put(x, NamedSharding(mesh, P("seq"))) for x in (a, b, w)),
  }
  thunks, outputs = {}, {}
  for name, recurrence in _methods(mesh).items():
    a_, b_, w_ = placed[name]
    forward, _ = _timing.compile_timed(recurrence, a_, b_)
    gradient, _ = _timing.compile_timed(_loss_grad(recurrence), a_, b_, w_)
    outputs[name] = (forward(a_, b_), *gradient(a_, b_, w_))
    thunks[name, "forward"] = functools.partial(forward, a_, b_)
    thunks[name, "gradient"] = functools.partial(gradient, a_, b_, w_)
  error = _relative_error(outputs[SPLIT], outputs[ONE], shape)
  seconds = _timing.interleaved_medians(thunks, repeats=repeats)
  return [
      Result(shape, name, seconds[name, "forward"], seconds[name, "gradient"],
             error if name == SPLIT else None)
      for name in (ONE, SPLIT)
  ]


def _gathered_kib(shape: Shape, devices: int) -> str:
  """Bytes each device holds after the all-gather of one map (A, B) per device, in KiB."""
  return _timing.significant(devices * 2 * shape.features * 4 / 2**10)


HEADERS = ("shape", "method", "fwd ms", "fwd x", "fwd+bwd ms", "fwd+bwd x", "max rel err",
           "gathered KiB")


def _rows(group: list[Result], devices: int) -> list[tuple[str, ...]]:
  """The table rows of one shape's results."""
  one = next(r for r in group if r.method == ONE)
  return [
      (
          str(r.shape),
          r.method if r.method == ONE else f"{r.method} x{devices}",
          _timing.significant(r.forward_s * 1e3),
          f"{r.forward_s / one.forward_s:.2f}",
          _timing.significant(r.gradient_s * 1e3),
          f"{r.gradient_s / one.gradient_s:.2f}",
          "-" if r.error is None else f"{r.error:.1e}",
          "-" if r.method == ONE else _gathered_kib(r.shape, devices),
      )
      for r in group
  ]


# ---------------------------------------------------------------------------------------------
# Combining the devices' maps: all-gather against log2(devices) rounds of ppermute


# Gated delta rule inputs `(B, T, H, K)`, V = K: the `(K, K)` maps the combine composes.
COMBINE_SUITES = {"full": linear_attention.Shape(1, 2048, 4, 64),
                  "small": linear_attention.Shape(1, 64, 1, 4)}
COMBINES = ("gather", "ppermute")


@contextlib.contextmanager
def _combining(combine: str) -> Iterator[None]:
  """Traces the scans inside with `combine` on every mesh size."""
  saved = state_pass.GATHER_MAX_DEVICES
  state_pass.GATHER_MAX_DEVICES = 2**31 if combine == "gather" else 0
  try:
    yield
  finally:
    state_pass.GATHER_MAX_DEVICES = saved


def _map_kib(shape: linear_attention.Shape, devices: int, combine: str) -> str:
  """The `(K, K)` and `(K, V)` maps one device holds while combining, in KiB (float32)."""
  held = devices if combine == "gather" else 2
  return _timing.significant(held * shape.batch * shape.heads * 2 * shape.dim**2 * 4 / 2**10)


COMBINE_HEADERS = ("devices", "combine", "fwd ms", "fwd+bwd ms", "fwd+bwd x", "maps held KiB")


def _bench_combine(shape: linear_attention.Shape, devices: list, counts: list[int], repeats: int
                   ) -> list[tuple[str, ...]]:
  """The chunked delta rule's forward and gradient over each of `counts` devices, each way."""
  (q, k, v, g, beta), _ = linear_attention.inputs("delta_rule", shape, jax.random.key(0))
  inputs = (q, k, v, beta, g)
  time = P(None, "seq")
  rows = []
  for count in counts:
    mesh = Mesh(np.array(devices[:count]), ("seq",))
    thunks, results = {}, {}
    for combine in COMBINES:
      # A new function for each way, so that no trace of the other is reused.
      rule = jax.shard_map(lambda *x: delta_rule(*x, mode="chunked", axis_name="seq"),
                           mesh=mesh, in_specs=(time,) * 5, out_specs=time)
      loss = lambda *x, rule=rule: jnp.sum(jnp.sin(rule(*x)))
      with _combining(combine):
        forward, _ = _timing.compile_timed(rule, *inputs)
        gradient, _ = _timing.compile_timed(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *inputs)
      results[combine] = gradient(*inputs)
      thunks[combine, "forward"] = functools.partial(forward, *inputs)
      thunks[combine, "gradient"] = functools.partial(gradient, *inputs)
    for got, want in zip(results["ppermute"], results["gather"], strict=True):
      error = float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))
      if error > _RTOL:
        raise RuntimeError(f"the combines disagree on {count} devices at {shape}: error {error:.3g}.")
    seconds = _timing.interleaved_medians(thunks, repeats=repeats)
    for combine in COMBINES:
      rows.append((str(count), combine, _timing.significant(seconds[combine, "forward"] * 1e3),
                   _timing.significant(seconds[combine, "gradient"] * 1e3),
                   f"{seconds[combine, 'gradient'] / seconds['gather', 'gradient']:.2f}",
                   _map_kib(shape, count, combine)))
  return rows


# ---------------------------------------------------------------------------------------------
# Every layer: one step of its gradient on one device and split over all, and what crosses


LAYER_SUITES = {"full": (1, 2048, 64), "small": (1, 64, 16)}  # (B, T, H)
LAYER_HEADERS = ("layer", "one device ms", "split ms", "split x", "max rel err",
                 "collective KiB")
# XLA's collectives, by the name of their (first) op in the compiled HLO.
_COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "reduce-scatter", "all-to-all")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "c64": 8, "c128": 16}


def collective_bytes(compiled: jax.stages.Compiled) -> int:
  """The bytes of the results of every collective in `compiled`'s HLO, for one device: what a
  device holds after them (an all-gather's whole result, a permute's received block)."""
  total = 0
  for line in compiled.as_text().splitlines():
    match = re.search(r"=\s*(.*?)\s(" + "|".join(_COLLECTIVES) + r")(-start)?\(", line)
    if match is None:
      continue
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", match.group(1)):
      if dtype in _BYTES:
        total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _bench_layer(name: str, make: Callable[[], Any], size: tuple[int, int, int], mesh: Mesh,
                 repeats: int) -> tuple[str, ...]:
  """The gradient of one layer's loss on one device and split over `mesh`, checked and timed."""
  batch, length, width = size
  layer = make()
  key_x, key_w = jax.random.split(jax.random.key(1))
  x = jax.random.normal(key_x, (batch, length, width))
  w = jax.random.normal(key_w, (batch, length, width))
  params = jax.jit(layer.init)(jax.random.key(0), x)
  time = P(None, "seq")
  split = jax.shard_map(functools.partial(layer.apply, axis_name="seq"), mesh=mesh,
                        in_specs=(P(), time), out_specs=time)
  compiled, outputs, thunks = {}, {}, {}
  for method, apply in ((ONE, layer.apply), (SPLIT, split)):
    grad = jax.value_and_grad(lambda p, x, w, apply=apply: jnp.sum(apply(p, x) * w), argnums=(0, 1))
    compiled[method], _ = _timing.compile_timed(grad, params, x, w)
    outputs[method] = jax.tree.leaves(compiled[method](params, x, w))
    thunks[method] = functools.partial(compiled[method], params, x, w)
  error = max(float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
              for a, b in zip(outputs[SPLIT], outputs[ONE], strict=True))
  if error > _LAYER_RTOL:
    raise RuntimeError(f"{name} split over devices disagrees with one device: error {error:.3g}.")
  seconds = _timing.interleaved_medians(thunks, repeats=repeats)
  return (name, _timing.significant(seconds[ONE] * 1e3), _timing.significant(seconds[SPLIT] * 1e3),
          f"{seconds[SPLIT] / seconds[ONE]:.2f}", f"{error:.1e}",
          _timing.significant(collective_bytes(compiled[SPLIT]) / 2**10))


def run(*, shapes: str, repeats: int, markdown: bool, layers: list[str] | None = None) -> int:
  """Runs the benchmark suite named `shapes` on every device, printing each shape's rows as
  measured.

  Args:
    shapes: a key of `SUITES`: "full", or "small" for a run of a few seconds.
    repeats: timed samples per cell, the methods taking turns; the median is shown.
    markdown: print a GitHub markdown table instead of plain text.
    layers: the layers of the last table, by class name; None: every registered layer.

  Returns:
    0, the exit status, also when fewer than two devices are present (the message says
    how to get host devices); 2 for an unknown layer name.
  """
  chosen = {entry.layer.__name__: entry.layer for entry in LAYERS.values()}
  unknown = sorted(set(layers or ()) - set(chosen))
  if unknown:
    print(f"ssmkit bench sequence-parallel: unknown layer(s) {', '.join(unknown)}; choose from "
          f"{', '.join(chosen)}.", file=sys.stderr)
    return 2
  if layers:
    chosen = {name: chosen[name] for name in layers}
  devices = jax.devices()
  if len(devices) < 2:
    print(
        f"ssmkit bench sequence-parallel needs at least 2 devices, found {len(devices)} "
        f"({devices[0].platform}). On a CPU host, ask XLA for host devices:\n  {_HOW_TO_GET_DEVICES}"
    )
    return 0
  mesh = Mesh(np.array(devices), ("seq",))
  n = len(devices)
  suite = [Shape(s.length - s.length % n, s.features) for s in SUITES[shapes]]
  device = devices[0]
  print(
      f"jax {jax.__version__}, {n} {device.platform} devices ({device.device_kind}), float32; "
      f"median of {repeats} samples per time (fewer where they would take over "
      f"{_timing.CELL_BUDGET_S:g} s), methods taking turns. x: time over {ONE}'s."
  )
  if device.platform == "cpu":
    print(
        "Host devices share this machine's cores and memory: a correctness and overhead "
        "measurement of the sequence-parallel path, not a speed claim."
    )
  print(
      f"max rel err: of h, da and db against {ONE}'s. gathered KiB: the maps (A, B) every "
      "device holds after the forward all-gather; the backward pass reduce-scatters as much."
  )
  print()
  table = _timing.StreamedTable(
      HEADERS, [[str(s) for s in suite], [ONE, f"{SPLIT} x{n}"]], markdown=markdown
  )
  for i, shape in enumerate(_timing.within_budget(suite, "sequence-parallel")):
    table.add(_rows(_bench_shape(shape, mesh, repeats, jax.random.key(i)), n))

  combine_shape = COMBINE_SUITES[shapes]
  print(f"\nCombining the devices' state maps, `delta_rule` chunked at {combine_shape}: all-gathered "
        f"(up to {state_pass.GATHER_MAX_DEVICES} devices by default) or in log2(devices) rounds "
        "of ppermute. x: time over the all-gather's; maps held: per device while combining.\n")
  # The full suite doubles the devices from 2; the small one takes them all at once.
  counts = [2**i for i in range(1, n.bit_length()) if 2**i <= n] if shapes == "full" else [n]
  table = _timing.StreamedTable(COMBINE_HEADERS, [list(map(str, counts)), COMBINES],
                                markdown=markdown)
  table.add(_bench_combine(combine_shape, devices, counts, repeats))

  batch, length, width = LAYER_SUITES[shapes]
  size = (batch, length - length % n, width)
  print(f"\nEvery layer at its defaults, B={batch} T={size[1]} H={width}: the gradient of "
        f"sum(layer(x) * w) on {ONE} and split over {n} devices. collective KiB: the results of "
        "the split program's collectives on one device (all-gathers whole, permutes as received).\n")
  table = _timing.StreamedTable(LAYER_HEADERS, [list(chosen)], markdown=markdown)
  for name in _timing.within_budget(list(chosen), "sequence-parallel layers"):
    table.add([_bench_layer(name, chosen[name], size, mesh, repeats)])
  return 0
