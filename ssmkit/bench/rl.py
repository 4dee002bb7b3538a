"""`ssmkit bench rl`: the return estimators of `ssmkit.rl` against jitted rlax.

Each case computes GAE (lambda 0.95), discounted returns, V-trace errors (lambda 0.95,
importance ratios exp(N(0, 0.5^2))) or Retrace errors (lambda 0.95, 4 actions, target
policy softmax(N(0, 1)), behaviour probabilities U(0.1, 1)) on float32 rollouts (rewards
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
_ACTIONS = 4
_RTOL = 1e-4

# Acceptance criteria: rlax's time over ssmkit auto's.
_MIN_SPEEDUP_TIME_MAJOR_GAE = 2.0
_MIN_SPEEDUP = 1.0  # every other case: no slower


@dataclasses.dataclass(frozen=True)
class Case:
  """One estimator on one rollout layout.

  Attributes:
    estimator: "gae", "returns" (discounted returns), "vtrace" or "retrace".
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
    name = {"gae": "GAE", "returns": "returns", "vtrace": "V-trace", "retrace": "Retrace"}[
        self.estimator
    ]
    if self.batch is None:
      return f"{name} T={self.length}"
    layout = "(T, B)" if self.time_major else "(B, T)"
    return f"{name} {layout} T={self.length} B={self.batch}"


SUITES = {
    "full": tuple(
        [Case(e, 2048, 1024, major) for e in ("gae", "returns") for major in (True, False)]
        + [Case("returns", 65536), Case("gae", 65536)]
        + [Case(e, 2048, 1024, major) for e in ("vtrace", "retrace") for major in (True, False)]
    ),
    "small": (
        Case("gae", 33, 4),
        Case("returns", 17, 3, time_major=False),
        Case("returns", 50),
        Case("vtrace", 21, 3),
        Case("retrace", 19, 2, time_major=False),
    ),
}


def _inputs(case: Case, key: Array) -> tuple[Array, ...]:
  """The estimator's array arguments, float32 (integer actions).

  GAE and returns: rewards, discounts and values (T + 1 entries on the time axis).
  V-trace: v_tm1, v_t, r_t, discount_t, rho_tm1. Retrace: q_tm1, q_t, a_tm1, a_t, r_t,
  discount_t, pi_t, mu_t (the actions axis last).
  """
  k_r, k_d, k_end, k_v, k_rho, k_a, k_pi, k_mu = jax.random.split(key, 8)
  rewards = jax.random.normal(k_r, case.shape)
  ends = jax.random.uniform(k_end, case.shape) < 0.01
  discounts = jnp.where(ends, 0.0, jax.random.uniform(k_d, case.shape, minval=0.9, maxval=1.0))
  length = case.length
  values_shape = list(case.shape)
  values_shape[case.axis] += 1
  if case.estimator in ("gae", "returns"):
    return rewards, discounts, jax.random.normal(k_v, values_shape)
  steps = functools.partial(jax.lax.slice_in_dim, axis=case.axis)
  if case.estimator == "vtrace":
    values = jax.random.normal(k_v, values_shape)
    rho = jnp.exp(0.5 * jax.random.normal(k_rho, case.shape))
    return steps(values, 0, length), steps(values, 1, length + 1), rewards, discounts, rho
  q = jax.random.normal(k_v, (*values_shape, _ACTIONS))
  actions = jax.random.randint(k_a, values_shape, 0, _ACTIONS)
  pi = jax.nn.softmax(jax.random.normal(k_pi, (*case.shape, _ACTIONS)))
  mu = jax.random.uniform(k_mu, case.shape, minval=0.1, maxval=1.0)
  return (
      steps(q, 0, length), steps(q, 1, length + 1), steps(actions, 0, length),
      steps(actions, 1, length + 1), rewards, discounts, pi, mu,
  )


def _rlax(case: Case) -> Callable[..., Array]:
  """rlax on one trajectory, vmapped over the batch axis of the layout."""
  if case.estimator == "gae":
    def single(r, d, v):
      return rlax.truncated_generalized_advantage_estimation(r, d, _LAMBDA, v)
  elif case.estimator == "returns":
    def single(r, d, v):
      return rlax.discounted_returns(r, d, v[-1])
  elif case.estimator == "vtrace":
    def single(*args):
      return rlax.vtrace(*args, _LAMBDA)
  else:
    def single(*args):
      return rlax.retrace(*args, _LAMBDA)
  if case.batch is None:
    return single
  axis = 1 if case.time_major else 0
  return jax.vmap(single, in_axes=axis, out_axes=axis)


def _ours(case: Case, mode: str) -> Callable[..., Array]:
  if case.estimator == "gae":
    return lambda r, d, v: rl.generalized_advantage_estimation(
        r, d, v, _LAMBDA, axis=case.axis, mode=mode
    )
  if case.estimator in ("vtrace", "retrace"):
    fn = rl.vtrace if case.estimator == "vtrace" else rl.retrace
    return lambda *args: fn(*args, _LAMBDA, axis=case.axis, mode=mode)
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
  if shapes == "full":
    print("Criteria (ssmkit auto against jit(vmap(rlax))):")
    for passed, text in criteria(results):
      print(f"{'- ' if markdown else ''}{'PASS' if passed else 'FAIL'}  {text}")
  else:
    print(_timing.SMALL_SHAPES_NOTE)
  return 0
