"""`ssmkit bench rl`: the return estimators of `ssmkit.rl` against jitted rlax.

Each case computes GAE (lambda 0.95) or discounted returns on float32 rollouts (rewards
N(0, 1), discounts U(0.9, 1) with 1% episode ends, values N(0, 1)). rlax handles one
trajectory, so its batched baseline is `jax.jit(jax.vmap(rlax_fn))` with the vmap axes
of the layout: a user with time-major `(T, B)` data maps over axis 1, one with batch-major
`(B, T)` data over axis 0. Every ssmkit mode is first checked against rlax's result, so
the table compares equal results; time is the median of interleaved samples after warm-up.
Each case's rows are printed as soon as they are measured.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import rlax

from ssmkit import rl
from ssmkit.bench import _timing

Array = jax.Array

RLAX = "rlax"
MODES = ("auto", "sequential", "parallel", "chunked")
_LAMBDA = 0.95
_RTOL = 1e-4

# Acceptance criteria: rlax's time over ssmkit auto's.
_MIN_SPEEDUP_TIME_MAJOR_GAE = 2.0
_MIN_SPEEDUP = 1.0  # every other case: no slower


@dataclasses.dataclass(frozen=True)
class Case:
  """One estimator on one rollout layout.

  Attributes:
    estimator: "gae" or "returns" (discounted returns).
    length: T, the steps per trajectory.
    batch: B, the trajectories, or None for a single one.
    time_major: time on axis 0 `(T, B)`, else on axis 1 `(B, T)`.
  """

  estimator: str
  length: int
  batch: int | None = None
  time_major: bool = True

  @property
  def axis(self) -> int:
    return 0 if self.time_major or self.batch is None else 1

  @property
  def shape(self) -> tuple[int, ...]:
    if self.batch is None:
      return (self.length,)
    return (self.length, self.batch) if self.time_major else (self.batch, self.length)

  def __str__(self) -> str:
    name = {"gae": "GAE", "returns": "returns"}[self.estimator]
    if self.batch is None:
      return f"{name} T={self.length}"
    layout = "(T, B)" if self.time_major else "(B, T)"
    return f"{name} {layout} T={self.length} B={self.batch}"


SUITES = {
    "full": tuple(
        [Case(e, 2048, 1024, major) for e in ("gae", "returns") for major in (True, False)]
        + [Case("returns", 65536), Case("gae", 65536)]
    ),
    "small": (Case("gae", 33, 4), Case("returns", 17, 3, time_major=False), Case("returns", 50)),
}


def _inputs(case: Case, key: Array) -> tuple[Array, Array, Array]:
  """Rewards, discounts and values (T + 1 entries on the time axis), float32."""
  k_r, k_d, k_end, k_v = jax.random.split(key, 4)
  rewards = jax.random.normal(k_r, case.shape)
  ends = jax.random.uniform(k_end, case.shape) < 0.01
  discounts = jnp.where(ends, 0.0, jax.random.uniform(k_d, case.shape, minval=0.9, maxval=1.0))
  values_shape = list(case.shape)
  values_shape[case.axis] += 1
  return rewards, discounts, jax.random.normal(k_v, values_shape)


def _rlax(case: Case) -> Callable[[Array, Array, Array], Array]:
  """rlax on one trajectory, vmapped over the batch axis of the layout."""
  if case.estimator == "gae":
    def single(r, d, v):
      return rlax.truncated_generalized_advantage_estimation(r, d, _LAMBDA, v)
  else:
    def single(r, d, v):
      return rlax.discounted_returns(r, d, v[-1])
  if case.batch is None:
    return single
  axis = 1 if case.time_major else 0
  return jax.vmap(single, in_axes=axis, out_axes=axis)


def _ours(case: Case, mode: str) -> Callable[[Array, Array, Array], Array]:
  if case.estimator == "gae":
    return lambda r, d, v: rl.generalized_advantage_estimation(
        r, d, v, _LAMBDA, axis=case.axis, mode=mode
    )
  last = functools.partial(jax.lax.index_in_dim, index=-1, axis=case.axis, keepdims=False)
  return lambda r, d, v: rl.discounted_returns(r, d, last(v), axis=case.axis, mode=mode)


@dataclasses.dataclass(frozen=True)
class Result:
  """One row of the table: time in seconds, memory in bytes."""

  case: Case
  method: str
  seconds: float
  temp_bytes: int | None


def _bench_case(case: Case, repeats: int, key: Array) -> list[Result]:
  """Compiles and checks every method against rlax, then times them, taking turns."""
  args = _inputs(case, key)
  methods = {RLAX: _rlax(case), **{f"ssmkit {m}": _ours(case, m) for m in MODES}}
  compiled = {name: _timing.compile_timed(fn, *args)[0] for name, fn in methods.items()}
  want = np.asarray(compiled[RLAX](*args))
  for name, fn in compiled.items():
    got = np.asarray(fn(*args))
    if not np.all(np.abs(got - want) <= _RTOL * (np.abs(want) + np.abs(want).max())):
      raise RuntimeError(
          f"{name} disagrees with {RLAX} at {case}: max error {np.abs(got - want).max():.3g}."
      )
  seconds = _timing.interleaved_medians(
      {name: functools.partial(fn, *args) for name, fn in compiled.items()}, repeats=repeats
  )
  return [
      Result(case, name, seconds[name], _timing.temp_bytes(fn)) for name, fn in compiled.items()
  ]


HEADERS = ("case", "method", "ms", "speed-up vs rlax", "temp MiB")


def _rows(group: list[Result]) -> list[tuple[str, ...]]:
  """The table rows of one case's results."""
  base = next(r.seconds for r in group if r.method == RLAX)
  return [
      (
          str(r.case),
          r.method,
          _timing.significant(r.seconds * 1e3),
          f"{base / r.seconds:.2f}",
          "n/a" if r.temp_bytes is None else _timing.significant(r.temp_bytes / 2**20),
      )
      for r in group
  ]


def criteria(results: list[Result]) -> list[tuple[bool, str]]:
  """Judges each case: ssmkit auto's speed-up over rlax against the case's floor."""
  found = []
  for case in dict.fromkeys(r.case for r in results):
    times = {r.method: r.seconds for r in results if r.case == case}
    speedup = times[RLAX] / times["ssmkit auto"]
    floor = (
        _MIN_SPEEDUP_TIME_MAJOR_GAE
        if case.estimator == "gae" and case.batch is not None and case.time_major
        else _MIN_SPEEDUP
    )
    found.append((speedup >= floor, f"{case}: auto {speedup:.2f}x rlax's speed (floor {floor:.1f}x)"))
  return found


def run(*, shapes: str, repeats: int, markdown: bool) -> int:
  """Runs the cases of the suite `shapes` ("full" or "small"), printing each case's rows as
  measured, then the criteria.

  Returns:
    0, the exit status; a failed criterion is reported, not raised.
  """
  cases = SUITES[shapes]
  device = jax.devices()[0]
  print(
      f"jax {jax.__version__}, rlax {rlax.__version__}, {device.platform} "
      f"({device.device_kind}), float32; median of {repeats} samples (fewer where they would "
      f"take over {_timing.CELL_BUDGET_S:g} s), methods taking turns; everything jitted. "
      "speed-up: rlax's time over the method's."
  )
  print()
  methods = [RLAX, *(f"ssmkit {m}" for m in MODES)]
  table = _timing.StreamedTable(HEADERS, [[str(c) for c in cases], methods], markdown=markdown)
  results = []
  for i, case in enumerate(_timing.within_budget(cases, "rl")):
    group = _bench_case(case, repeats, jax.random.key(i))
    table.add(_rows(group))
    results.extend(group)
  if not results:
    return 0
  print()
  print("Criteria (ssmkit auto against jit(vmap(rlax))):")
  for passed, text in criteria(results):
    print(f"{'- ' if markdown else ''}{'PASS' if passed else 'FAIL'}  {text}")
  return 0
