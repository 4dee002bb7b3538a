"""`ssmkit bench linear-attention`: the matrix-state recurrences against hand-written forms.

For every shape `(B, T, H, K=V)` (float32, log-decays g ~ -U(0.01, 0.3), keys of unit
length, beta ~ U(0, 1)), each method computes the outputs o; the forward pass and the
gradient of sum(o * w) with respect to every input (w ~ N(0, 1)) are timed, and the XLA
temporary memory and compile time of the gradient are reported. The functions:
`linear_attention` and `delta_rule` with one decay per head, `kda` (`delta_rule` with one
decay per key channel), `generalized_delta_rule` (RWKV-7's a = -kappa, b = kappa * alpha,
one decay per key channel), `delta_product` (two steps per token, one decay per head) and
`mamba3` (SISO, steps dt ~ U(0.01, 0.3), lambda ~ U(0, 1), K / 4 rotary angles).
The baselines are what a user writes by hand: one plain `lax.scan` over the (K, V) state,
differentiated by autodiff, and, for linear attention, the quadratic masked-attention form
(skipped where its T x T matrices would pass `_QUADRATIC_MAX_BYTES`) and the chunkwise form
of mamba's `ssd_minimal.py` with a `lax.scan` between chunks, differentiated by autodiff.
Every method is first checked against the `lax.scan` result, so the table compares equal
results. Each shape's rows are printed as soon as they are measured.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ssmkit._src.matrix_state.mamba3 import rotate
from ssmkit.bench import _timing
from ssmkit.scan import delta_product, delta_rule, generalized_delta_rule, linear_attention, mamba3

Array = jax.Array

SCAN = "lax.scan"
QUADRATIC = "quadratic"
CHUNKED_AUTODIFF = "chunked autodiff"
AUTO = "ssmkit auto"
MODES = ("auto", "sequential", "chunked", "parallel")
PALLAS = "ssmkit pallas"

_RTOL = 1e-2  # agreement with lax.scan, relative to the largest magnitude (TF32 on GPUs)
_QUADRATIC_MAX_BYTES = 2**30
_HAND_CHUNK = 64  # chunk size of the hand-written chunkwise baseline

# Acceptance criteria at `Suite.judged`.
_MAX_FORWARD_VS_BEST = 1.15  # linear attention, auto forward over the better baseline
_MIN_SPEEDUP = 10.0  # linear attention, fwd+bwd of lax.scan over auto's
_MAX_MEMORY = 0.1  # fwd+bwd temp memory of auto over lax.scan's (both functions)
_MAX_DELTA_TIME = 0.2  # delta rule, fwd+bwd time of auto over lax.scan's
_MAX_COMPILE_VS_SCAN = 3.0  # gradient compile time at `Suite.compile_shape`
# The newer functions, fwd+bwd of lax.scan over auto's and auto's temp memory over its.
_MIN_NEW_SPEEDUP = 5.0
_MAX_NEW_MEMORY = 0.05
# At every shape on CPU, linear_attention's and delta_rule's auto forward over one plain
# lax.scan's: both run the same steps; this allows the noise of interleaved medians (+-5% at
# 30 repeats on a 2-core machine).
_MAX_FORWARD_VS_SCAN = 1.05


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  length: int
  heads: int
  dim: int

  def __str__(self) -> str:
    return f"B={self.batch} T={self.length} H={self.heads} K=V={self.dim}"


@dataclasses.dataclass(frozen=True)
class Suite:
  shapes: tuple[Shape, ...]
  judged: Shape | None  # where the criteria are judged; None: no verdicts
  compile_shape: Shape | None


SUITES = {
    "full": Suite(
        (Shape(2, 1024, 4, 64), Shape(2, 4096, 4, 64), Shape(1, 16384, 2, 64)),
        judged=Shape(2, 4096, 4, 64),
        compile_shape=Shape(1, 16384, 2, 64),
    ),
    "small": Suite((Shape(2, 70, 1, 4),), judged=None, compile_shape=None),
}

Method = Callable[..., Array]  # (*the function's inputs) -> o


def _plain_scan(step, q, v, *xs):
  """One `lax.scan` of `step(S, (q_t, *x_t)) -> S` over time axis 1, reading o_t = q_t S_t."""

  def read(s, x):
    s = step(s, x[1:])
    return s, jnp.einsum("bhk,bhkv->bhv", x[0], s)

  state = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[-1]), q.dtype)
  _, o = lax.scan(read, state, tuple(jnp.moveaxis(x, 1, 0) for x in (q, v, *xs)))
  return jnp.moveaxis(o, 0, 1)


def _decay(s, g_t):
  return s * (jnp.exp(g_t)[..., None] if g_t.ndim == 3 else jnp.exp(g_t)[..., None, None])


def _delta(s, k_t, v_t, b_t):
  error = v_t - jnp.einsum("bhk,bhkv->bhv", k_t, s)
  return s + k_t[..., :, None] * (b_t[..., None] * error)[..., None, :]


def _scan_linear_attention(q, k, v, g):
  step = lambda s, x: _decay(s, x[2]) + x[1][..., :, None] * x[0][..., None, :]
  return _plain_scan(step, q, v, k, g)


def _scan_delta_rule(q, k, v, g, beta):
  step = lambda s, x: _delta(_decay(s, x[2]), x[1], x[0], x[3])
  return _plain_scan(step, q, v, k, g, beta)


def _scan_generalized_delta_rule(q, k, v, g, a, b):
  def step(s, x):
    v_t, k_t, g_t, a_t, b_t = x
    read = jnp.einsum("bhk,bhkv->bhv", a_t, s)
    write = b_t[..., :, None] * read[..., None, :] + k_t[..., :, None] * v_t[..., None, :]
    return _decay(s, g_t) + write

  return _plain_scan(step, q, v, k, g, a, b)


def _scan_delta_product(q, k, v, g, beta):
  def step(s, x):
    v_t, k_t, g_t, b_t = x  # (B, n, H, .) steps of one token
    s = _decay(s, g_t)
    for j in range(k_t.shape[1]):
      s = _delta(s, k_t[:, j], v_t[:, j], b_t[:, j])
    return s

  return _plain_scan(step, q, v, k, g, beta)


def _scan_mamba3(q, k, v, g, dt, lam, rate):
  """Mamba-3's step as state-spaces/mamba's `mamba3_siso_step_ref` writes it, in a `lax.scan`."""

  def step(carry, x):
    s, theta, k_prev, v_prev = carry
    q_t, k_t, v_t, g_t, dt_t, lam_t, rate_t = x
    theta = theta + rate_t
    q_t, k_t = rotate(q_t, theta, "interleaved"), rotate(k_t, theta, "interleaved")
    outer = lambda a, b, w: w[..., None, None] * a[..., :, None] * b[..., None, :]
    s = (jnp.exp(g_t)[..., None, None] * (s + outer(k_prev, v_prev, (1 - lam_t) * dt_t))
         + outer(k_t, v_t, lam_t * dt_t))
    return (s, theta, k_t, v_t), jnp.einsum("bhk,bhkv->bhv", q_t, s)

  batch, _, heads, dim = q.shape
  start = (jnp.zeros((batch, heads, dim, v.shape[-1]), q.dtype),
           jnp.zeros((batch, heads, rate.shape[-1]), q.dtype), jnp.zeros_like(q[:, 0]),
           jnp.zeros_like(v[:, 0]))
  _, o = lax.scan(step, start, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, dt, lam, rate)))
  return jnp.moveaxis(o, 0, 1)


def _quadratic(q, k, v, g):
  """o_t = sum_{s<=t} exp(b_t - b_s) (q_t . k_s) v_s with b the cumulative log-decay."""
  b = jnp.moveaxis(jnp.cumsum(g, axis=1), 2, 1)  # (B, H, T)
  length = q.shape[1]
  causal = jnp.tril(jnp.ones((1, 1, length, length), bool))
  decay = jnp.exp(jnp.where(causal, b[..., :, None] - b[..., None, :], -jnp.inf))
  weights = jnp.einsum("bthk,bshk->bhts", q, k) * decay
  return jnp.einsum("bhts,bshv->bthv", weights, v)


def _chunked_autodiff(q, k, v, g):
  """SSD's chunkwise form as users write it (mamba's `ssd_minimal.py`), differentiated by JAX.

  Chunks of 64 steps (T zero-padded to a multiple): inside a chunk the masked, decayed
  product; between chunks a `lax.scan` over the (K, V) state. Autodiff keeps what the
  forward pass made: the chunks' C x C matrices and one state per chunk.
  """
  batch, length, heads, _ = q.shape
  size = min(_HAND_CHUNK, length)
  count = -(-length // size)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, count * size - length)] + [(0, 0)] * (x.ndim - 2))
  # (B, T, H, ...) -> (B, H, n, C, ...)
  chunk = lambda x: jnp.moveaxis(pad(x).reshape(batch, count, size, heads, *x.shape[3:]), 3, 1)
  q, k, v, g = map(chunk, (q, k, v, g))
  b = jnp.cumsum(g, axis=-1)
  causal = jnp.tril(jnp.ones((size, size), bool))
  decay = jnp.exp(jnp.where(causal, b[..., :, None] - b[..., None, :], -jnp.inf))
  intra = jnp.einsum("bhncs,bhnse->bhnce", jnp.einsum("bhncd,bhnsd->bhncs", q, k) * decay, v)
  written = jnp.einsum("bhnsd,bhnse->nbhde", k * jnp.exp(b[..., -1:] - b)[..., None], v)

  def step(state, x):
    decay_n, written_n = x
    return decay_n[..., None, None] * state + written_n, state

  _, entering = lax.scan(step, jnp.zeros(written.shape[1:], written.dtype),
                         (jnp.moveaxis(jnp.exp(b[..., -1]), 2, 0), written))
  out = intra + jnp.einsum("bhncd,nbhde->bhnce", q * jnp.exp(b)[..., None], entering)
  return jnp.moveaxis(out, 1, 3).reshape(batch, count * size, heads, -1)[:, :length]


# function -> (its lax.scan, ssmkit's function in a mode); both take `inputs`' arrays.
_FUNCTIONS: dict[str, tuple[Method, Callable[[str], Method]]] = {
    "linear_attention": (_scan_linear_attention, lambda mode: lambda q, k, v, g: linear_attention(
        q, k, v, g, mode=mode)),
    "delta_rule": (_scan_delta_rule, lambda mode: lambda q, k, v, g, beta: delta_rule(
        q, k, v, beta, g, mode=mode)),
    "kda": (_scan_delta_rule, lambda mode: lambda q, k, v, g, beta: delta_rule(
        q, k, v, beta, g, mode=mode)),
    "generalized_delta_rule": (_scan_generalized_delta_rule, lambda mode: (
        lambda q, k, v, g, a, b: generalized_delta_rule(q, k, v, a, b, g, mode=mode))),
    "delta_product": (_scan_delta_product, lambda mode: lambda q, k, v, g, beta: delta_product(
        q, k, v, beta, g, mode=mode)),
    "mamba3": (_scan_mamba3, lambda mode: lambda q, k, v, g, dt, lam, rate: mamba3(
        q, k, v, g, dt, lam, rate, mode=mode)),
}
FUNCTIONS = tuple(_FUNCTIONS)
# The functions with Pallas kernels (`impl="pallas"`), timed on GPUs only: elsewhere Pallas
# interprets them, which tests them but says nothing of their speed.
_KERNELS: dict[str, Method] = {
    "linear_attention": lambda q, k, v, g: linear_attention(q, k, v, g, impl="pallas"),
    "delta_rule": lambda q, k, v, g, beta: delta_rule(q, k, v, beta, g, impl="pallas"),
    "kda": lambda q, k, v, g, beta: delta_rule(q, k, v, beta, g, impl="pallas"),
}


def kernel(function: str) -> Method | None:
  """`function` by its Pallas kernels where they compile (NVIDIA GPUs), else None."""
  return _KERNELS.get(function) if jax.default_backend() == "gpu" else None
NEWER = ("kda", "generalized_delta_rule", "delta_product", "mamba3")  # not at the longest shape
_PRODUCTS = 2  # delta_product's steps per token
LOG_DECAYS = (0.01, 0.3)  # the inputs' log-decays are drawn from [-0.3, -0.01]


def _methods(function: str, shape: Shape) -> dict[str, Method]:
  scan, ours = _FUNCTIONS[function]
  methods = {SCAN: scan}
  if function == "linear_attention":
    if shape.batch * shape.heads * shape.length**2 * 4 <= _QUADRATIC_MAX_BYTES:
      methods[QUADRATIC] = _quadratic
    methods[CHUNKED_AUTODIFF] = _chunked_autodiff
  methods.update({f"ssmkit {mode}": ours(mode) for mode in MODES})
  if kernel(function) is not None:
    methods[PALLAS] = kernel(function)
  return methods


def inputs(function: str, shape: Shape, key: Array,
           log_decays: tuple[float, float] = LOG_DECAYS) -> tuple[tuple[Array, ...], Array]:
  """The function's inputs and the output weights w; log-decays drawn from
  [-log_decays[1], -log_decays[0]] (for mamba3, step sizes from `log_decays`)."""
  keys = jax.random.split(key, 7)
  dims = (shape.batch, shape.length, shape.heads, shape.dim)
  steps = (*dims[:2], _PRODUCTS, *dims[2:]) if function == "delta_product" else dims
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = jax.random.normal(keys[0], dims) / np.sqrt(shape.dim)
  k = unit(jax.random.normal(keys[1], steps))
  v = jax.random.normal(keys[2], steps)
  per_key = function in ("kda", "generalized_delta_rule")
  g = -jax.random.uniform(keys[3], dims if per_key else dims[:3], minval=log_decays[0],
                          maxval=log_decays[1])
  beta = jax.random.uniform(keys[4], steps[:-1])
  w = jax.random.normal(keys[5], dims)
  if function == "linear_attention":
    return (q, k, v, g), w
  if function == "generalized_delta_rule":
    alpha = jax.random.uniform(keys[6], dims)
    return (q, k, v, g, -k, k * alpha), w
  if function == "mamba3":
    dt = -g  # in log_decays
    lam = jax.random.uniform(keys[6], dt.shape)
    a = jax.random.uniform(keys[4], dt.shape, minval=0.5, maxval=2.0)
    angles = max(1, shape.dim // 4)
    rate = dt[..., None] * jnp.pi * jnp.tanh(jax.random.normal(keys[1], (*dt.shape, angles)))
    return (q, k, v, -a * dt, dt, lam, rate), w
  return (q, k, v, g, beta), w


@dataclasses.dataclass(frozen=True)
class Result:
  function: str
  shape: Shape
  method: str
  forward_s: float
  gradient_s: float
  gradient_temp_bytes: int | None
  gradient_compile_s: float


def _bench(function: str, shape: Shape, repeats: int, key: Array,
           log_decays: tuple[float, float]) -> list[Result]:
  args, w = inputs(function, shape, key, log_decays)
  count = len(args)
  compiled, reference = {}, None
  for name, method in _methods(function, shape).items():
    forward, _ = _timing.compile_timed(method, *args)
    loss = lambda *a, method=method: jnp.sum(method(*a[:count]) * a[count])
    gradient, compile_s = _timing.compile_timed(jax.grad(loss, argnums=tuple(range(count))),
                                                *args, w)
    out = np.asarray(forward(*args))
    if reference is None:
      reference = out
    elif not np.abs(out - reference).max() <= _RTOL * np.abs(reference).max():
      raise RuntimeError(f"{name} disagrees with {SCAN} for {function} at {shape}.")
    compiled[name] = (forward, gradient, compile_s)
  # The forward passes take turns among themselves and the gradients among themselves: a
  # forward sample timed right after a lax.scan gradient, which allocates 0.3-2 GB, moved
  # with that allocation's aftermath (the delta rule's auto forward over one plain lax.scan's
  # read 1.14x at T=1024 in one full run, 0.99-1.02x side by side).
  seconds = _timing.interleaved_medians(
      {(name, "forward"): functools.partial(forward, *args)
       for name, (forward, _, _) in compiled.items()}, repeats=repeats)
  seconds |= _timing.interleaved_medians(
      {(name, "gradient"): functools.partial(gradient, *args, w)
       for name, (_, gradient, _) in compiled.items()}, repeats=repeats)
  return [
      Result(function, shape, name, seconds[name, "forward"], seconds[name, "gradient"],
             _timing.temp_bytes(gradient), compile_s)
      for name, (_, gradient, compile_s) in compiled.items()
  ]


HEADERS = ("function", "shape", "method", "fwd ms", "x lax.scan fwd", "fwd+bwd ms",
           "x lax.scan fwd+bwd", "temp MiB", "x lax.scan temp", "compile s")


@dataclasses.dataclass(frozen=True)
class Case:
  function: str
  shape: Shape

  def __str__(self) -> str:
    return f"{self.function} {self.shape}"


def _rows(results: list[Result]) -> list[tuple[str, ...]]:
  """One shape's rows, ratios against its `lax.scan` row."""
  scan = next(r for r in results if r.method == SCAN)

  def memory(r: Result) -> tuple[str, str]:
    if r.gradient_temp_bytes is None or not scan.gradient_temp_bytes:
      return "n/a", "n/a"
    return (_timing.significant(r.gradient_temp_bytes / 2**20),
            f"{r.gradient_temp_bytes / scan.gradient_temp_bytes:.3f}")

  return [
      (r.function, str(r.shape), r.method, _timing.significant(r.forward_s * 1e3),
       f"{scan.forward_s / r.forward_s:.2f}", _timing.significant(r.gradient_s * 1e3),
       f"{scan.gradient_s / r.gradient_s:.1f}", *memory(r), f"{r.gradient_compile_s:.2f}")
      for r in results
  ]


def criteria(results: list[Result], suite: Suite) -> list[tuple[bool, str]]:
  """The acceptance criteria of the auto mode, judged on `results`."""
  at = {(r.function, r.shape, r.method): r for r in results}
  la = lambda method, shape=suite.judged: at["linear_attention", shape, method]
  dr = lambda method: at["delta_rule", suite.judged, method]
  best = min(la(m).forward_s for m in (SCAN, QUADRATIC) if ("linear_attention", suite.judged, m) in at)
  found = [
      (la(AUTO).forward_s / best <= _MAX_FORWARD_VS_BEST,
       f"linear_attention auto fwd <= {_MAX_FORWARD_VS_BEST}x the better baseline at "
       f"{suite.judged} ({la(AUTO).forward_s / best:.2f}x)"),
      (la(SCAN).gradient_s / la(AUTO).gradient_s >= _MIN_SPEEDUP,
       f"linear_attention auto fwd+bwd >= {_MIN_SPEEDUP:.0f}x faster than {SCAN} "
       f"({la(SCAN).gradient_s / la(AUTO).gradient_s:.1f}x)"),
      (dr(AUTO).gradient_s / dr(SCAN).gradient_s <= _MAX_DELTA_TIME,
       f"delta_rule auto fwd+bwd <= {_MAX_DELTA_TIME}x the time of {SCAN} "
       f"({dr(AUTO).gradient_s / dr(SCAN).gradient_s:.3f}x)"),
  ]
  for function, get in (("linear_attention", la), ("delta_rule", dr)):
    if get(AUTO).gradient_temp_bytes is not None:
      ratio = get(AUTO).gradient_temp_bytes / get(SCAN).gradient_temp_bytes
      found.append((ratio <= _MAX_MEMORY,
                    f"{function} auto fwd+bwd temp memory <= {_MAX_MEMORY}x {SCAN}'s ({ratio:.3f}x)"))
  for function in NEWER:
    auto, scan = at[function, suite.judged, AUTO], at[function, suite.judged, SCAN]
    speedup = scan.gradient_s / auto.gradient_s
    found.append((speedup >= _MIN_NEW_SPEEDUP,
                  f"{function} auto fwd+bwd >= {_MIN_NEW_SPEEDUP:.0f}x faster than {SCAN} "
                  f"({speedup:.1f}x)"))
    if auto.gradient_temp_bytes is not None:
      ratio = auto.gradient_temp_bytes / scan.gradient_temp_bytes
      found.append((ratio <= _MAX_NEW_MEMORY, f"{function} auto fwd+bwd temp memory <= "
                    f"{_MAX_NEW_MEMORY}x {SCAN}'s ({ratio:.3f}x)"))
  if jax.default_backend() == "cpu":
    for (function, shape, method), r in at.items():
      if method == AUTO and function in ("linear_attention", "delta_rule"):
        ratio = r.forward_s / at[function, shape, SCAN].forward_s
        found.append((ratio <= _MAX_FORWARD_VS_SCAN, f"{function} auto fwd <= "
                      f"{_MAX_FORWARD_VS_SCAN}x one plain {SCAN}'s at {shape} ({ratio:.3f}x)"))
  shape = suite.compile_shape
  ratio = la(AUTO, shape).gradient_compile_s / la(SCAN, shape).gradient_compile_s
  found.append((ratio <= _MAX_COMPILE_VS_SCAN,
                f"linear_attention auto gradient compile time <= {_MAX_COMPILE_VS_SCAN:.0f}x "
                f"{SCAN}'s at {shape} ({ratio:.2f}x)"))
  return found


def run(*, shapes: str, repeats: int, markdown: bool, functions: Sequence[str] | None = None,
        log_decays: tuple[float, float] = LOG_DECAYS) -> int:
  """Runs the suite named `shapes`, printing each shape's rows as they are measured.

  Args:
    shapes: a key of `SUITES`: "full", or "small" for a run of a few seconds.
    repeats: timed samples per cell, the methods taking turns; the median is shown.
    markdown: print a GitHub markdown table.
    functions: only these of `FUNCTIONS`; default every one.
    log_decays: (lo, hi): the log-decays are drawn from [-hi, -lo] (mamba3's step sizes from
      [lo, hi]); the criteria are judged at the default only.

  Returns:
    0, the exit status; a failed criterion is reported, not raised; 2 for `log_decays`
    with lo > hi.
  """
  if log_decays[0] > log_decays[1]:
    print(f"ssmkit bench linear-attention: error: --log-decays LO HI needs LO <= HI, got "
          f"{log_decays[0]:g} {log_decays[1]:g}.", file=sys.stderr)
    return 2
  suite = SUITES[shapes]
  print(
      f"{_timing.device_line()}, float32; median of "
      f"{repeats} samples per time (fewer where they would take over "
      f"{_timing.CELL_BUDGET_S:g} s), methods taking turns. x lax.scan: {SCAN}'s time (or "
      "temp memory) over the row's. temp MiB, compile s: of the fwd+bwd function. "
      f"Log-decays in [{-log_decays[1]:g}, {-log_decays[0]:g}]."
  )
  print()
  functions = FUNCTIONS if functions is None else tuple(functions)
  cases = [Case(function, shape) for shape in suite.shapes for function in functions
           if function not in NEWER or shape != suite.compile_shape]
  methods = list(_methods("linear_attention", suite.shapes[0]))
  table = _timing.StreamedTable(
      HEADERS, [functions, [str(s) for s in suite.shapes], methods], markdown=markdown
  )
  results = []
  for i, case in enumerate(_timing.within_budget(cases, "linear-attention")):
    rows = _bench(case.function, case.shape, repeats, jax.random.key(i), log_decays)
    table.add(_rows(rows))
    results.extend(rows)
  print()
  if suite.judged is None:
    print(_timing.SMALL_SHAPES_NOTE)
    return 0
  measured = {(r.function, r.shape) for r in results}
  needed = {(f, suite.judged) for f in FUNCTIONS} | {
      ("linear_attention", suite.compile_shape)}
  if tuple(log_decays) != LOG_DECAYS:
    print(f"Criteria: not judged, the log-decays are not the judged ones {LOG_DECAYS}.")
    return 0
  if not needed <= measured:
    print("Criteria: not judged, the run left out cases they need (by --functions or the "
          "budget).")
    return 0
  print("Criteria (auto mode):")
  for passed, text in criteria(results, suite):
    print(f"{'- ' if markdown else ''}{'PASS' if passed else 'FAIL'}  {text}")
  return 0
