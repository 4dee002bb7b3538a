"""`ssmkit bench sequence-parallel`: `linear_recurrence` split over devices against one device.

For every shape, h_t = a_t * h_{t-1} + b_t (float32, a_t ~ U(0.5, 1), b_t ~ N(0, 1)) runs
on the first device alone and with time split over every device (`jax.shard_map` over a
mesh axis "seq", `axis_name="seq"`); the forward pass and the gradient of sum(h * w) with
respect to `a` and `b` are timed. The sequence-parallel h, da and db are first checked
against the one-device ones.

Host (CPU) devices share the machine's cores and memory bandwidth, so on them this is a
correctness and overhead measurement, not a speed claim: it shows what the collectives and
the per-device reduction cost, while the speed-up of splitting a long sequence needs devices
with their own compute and memory (GPUs, TPUs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ssmkit.bench import _timing
from ssmkit.scan import linear_recurrence

Array = jax.Array

ONE = "one device"
SPLIT = "sequence-parallel"

# Agreement with the one-device result: elementwise, relative to the largest magnitude.
_RTOL = 1e-4
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


def run(*, shapes: str, repeats: int, markdown: bool) -> int:
  """Runs the benchmark suite named `shapes` on every device, printing each shape's rows as
  measured.

  Args:
    shapes: a key of `SUITES`: "full", or "small" for a run of a few seconds.
    repeats: timed samples per cell, the methods taking turns; the median is shown.
    markdown: print a GitHub markdown table instead of plain text.

  Returns:
    0, the exit status, also when fewer than two devices are present (the message says
    how to get host devices).
  """
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
  return 0
