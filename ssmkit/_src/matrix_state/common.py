"""What the matrix-state recurrences share: input hygiene at resets and mode dispatch."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src import checks, state_pass
from ssmkit._src.engine import axis_position, vary_alike
from ssmkit._src.matrix_state import chunks, low_rank, triangular
from ssmkit._src.matrix_state.inputs import FLOATS, Inputs, expanded, finish
from ssmkit._src.modes import Impl, Mode, parse_mode, resolve_impl, resolve_matrix_mode

Array = jax.Array
DEFAULT_CHUNK_SIZE = 64
# The delta rules solve a triangular system per chunk besides their C x C scores; with one
# decay per key channel (KDA) and in the generalized delta rule (RWKV-7), with V + K right-hand
# sides. At 32 steps KDA's and RWKV-7's gradients held a quarter to a half less memory than at
# 64 and took 2-8% less time (B=2 T=1024 and 4096 H=4 K=V=64, CPU; docs/benchmarks.md), and
# KDA's scores stay one product for decays down to 60 / 32 nats a step on average (float32),
# not 60 / 64. On CPU the other delta rules take 32 too: side by side, K=V=64, the gated delta
# rule's gradient took 26.2 against 30.1 ms at B=2 T=1024 H=4, 109.9 against 122.2 at T=4096,
# 103.6 against 145.6 at B=8 T=1024, DeltaNet's 125.5 against 129.8 (B=2 T=4096), the delta
# product's (2 steps a token) 100.7 against 116.4 (B=2 T=2048), their forwards as fast or
# faster, in 15-30% less memory; on GPUs they keep the 64 steps they were timed at.
SOLVED_CHUNK_SIZE = 32
# The delta rules without a decay per key take SOLVED_CHUNK_SIZE on CPU only while a head's state
# holds fewer entries (K x V) than this. A larger state (K=256 V=512: a width of 2048 in 8 heads),
# stored at every chunk's edge, outweighs the C x C work that 32 steps save, and they take 64:
# side by side (`scripts/bench_chunk_sizes.py --function delta_rule`), the gated delta rule's
# gradient took 1071 against 1171 ms at 64 and 32 steps in 158 against 170 MiB (B=1 T=2048 H=8),
# 1064 against 1136 ms in 201 against 243 MiB (B=2 T=1024 H=8), 271 against 337 ms in 51 against
# 82 MiB (B=1 T=2048 H=2), 534 against 576 ms in 113 against 101 MiB (B=1 T=2048 H=4), the delta
# product's 439 against 467 ms (B=1 T=1024 H=4), the forwards alike (1153 against 1166 ms, B=2
# T=4096 H=8); K=V=128 kept 32 (124 against 133 ms, 20 against 29 MiB).
SOLVED_STATES_BELOW = 1 << 17

# sequential(inputs, steps per rematerialised group or None, precision) -> (outputs, final)
Sequential = Callable[[Inputs, int | None, object], tuple[Array, Array]]
# outputs(entering states, their rows or None) -> the read steps' outputs: `(Z, H, n, K, V)`
# states entering the chunks, with `low_rank.LowRank` maps the `(Z, H, n, C, V)` rows they give
# where the caller has them -> `(Z, H, n, R, V)`.
Outputs = Callable[[Array, Array | None], Array]
# kernels(inputs, chunk size, precision, the XLA form) -> (Z, T, H, V) outputs and final state
Kernels = Callable[[Inputs, int | None, object, Callable[[Inputs], tuple[Array, Array]]],
                   tuple[Array, Array]]
# chunk_maps(chunks, precision) -> (chunk-first maps, their outputs)
ChunkMaps = Callable[[chunks.Chunks, object],
                     tuple[state_pass.Maps | low_rank.LowRank, Outputs]]


def sanitize(arrays: Sequence[Array | None]) -> tuple[list[Array | None], Array]:
  """Zeroes the non-finite entries of `(Z, H, n, C, ...)` inputs and flags their steps.

  A matrix product mixes every step of a chunk, so a NaN written before a reset would
  reach the steps after it as 0 * NaN. The chunked algorithms run on the zeroed inputs and
  set the outputs of every step a flagged step reaches to NaN instead (`chunks.poisoned`),
  as the step-by-step recurrence would.

  Returns:
    The cleaned arrays and `(Z, H, n, C)` flags of steps with a non-finite input.
  """
  bad = None
  cleaned = []
  for x in arrays:
    if x is None:
      cleaned.append(None)
      continue
    finite = jnp.isfinite(x)
    step_ok = finite if x.ndim == 4 else jnp.all(finite, axis=tuple(range(4, x.ndim)))
    bad = ~step_ok if bad is None else bad | ~step_ok
    cleaned.append(jnp.where(finite, x, 0))
  return cleaned, bad


def read_out(
    a: Array,
    u: Array | None,
    query: Array,
    intra: Array | None,
    seg: chunks.Segments,
    bad: Array | None,
    bad_query: Array,
    reset: Array | None,
    precision,
    read_every: int = 1,
    reached: Array | None = None,
    solve: low_rank.Solve | None = None,
) -> tuple[state_pass.Maps | low_rank.LowRank, Outputs]:
  """The chunks' maps and outputs, from what each recurrence computes inside its chunks.

  Args:
    a: `(Z, H, n, ., .)` each chunk's transition of the state (row decays or matrices).
    u: `(Z, H, n, K, V)` the state each chunk leaves from a zero entering state (besides
      `solve`'s rows); None for zeros, with `solve` only.
    query: `(Z, H, n, R, K)` what reads the entering state into each read step's output.
    intra: `(Z, H, n, R, V)` each read step's output from its own chunk (besides `solve`'s
      rows); None for zeros, with `solve` only.
    seg: the chunks' segments.
    bad: `(Z, H, n, C)` steps with a non-finite input to the state (`sanitize`), or None.
    bad_query: `(Z, H, n, R)` read steps with a non-finite query: their outputs alone are
      NaN.
    reset: `(Z, 1, n, C)` or None.
    precision: matmul precision.
    read_every: r; only steps r - 1, 2r - 1, ... of each chunk are read (R = C / r).
    reached: `(Z, H, n, C)` the steps whose outputs a non-finite input reaches, where not
      the steps whose state it reaches (a read before the step's own write); None: those.
    solve: a solved chunk's rows (`low_rank`): the maps are then `low_rank.LowRank`.

  Returns:
    The chunks' maps, and their outputs (`Outputs`).
  """
  poisoned = None if bad is None else chunks.poisoned(bad, reset)
  if poisoned is not None:
    u = jnp.where(poisoned[..., -1, None, None], jnp.nan, 0 if u is None else u)
  if solve is None:
    maps = state_pass.Maps(a, u, seg.cut)
  else:
    maps = low_rank.LowRank(a, solve.left, solve.x, solve.y, u, seg.cut)
  first = chunks.read_rows(seg.first, read_every)
  if reached is None:
    reached = poisoned
  nan_out = bad_query if reached is None else bad_query | chunks.read_rows(reached, read_every)

  def outputs(entering: Array, rows: Array | None = None) -> Array:
    through, inside = query, intra
    if solve is not None and rows is None:  # G (X + Y S) as a query G Y and outputs G X
      mix = lambda x: jnp.einsum("zhncs,zhnse->zhnce", solve.weights, x, precision=precision)
      through, inside = query + mix(solve.y), mix(solve.x)
      inside = inside if intra is None else inside + intra
    read = lambda s: jnp.einsum("zhncd,zhnde->zhnce", through, s, precision=precision)
    nan = nan_out[..., None]
    if first is None:  # every step reads the entering state, as the steps would
      out = read(entering)
    else:
      # A non-finite entering state is zeroed before the product and the outputs that read
      # it are set to NaN after: inside the product, the zero cotangents of the steps after
      # a reset would meet it as 0 * NaN and spread over the whole chunk's gradients. Without
      # resets it cost the per-key functions' gradients 5-11% (B=2 T=4096 H=4 K=V=64, CPU),
      # so it is left out there.
      finite = jnp.isfinite(entering)
      unread = ~jnp.all(finite, axis=-2)[..., None, :] & first[..., None]  # (Z, H, n, 1, V)
      entering = jnp.where(finite, entering, 0)
      out = chunks.masked(read(entering), first)
      nan = nan | unread
    if rows is not None:
      out = out + jnp.einsum("zhncs,zhnse->zhnce", solve.weights, rows, precision=precision)
    if inside is not None:
      out = out + inside
    return jnp.where(nan, jnp.nan, out)

  return maps, outputs


# A window of the chunked loop holds about this many (chunk, batch row, head) matrices,
# 2 to 8 chunks per row: operations large enough to run near the matmul peak on CPU,
# windows small enough to stay in cache (measured with `ssmkit bench linear-attention`
# and `ssmkit bench layers`).
_WINDOW_MATRICES = 32
_GROUP_RANGE = (2, 8)
# Below this many (batch row, head, step) triples a window holds one chunk: so small an input
# runs in a few milliseconds, beside a compile time that a window's unrolled chunks raise (a
# suite of small inputs, tests/test_matrix_state.py, took 12% less time without them). Above
# it, windows of several chunks paid: at B=16 T=256 H=4 K=V=64 (2^14 triples) one chunk per
# window took 4-13% more time for the gradients (CPU, side by side).
_WINDOWS_FROM = 1 << 13


def _windows(x: Inputs, size: int) -> tuple[Inputs, int, Array]:
  """`x` padded to whole chunks, the steps of a window of chunks, and the windows' starts.

  A loop takes one window per iteration straight from the `(Z, T, H, ...)` layout, so
  only a window at a time is ever moved into the chunk layout, and no full-length copy
  of the inputs or the outputs is made (beyond padding a partial last chunk).
  """
  padded = chunks.pad(x, size)
  length = padded.q.shape[1]
  rows = x.q.shape[0] * x.q.shape[2]
  most = min(max(_WINDOW_MATRICES // rows, _GROUP_RANGE[0]), _GROUP_RANGE[1]) if (
      rows * x.q.shape[1] >= _WINDOWS_FROM) else 1
  span = size * max(g for g in range(1, most + 1) if length // size % g == 0)
  return padded, span, jnp.arange(0, length, span)


def _grouped(state: Array, groups: int) -> Array:
  """A `(Z, H, ...)` state in the layout of `chunks.split` with `groups`: `(Z G, H / G, ...)`."""
  return state.reshape((state.shape[0] * groups, state.shape[1] // groups, *state.shape[2:]))


def _ungrouped(state: Array, groups: int) -> Array:
  return state.reshape((state.shape[0] // groups, state.shape[1] * groups, *state.shape[2:]))


# The chunked loop's backward pass recomputes each window but for the inverses of its solves
# (C x C a chunk): side by side, B=2 T=4096 H=4 K=V=64 on CPU, the generalized delta rule's
# gradient took 118.5 against 124.7 ms (34.7 -> 38.7 MiB), the delta product's 183.3 against
# 191.2 ms (68.2 -> 84.6 MiB).
_KEEP = jax.checkpoint_policies.save_only_these_names(triangular.INVERSE)


def _loop(x: Inputs, chunk_maps: ChunkMaps, size: int, matrix: bool, precision, every: int):
  """Windows of chunks one after another, each rematerialised in the backward pass (but for
  the inverses of its solves); the outputs of every `every`-th step (`chunk_maps` reads
  them).

  The windows' outputs leave the loop as its stacked outputs, not written into a carried
  `(Z, T, H, V)` buffer: the backward pass of such a buffer reads each window's cotangent
  out of it and zeroes the window in place, which XLA did by copying the whole buffer twice
  a window. Stacked, the gradients took 51.2 against 60.5 ms (linear attention) and 95.5
  against 113.7 ms (delta rule), in 8.6 against 21.3 MiB and 12.7 against 25.8 MiB, the
  forward passes as fast (B=2 T=4096 H=4 K=V=64, CPU, side by side).
  """
  padded, span, starts = _windows(x, size)
  groups = chunks.head_groups(x.q.shape[0], x.q.shape[2])

  @functools.partial(jax.checkpoint, policy=_KEEP)
  def window(s, start):
    maps, outputs = chunk_maps(chunks.split(padded, size, start, span, groups), precision)
    entering, rows = [], []
    for i in range(span // size):
      entering.append(s)
      if isinstance(maps, low_rank.LowRank):
        s, chunk_rows = low_rank.advance(low_rank.chunk(maps, i), s, precision)
        rows.append(chunk_rows)
      else:
        s = state_pass.apply(state_pass.chunk(maps, i), s, matrix=matrix, precision=precision)
    out = outputs(jnp.stack(entering, axis=2), jnp.stack(rows, axis=2) if rows else None)
    return s, chunks.merge(out, groups)

  final, out = lax.scan(window, _grouped(x.state, groups), starts)
  # (windows, Z, R, H, V) -> (Z, windows R, H, V)
  out = jnp.moveaxis(out, 0, 1).reshape((out.shape[1], -1, *out.shape[3:]))
  return out[:, :x.q.shape[1] // every], _ungrouped(final, groups)


def _dense(maps: state_pass.Maps | low_rank.LowRank, precision) -> state_pass.Maps:
  """`maps` as `state_pass` combines them: low-rank maps as matrices."""
  return low_rank.dense(maps, precision) if isinstance(maps, low_rank.LowRank) else maps


def _tree(x: Inputs, chunk_maps: ChunkMaps, size: int, matrix: bool, precision, every: int):
  """Every chunk at once, the chunk maps combined as a tree; the outputs of every `every`-th
  step."""
  groups = chunks.head_groups(x.q.shape[0], x.q.shape[2])
  maps, outputs = chunk_maps(chunks.split(chunks.pad(x, size), size, groups=groups), precision)
  entering, final = state_pass.run(_dense(maps, precision), _grouped(x.state, groups),
                                   matrix=matrix, precision=precision)
  return (chunks.merge(outputs(entering, None), groups)[:, :x.q.shape[1] // every],
          _ungrouped(final, groups))


def _device_map(x: Inputs, chunk_maps: ChunkMaps, size: int, matrix: bool, tree: bool,
                precision) -> state_pass.Maps:
  """The map this device's slice applies to the state entering it."""
  fold = lambda c: state_pass.fold(_dense(chunk_maps(c, precision)[0], precision),
                                   matrix=matrix, precision=precision)
  if tree:
    return fold(chunks.split(chunks.pad(x, size), size))
  padded, span, starts = _windows(x, size)
  map_of = jax.checkpoint(lambda start: fold(chunks.split(padded, size, start, span)))

  def body(m, start):
    return state_pass.compose(m, map_of(start), matrix=matrix, precision=precision), None

  return lax.scan(body, map_of(starts[0]), starts[1:])[0]


def check_options(mode: str | Mode, chunk_size: int | None, axis_name: Hashable | None) -> Mode:
  """The parsed `mode`, after refusing a bad `mode`, `chunk_size` or `axis_name` by name."""
  mode = parse_mode(mode)
  checks.check_chunk_size(chunk_size)
  if axis_name is not None:
    axis_position(axis_name)
  return mode


def evaluate_by(impl: Impl, x: Inputs, kernels: Kernels, xla: Callable[[Inputs, bool], Any], *,
                chunk_size: int | None, axis_name: Hashable | None, precision,
                return_final_state: bool):
  """The recurrence by the Pallas `kernels` where `impl` asks for them and they take the call,
  else by `xla(x, return_final_state)`, the XLA form (`evaluate` with the caller's options),
  which sees each query and key head repeated for its group of value heads.

  The XLA form takes `axis_name`, empty sequences and float64 inputs, and inside the kernels'
  call the inputs or cotangents with a non-finite entry (`kernels.routed`).
  """
  if (resolve_impl(impl) is Impl.XLA or axis_name is not None or x.q.shape[1] == 0
      or x.q.dtype == jnp.float64):
    return xla(expanded(x), return_final_state)
  # The XLA form in the kernels' layout and dtype: (Z, T, H, V) outputs and the final state.
  fallback = lambda y: xla(expanded(y._replace(batch=y.q.shape[:1], dtype=y.q.dtype)), True)
  out, last = kernels(x, chunk_size, precision, fallback)
  return finish(x, out, last, return_final_state)


def evaluate(
    x: Inputs,
    sequential: Sequential,
    chunk_maps: ChunkMaps,
    *,
    matrix: bool,
    mode: Mode,
    chunk_size: int | None,
    axis_name: Hashable | None,
    precision,
    return_final_state: bool,
    default_chunk_size: int = DEFAULT_CHUNK_SIZE,
    per_key_scores: bool = False,
    chunked_values_from: float = math.inf,
    chunked_values_rows: float = math.inf,
    read_every: int = 1,
):
  """Runs the recurrence in `mode`: the outputs in the public layout, and with
  `return_final_state` the final state (`inputs.finish`); chunks of `chunk_size` steps, or
  `default_chunk_size` for None, at most T.

  `per_key_scores`: `chunk_maps` score one decay per key channel (`chunks.per_key_scores`) and
  take its `factored`; the chunked loop runs them with `factored=True` when `chunks.factors`
  says so for the whole sequence (one `lax.cond`), as they are otherwise. The parallel form
  keeps the choice per call: as a `lax.cond`, its gradient held both branches' residuals of
  every chunk (KDA's: 540 MiB against 321 MiB).
  `chunked_values_from`, `chunked_values_rows`: "auto" computes values by the chunked loop on
  CPU too from this many (batch row, head, step) triples, or (batch row, head) sequences, on
  (`modes.resolve_matrix_mode`).
  `read_every` r: only the outputs of steps r - 1, 2r - 1, ... are returned, T / r of them
  (T a multiple of r); `sequential` takes `per_token=r`, and `chunk_maps` take `read_every`
  r where a chunk holds whole groups of r steps, else 1 (every step read, every r-th kept).
  """
  length = x.q.shape[1]
  if length == 0:
    return finish(x, x.v, x.state, return_final_state)
  # One token of r steps decodes as one step does.
  plan = resolve_matrix_mode(mode, 1 if length == read_every else length,
                             chunked_values_from=chunked_values_from,
                             rows=x.q.shape[0] * x.q.shape[2], matrix=matrix,
                             chunked_values_rows=chunked_values_rows)
  size = min(chunk_size or default_chunk_size, length)
  every = read_every if size % read_every == 0 else 1  # the steps the chunk maps read
  if read_every > 1:
    sequential = functools.partial(sequential, per_token=read_every)
    chunk_maps = functools.partial(chunk_maps, read_every=every)
  final = None
  if axis_name is not None:
    arrays = vary_alike(tuple(getattr(x, f) for f in FLOATS))
    x = x._replace(**dict(zip(FLOATS, arrays, strict=True)))
    device = _device_map(x, chunk_maps, size, matrix, plan.forward is Mode.PARALLEL, precision)
    entering, final = state_pass.across_devices(device, x.state, matrix=matrix,
                                                axis_name=axis_name, precision=precision)
    x = x._replace(state=entering)

  def chunked(x: Inputs, mode: Mode) -> tuple[Array, Array]:
    if mode is not Mode.CHUNKED:
      return _tree(x, chunk_maps, size, matrix, precision, every)
    if not per_key_scores:
      return _loop(x, chunk_maps, size, matrix, precision, every)
    factored = functools.partial(chunk_maps, factored=True)
    return lax.cond(chunks.factors(x, size),
                    lambda: _loop(x, factored, size, matrix, precision, every),
                    lambda: _loop(x, chunk_maps, size, matrix, precision, every))

  def run(x: Inputs, mode: Mode, differentiated: bool = True) -> tuple[Array, Array]:
    if mode is Mode.SEQUENTIAL:
      return sequential(x, size if differentiated else None, precision)
    out, last = chunked(x, mode)
    kept = read_every // every  # the chunk maps read every step where r does not divide C
    return (out if kept == 1 else out[:, kept - 1::kept]), last

  if plan.forward is plan.derivatives:
    out, last = run(x, plan.forward)
  else:
    out, last = _differentiated_by(functools.partial(run, mode=plan.forward,
                                                     differentiated=False),
                                   functools.partial(run, mode=plan.derivatives), x)
  return finish(x, out, last if final is None else final, return_final_state)


def _differentiated_by(values: Callable[[Inputs], Any], derivatives: Callable[[Inputs], Any],
                       x: Inputs):
  """`values(x)`, differentiated (forward and reverse mode) as `derivatives(x)`.

  Both compute the same function; `values` is the faster way to evaluate it and
  `derivatives` the one whose derivatives are cheaper (e.g. a loop that streams the state
  against the chunked form that keeps one state per chunk).
  """
  fields = (*FLOATS, "reset")
  rebuild = lambda arrays: x._replace(**dict(zip(fields, arrays, strict=True)))

  @jax.custom_jvp
  def evaluate_values(arrays):
    return values(rebuild(arrays))

  @evaluate_values.defjvp
  def _(primals, tangents):
    return jax.jvp(lambda arrays: derivatives(rebuild(arrays)), primals, tangents)

  return evaluate_values(tuple(getattr(x, f) for f in fields))
