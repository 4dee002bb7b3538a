"""`ssmkit bench scan`: `linear_recurrence` against hand-written `lax` scans.

For every shape, each method computes h_t = a_t * h_{t-1} + b_t (float32, h_{-1} = 0,
a_t ~ U(0.5, 1), b_t ~ N(0, 1)); the forward pass and the gradient of sum(h * w) with
respect to `a` and `b` (w ~ N(0, 1), so the cotangent is not all ones) are timed. Every
method is first checked against the `lax.scan` baseline, so the table compares equal
results. Each shape's rows are printed as soon as they are measured; a method that takes
seconds per call (`lax.scan` of 65536 steps on a GPU) is sampled fewer times (see
`_timing.interleaved_medians`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ssmkit.bench import _timing
from ssmkit.scan import linear_recurrence

Array = jax.Array
Recurrence = Callable[[Array, Array], Array]

SCAN = "lax.scan"
ASSOCIATIVE = "lax.associative_scan"
AUTO = "ssmkit auto"
BASELINES = (SCAN, ASSOCIATIVE)

# Agreement with the lax.scan result: elementwise, relative to the largest magnitude.
_RTOL = 1e-4

# Acceptance criteria of `linear_recurrence` in auto mode.
_MAX_SLOWDOWN = 1.10  # time over the better baseline, forward and forward+backward.
_MAX_MEMORY_VS_ASSOCIATIVE = 0.35  # fwd+bwd temp memory over lax.associative_scan's.
_MAX_COMPILE_VS_SCAN = 3.0  # gradient compile time over lax.scan's.


@dataclasses.dataclass(frozen=True)
class Shape:
  """Input shape `(T, D)` with time on axis 0, or `(B, T, D)` with time on axis 1.

  Attributes:
    length: T, the number of time steps.
    features: D, the state width.
    batch: B, or None for an unbatched `(T, D)` input.
  """

  length: int
  features: int
  batch: int | None = None

  @property
  def dims(self) -> tuple[int, ...]:
    dims = (self.length, self.features)
    return dims if self.batch is None else (self.batch, *dims)

  @property
  def axis(self) -> int:
    return 0 if self.batch is None else 1

  def __str__(self) -> str:
    text = f"T={self.length} D={self.features}"
    return text if self.batch is None else f"B={self.batch} {text}"


@dataclasses.dataclass(frozen=True)
class Suite:
  """The shapes of one run and the ones two of the criteria are judged at.

  Attributes:
    shapes: every shape benchmarked, in order.
    compile_shape: where gradient compile time is compared with `lax.scan`'s.
    memory_shape: where temp memory is compared with `lax.associative_scan`'s.
  """

  shapes: tuple[Shape, ...]
  compile_shape: Shape
  memory_shape: Shape


SUITES = {
    "full": Suite(
        shapes=(
            Shape(65536, 1),
            Shape(16384, 64),
            Shape(4096, 256),
            Shape(1024, 1024),
            Shape(65536, 256),
            Shape(4096, 256, batch=16),
        ),
        compile_shape=Shape(65536, 1),
        memory_shape=Shape(65536, 256),
    ),
    "small": Suite(
        shapes=(Shape(64, 2), Shape(16, 2, batch=2)),
        compile_shape=Shape(64, 2),
        memory_shape=Shape(64, 2),
    ),
}


def _scan_baseline(a: Array, b: Array) -> Array:
  """h_t = a_t * h_{t-1} + b_t written directly with `lax.scan` over the leading axis."""

  def step(h_prev, x_t):
    a_t, b_t = x_t
    h_t = a_t * h_prev + b_t
    return h_t, h_t

  _, h = lax.scan(step, jnp.zeros_like(b[0]), (a, b))
  return h


def _affine(x, y):
  """Composes h -> a1 * h + b1 then h -> a2 * h + b2."""
  a1, b1 = x
  a2, b2 = y
  return a1 * a2, a2 * b1 + b2


def _methods(axis: int) -> dict[str, Recurrence]:
  """The rows of the table, each mapping `(a, b)` with time on `axis` to `h`."""

  def associative(a, b):
    return lax.associative_scan(_affine, (a, b), axis=axis)[1]

  def ours(**options) -> Recurrence:
    return lambda a, b: linear_recurrence(a, b, axis=axis, **options)

  return {
      # A user scans one sequence and vmaps over the batch (axis 0, before time).
      SCAN: _scan_baseline if axis == 0 else jax.vmap(_scan_baseline),
      ASSOCIATIVE: associative,
      AUTO: ours(mode="auto"),
      "ssmkit sequential": ours(mode="sequential"),
      "ssmkit parallel": ours(mode="parallel"),
      "ssmkit chunked/seq": ours(mode="chunked", inner="sequential"),
      "ssmkit chunked/par": ours(mode="chunked", inner="parallel"),
  }


def _loss_grad(recurrence: Recurrence) -> Callable[[Array, Array, Array], tuple[Array, Array]]:
  """d/d(a, b) of sum(h * w); `w` is an argument so it is not baked into the program."""
  return jax.grad(lambda a, b, w: jnp.sum(recurrence(a, b) * w), argnums=(0, 1))


def _inputs(shape: Shape, key: Array) -> tuple[Array, Array, Array]:
  key_a, key_b, key_w = jax.random.split(key, 3)
  a = jax.random.uniform(key_a, shape.dims, jnp.float32, minval=0.5, maxval=1.0)
  b = jax.random.normal(key_b, shape.dims, jnp.float32)
  w = jax.random.normal(key_w, shape.dims, jnp.float32)
  return a, b, w


def _check_close(name: str, shape: Shape, got: tuple[Array, ...], want: tuple[Array, ...]):
  """Raises if `name` disagrees with the baseline on h, da or db beyond `_RTOL`."""
  for label, x, y in zip(("h", "da", "db"), got, want, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    scale = float(np.abs(y).max())
    error = float(np.abs(x - y).max())
    if not np.all(np.abs(x - y) <= _RTOL * (np.abs(y) + scale)):
      raise RuntimeError(
          f"{name} disagrees with {SCAN} on {label} at {shape}: max error {error:.3g} "
          f"(largest |{label}| {scale:.3g})."
      )


@dataclasses.dataclass(frozen=True)
class Result:
  """One row of the table: times in seconds, memory in bytes."""

  shape: Shape
  method: str
  forward_s: float
  gradient_s: float
  gradient_temp_bytes: int | None
  gradient_compile_s: float


class _Compiled(NamedTuple):
  forward: jax.stages.Compiled
  gradient: jax.stages.Compiled
  gradient_compile_s: float


def _compile_and_check(shape: Shape, a: Array, b: Array, w: Array) -> dict[str, _Compiled]:
  """Compiles every method's forward and gradient and checks them against `lax.scan`'s."""
  compiled = {}
  reference = None
  for name, recurrence in _methods(shape.axis).items():
    forward, _ = _timing.compile_timed(recurrence, a, b)
    gradient, compile_s = _timing.compile_timed(_loss_grad(recurrence), a, b, w)
    outputs = (forward(a, b), *gradient(a, b, w))
    if reference is None:
      reference = outputs
    else:
      _check_close(name, shape, outputs, reference)
    compiled[name] = _Compiled(forward, gradient, compile_s)
  return compiled


def _bench_shape(shape: Shape, repeats: int, key: Array) -> list[Result]:
  """Checks every method at `shape`, then times them, taking turns."""
  a, b, w = _inputs(shape, key)
  compiled = _compile_and_check(shape, a, b, w)
  thunks = {}
  for name, (forward, gradient, _) in compiled.items():
    thunks[name, "forward"] = functools.partial(forward, a, b)
    thunks[name, "gradient"] = functools.partial(gradient, a, b, w)
  seconds = _timing.interleaved_medians(thunks, repeats=repeats)
  return [
      Result(
          shape=shape,
          method=name,
          forward_s=seconds[name, "forward"],
          gradient_s=seconds[name, "gradient"],
          gradient_temp_bytes=_timing.temp_bytes(gradient),
          gradient_compile_s=compile_s,
      )
      for name, (_, gradient, compile_s) in compiled.items()
  ]


def _warm_up() -> None:
  """Runs two gradients on a tiny input, so the first timed compile pays no first-use cost."""
  shape = Shape(8, 2)
  a, b, w = _inputs(shape, jax.random.key(0))
  methods = _methods(shape.axis)
  for name in (SCAN, AUTO):
    jax.block_until_ready(jax.jit(_loss_grad(methods[name]))(a, b, w))


def _mib(n: int | None) -> str:
  return "n/a" if n is None else _timing.significant(n / 2**20)


HEADERS = ("shape", "method", "fwd ms", "fwd x", "fwd+bwd ms", "fwd+bwd x", "temp MiB", "compile s")


def _rows(group: list[Result]) -> list[tuple[str, ...]]:
  """The table rows of one shape's results."""
  best_forward = min(r.forward_s for r in group if r.method in BASELINES)
  best_gradient = min(r.gradient_s for r in group if r.method in BASELINES)
  return [
      (
          str(r.shape),
          r.method,
          _timing.significant(r.forward_s * 1e3),
          f"{r.forward_s / best_forward:.2f}",
          _timing.significant(r.gradient_s * 1e3),
          f"{r.gradient_s / best_gradient:.2f}",
          _mib(r.gradient_temp_bytes),
          f"{r.gradient_compile_s:.2f}",
      )
      for r in group
  ]


@dataclasses.dataclass(frozen=True)
class Criterion:
  """One acceptance criterion: whether it holds, and a line saying what was measured."""

  passed: bool
  text: str


def _ratio(group: dict[str, Result], field: str, baselines: tuple[str, ...]) -> float:
  """`AUTO`'s `field` over the best of `baselines`, within one shape's results."""
  return getattr(group[AUTO], field) / min(getattr(group[m], field) for m in baselines)


def _worst(
    by_shape: dict[Shape, dict[str, Result]], field: str, baselines: tuple[str, ...]
) -> tuple[float, Shape]:
  """The largest `_ratio` over all shapes, and the shape where it occurs."""
  return max(((_ratio(g, field, baselines), s) for s, g in by_shape.items()), key=lambda x: x[0])


def criteria(results: list[Result], suite: Suite) -> list[Criterion]:
  """Judges the acceptance criteria of `linear_recurrence` (auto mode) on `results`.

  The memory and compile-time criteria, judged at one shape each, are left out when that
  shape was not measured (a `bench all` budget skipped it).
  """
  by_shape: dict[Shape, dict[str, Result]] = {}
  for r in results:
    by_shape.setdefault(r.shape, {})[r.method] = r
  found = []
  for field, what in (("forward_s", "fwd"), ("gradient_s", "fwd+bwd")):
    worst, at = _worst(by_shape, field, BASELINES)
    found.append(
        Criterion(
            worst <= _MAX_SLOWDOWN,
            f"{what} time of auto <= {_MAX_SLOWDOWN:.2f}x the better baseline at every shape "
            f"(worst {worst:.2f}x at {at})",
        )
    )
  if all(r.gradient_temp_bytes is not None for r in results):
    worst, at = _worst(by_shape, "gradient_temp_bytes", (SCAN,))
    found.append(
        Criterion(
            worst <= 1.0,
            f"fwd+bwd temp memory of auto <= {SCAN}'s at every shape (worst {worst:.2f}x at {at})",
        )
    )
    shape = suite.memory_shape
    if shape in by_shape:
      ratio = _ratio(by_shape[shape], "gradient_temp_bytes", (ASSOCIATIVE,))
      found.append(
          Criterion(
              ratio <= _MAX_MEMORY_VS_ASSOCIATIVE,
              f"fwd+bwd temp memory of auto <= {_MAX_MEMORY_VS_ASSOCIATIVE}x {ASSOCIATIVE}'s "
              f"at {shape} ({ratio:.3f}x)",
          )
      )
  shape = suite.compile_shape
  if shape in by_shape:
    ratio = _ratio(by_shape[shape], "gradient_compile_s", (SCAN,))
    found.append(
        Criterion(
            ratio <= _MAX_COMPILE_VS_SCAN,
            f"gradient compile time of auto <= {_MAX_COMPILE_VS_SCAN:.0f}x {SCAN}'s at {shape} "
            f"({ratio:.2f}x)",
        )
    )
  return found


def run(*, shapes: str, repeats: int, markdown: bool) -> int:
  """Runs the benchmark suite named `shapes`, printing each shape's rows as measured.

  Args:
    shapes: a key of `SUITES`: "full", or "small" for a run of a few seconds.
    repeats: timed samples per cell, the methods taking turns; the median is shown.
    markdown: print a GitHub markdown table instead of plain text.

  Returns:
    0, the exit status; a failed criterion is reported, not raised.
  """
  suite = SUITES[shapes]
  _warm_up()
  print(
      f"{_timing.device_line()}, float32; median of "
      f"{repeats} samples per time (fewer where they would take over "
      f"{_timing.CELL_BUDGET_S:g} s), methods taking turns. x: time over the better of "
      f"{SCAN} and {ASSOCIATIVE}. temp MiB, compile s: of the fwd+bwd function."
  )
  print()
  table = _timing.StreamedTable(
      HEADERS, [[str(s) for s in suite.shapes], list(_methods(0))], markdown=markdown
  )
  results = []
  for i, shape in enumerate(_timing.within_budget(suite.shapes, "scan")):
    group = _bench_shape(shape, repeats, jax.random.key(i))
    table.add(_rows(group))
    results.extend(group)
  if not results:
    return 0
  print()
  if shapes == "full":
    print("Criteria (auto mode of linear_recurrence):")
    for c in criteria(results, suite):
      print(f"{'- ' if markdown else ''}{'PASS' if c.passed else 'FAIL'}  {c.text}")
  else:
    print(_timing.SMALL_SHAPES_NOTE)
  return 0
