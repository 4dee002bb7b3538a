"""Linear attention with decay: S_t = exp(g_t) S_{t-1} + k_t^T v_t, o_t = q_t S_t, per head."""

from __future__ import annotations

import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from ssmkit._src.matrix_state import chunks, common, steps
from ssmkit._src.matrix_state.inputs import Inputs, prepare
from ssmkit._src.matrix_state.kernels import linear_attention as kernels
from ssmkit._src.modes import LINEAR_VALUES_CHUNKED_ROWS, Impl, Mode, parse_impl

Array = jax.Array

# On CPU, outside the parallel form, chunks of 32 steps: with one decay per key (GLA) always,
# with one decay per head or none where at least 8 (batch row, head) sequences run together
# (and their states are small: below).
# Gradients, 32 against 64 steps, side by side (CPU, K=V=64 unless said):
# - one decay per head: B=2 T=4096 H=4 43.4 against 50.4 ms, B=8 T=1024 H=4 42.5 against 47.8,
#   B=4 T=1024 H=16 114 against 126, B=16 T=256 H=4 25.2 against 28.3, K=128 V=64 68.3 against
#   75.7, exclusive reads 44.0 against 50.4, the step loop (its rematerialised groups) at B=2
#   T=1024 H=4 81.9 against 90.5; K=V=32 within 3% (larger states: below), the forwards within
#   4% (8% faster at B=16 T=1024 H=4). With fewer sequences the 32-step chunks' operations were
#   too small to pay (B=1 T=16384 H=2: 72.4 against 56.0 ms; B=2 T=4096 H=2: 24.2 against 22.7).
# - one decay per key: the chunk's scores stay one product for decays twice as strong (60 nats a
#   chunk, `chunks.per_key_scores`). Log-decays in [-1.5, -0.5]: B=2 T=4096 H=4 65.7 against
#   120.1 ms, B=8 T=1024 H=4 68.5 against 155.4, B=1 T=16384 H=2 93.1 against 227.2, the forward
#   at B=16 T=1024 H=4 51.3 against 124.7; in [-0.3, -0.01]: 65.9 against 68.9 at B=2 T=4096 H=4,
#   30.9 against 34.0 at B=2 T=4096 H=2, 92.7 against 88.6 at B=1 T=16384 H=2.
# The parallel form lost at 32 (one decay per head: 119.8 against 101.4 ms).
_CPU_CHUNK_SIZE = 32
_CPU_CHUNK_ROWS = 8
# One decay per head or none takes 32 steps only while a head's state holds fewer entries
# (K x V) than this: a larger state, stored at every chunk's edge, outweighs the C x C work
# that 32 steps save. `scripts/bench_chunk_sizes.py --function linear_attention`, 32 against 64
# steps, forward, then gradient: K=V=128 at B=8 T=1024 H=4 73.6 against 79.4 ms, 345 against
# 266 ms (the forward 7% faster at 32 steps, the gradient 30% slower); K=128 V=256 at B=2
# T=2048 H=4 77.3 against 70.5, 256 against 229; K=256 V=512 there 222 against 212, 1013
# against 777; below it, K=V=64 at B=2 T=4096 H=4 29.5 against 34.7, 113 against 116.
_CPU_CHUNK_STATES_BELOW = 1 << 14


def _default_chunk_size(x: Inputs, mode: Mode, per_key: bool) -> int:
  """Steps per chunk for `x` in `mode` (with one decay `per_key`) where the caller gives none."""
  pays = per_key or (x.q.shape[0] * x.q.shape[2] >= _CPU_CHUNK_ROWS
                     and x.k.shape[-1] * x.v.shape[-1] < _CPU_CHUNK_STATES_BELOW)
  if jax.default_backend() == "cpu" and mode is not Mode.PARALLEL and pays:
    return _CPU_CHUNK_SIZE
  return common.DEFAULT_CHUNK_SIZE


def _step(precision):
  def step(s, x):
    # (Z, H, K), (Z, H, K), (Z, H, V), (Z, H[, K]), (Z, H), (Z,)
    q_t, k_t, v_t, g_t, beta_t, reset_t = x
    if reset_t is not None:
      s = jnp.where(reset_t[:, None, None, None], 0, s)
    if beta_t is not None:
      k_t = k_t * beta_t[..., None]
    s = steps.decayed(s, g_t) + k_t[..., :, None] * v_t[..., None, :]
    return s, jnp.einsum("zhk,zhkv->zhv", q_t, s, precision=precision)

  return step


def _sequential(x: Inputs, size: int | None, precision) -> tuple[Array, Array]:
  return steps.run(_step(precision), (x.q, x.k, x.v, x.log_decay, x.beta, x.reset), x.state, size)


def _exclusive_sequential(x: Inputs, size: int | None, precision) -> tuple[Array, Array]:
  """`_sequential` with each step reading the state before its own write, exp(g_t) q_t S_{t-1}.

  Step t reads the state after its write with step t + 1's query, and the reads move one step
  on: with steps that read their state before updating it, the update no longer fused with
  the read, Mamba-3's forward took 41.6 ms against 34.5 (B=2 T=4096 H=4 K=V=64, CPU).
  """
  g = x.log_decay
  kept = None if x.reset is None else ~x.reset  # a reset's step reads nothing
  q = x.q if g is None else x.q * jnp.exp(g if g.ndim == 4 else g[..., None])
  q = chunks.masked(q, kept)
  ahead = jnp.concatenate([q[:, 1:], jnp.zeros_like(q[:, :1])], axis=1)
  out, final = _sequential(x._replace(q=ahead), size, precision)
  first = jnp.einsum("zhk,zhkv->zhv", q[:, 0], x.state, precision=precision)
  out = jnp.concatenate([first[:, None].astype(out.dtype), out[:, :-1]], axis=1)
  # By selection: the read of a NaN state before a reset stays out, values and gradients.
  return chunks.masked(out, kept), final


def _chunk_maps(c: chunks.Chunks, precision, exclusive: bool = False, factored: bool = False):
  """The chunks' maps S -> a S + u and a function from entering states to outputs (which
  read the state before each step's own write when `exclusive`); `factored` as
  `chunks.per_key_scores` takes it."""
  q, k, v, g, reset = c.q, c.k, c.v, c.log_decay, c.reset
  if c.beta is not None:
    k = k * c.beta[..., None]
  seg = chunks.segments(reset, q.shape[3])
  mask = seg.strict if exclusive else seg.causal
  (q,), bad_query = common.sanitize((q,))
  bad = reached = None
  if reset is not None:
    (k, v), bad = common.sanitize((k, v))  # k carries beta
    (g,), bad_decay = common.sanitize((g,))
    if bad_decay is not None:
      bad = bad | bad_decay
    if exclusive:  # a step's read comes after its decay, before its write
      reached = chunks.poisoned_before(bad, reset)
      if bad_decay is not None:
        reached = reached | (bad_decay & ~reset)
  scores = jnp.einsum("zhncd,zhnsd->zhncs", q, k, precision=precision)
  if g is None:
    weights = jnp.where(mask, scores, 0)
    q_in, k_out = q, k
    a = jnp.ones((*q.shape[:3], 1, 1), q.dtype)
  else:
    b = chunks.cumulative(g, seg)
    total = b[:, :, :, -1]
    if g.ndim == 4:
      weights = scores * chunks.pairwise_decay(g, mask)
      q_in = q * jnp.exp(b)[..., None]
      k_out = k * chunks.decay_to_end(g, seg)[..., None]
      a = jnp.exp(total)[..., None, None]
    else:
      ((decayed,),) = chunks.per_key_scores((q,), (k,), g, b, b, precision, factored=factored,
                                            index=seg.index)
      weights = jnp.where(mask, decayed, 0)
      q_in = q * jnp.exp(b)
      k_out = k * chunks.decay_to_end(g, seg, b if factored else None)
      a = jnp.exp(total)[..., None]
  intra = jnp.einsum("zhncs,zhnse->zhnce", weights, v, precision=precision)
  u = jnp.einsum("zhnsd,zhnse->zhnde", chunks.masked(k_out, seg.last), v, precision=precision)
  return common.read_out(a, u, q_in, intra, seg, bad, bad_query, reset, precision, reached=reached)


def linear_attention(
    q,
    k,
    v,
    log_decay=None,
    *,
    beta=None,
    initial_state=None,
    reset=None,
    mode: str | Mode = "auto",
    chunk_size: int | None = None,
    return_final_state: bool = False,
    axis_name: Hashable | None = None,
    precision: lax.PrecisionLike = None,
    check_log_decay: bool = True,
    exclusive: bool = False,
    impl: str | Impl = "auto",
):
  """Linear attention with a decaying matrix state, the recurrence of SSD, RetNet and GLA.

  Per head, with a `(K, V)` state S, row vectors q_t, k_t `(K,)` and v_t `(V,)`:

    S_t = exp(g_t) * S_{t-1} + beta_t k_t^T v_t,    o_t = q_t S_t,

  where g_t = `log_decay` is one number per head (Mamba-2's SSD, RetNet), one per key
  channel, scaling the rows of S (GLA), or absent (plain linear attention), and beta_t
  an optional write strength per head (Mamba-2's dt_t, where it is not folded into B).
  No scaling of `q` is implied. `reset[..., t]` clears the state before step t, also in the
  middle of a chunk, so packed sequences of different lengths never see each other: in every
  mode the outputs and gradients from a reset on are the same to the last bit whatever came
  before it, and inputs are selected, never multiplied by zero, so a NaN or Inf before a
  reset stays before it.

  The chunked mode computes each chunk of C steps as a masked, decayed attention-like
  product (C x C) plus the contribution of the state entering the chunk, and carries only
  the (K, V) state from chunk to chunk. Decays inside a chunk are differences of
  cumulative log-decays restarting at each reset, never ratios of products. Gradients are
  JAX's own (forward and reverse mode, any order); they keep one state per chunk and
  recompute the rest, so memory does not hold T states. bfloat16/float16 inputs accumulate in float32.

  Args:
    q: `(..., T, H, K)` queries, real floating; or `(..., T, H / G, K)` with G value heads
      per head of q and k (grouped heads, as Mamba-2's groups of B and C or Qwen3-Next's
      value heads): value head h reads query and key head h // G.
    k: `(..., T, H, K)` keys, or `(..., T, H / G, K)` as `q`.
    v: `(..., T, H, V)` values.
    log_decay: None, `(..., T, H)` or `(..., T, H, K)`: log of the decay, <= 0 and finite
      (checked where the values are known at trace time).
    beta: None (1) or `(..., T, H)` write strengths; passing them rather than scaled keys
      keeps no scaled copy of the keys for the gradient.
    initial_state: `(..., H, K, V)` state before the first step; default zeros.
    reset: `(..., T)` booleans; True clears the state before that step.
    mode: "sequential" (one step at a time: the decoding path), "chunked" (the chunkwise
      algorithm, chunks carried one after another), "parallel" (the chunkwise algorithm
      with the chunks combined as a tree, depth log(T / C)) or "auto": on CPU, derivatives
      by the chunked form from 64 steps on, values step by step below 32 (batch row, head)
      sequences and chunked from 32 on (step by step below 64 steps); on accelerators, the
      parallel form.
    chunk_size: steps per chunk (and per rematerialised group of the sequential mode), at
      most T; default 64, or 32 on CPU outside the parallel mode with one decay per key, or
      with one decay per head (or none) over at least 8 (batch row, head) sequences whose
      states hold fewer than 2^14 (K x V) entries each (faster there).
    return_final_state: also return S_T, to continue over the next piece of a sequence.
    axis_name: sequence parallelism. Inside `jax.shard_map` with the time axis split over
      the mesh axis of this name (consecutive slices of equal length in mesh order),
      return this device's slice of the outputs over the whole sequence. Each device sums
      its slice up as one map S -> A S + U (A the decay product), the maps are
      all-gathered and composed, and each device runs its slice from the state entering
      it. `initial_state` is read on the device with the first slice; the final state is
      the whole sequence's, the same on every device.
    precision: precision of the matrix products (`jax.lax.Precision`); default JAX's
      (TF32 for float32 on recent NVIDIA GPUs: pass "highest" for full float32).
    check_log_decay: refuse a positive or non-finite `log_decay` whose values are known at
      trace time (outside `jit`). Code that computes the decays from its own inputs (the
      layers) passes False, so that a NaN input flows through eagerly as under `jit`.
    exclusive: each step reads the state before its own write, o_t = exp(g_t) q_t S_{t-1}
      (the write never enters its own step's output, so nothing is added and taken back).
    impl: "xla" (the modes above, compiled by XLA), "pallas" (ssmkit's kernels of the chunked
      form, `mode` aside: compiled for NVIDIA GPUs, run by Pallas' interpreter on other
      backends, which only tests can afford) or "auto" (today the XLA forms everywhere: the
      kernels have not yet been timed against them on a GPU). The kernels take float32 and
      16-bit inputs, resets, `initial_state`, `beta`, any T, `jit`, `vmap` and `grad`; a
      call with a non-finite input or cotangent, `exclusive`, `axis_name` or float64 inputs
      runs the XLA form. Forward-mode derivatives (`jvp`) of the kernels are refused by
      JAX: pass "xla" for them.

  Returns:
    `o` `(..., T, H, V)` in the inputs' promoted dtype (an `initial_state` wider than
    float32 promotes it too); with `return_final_state`, the tuple `(o, S_T)` with `S_T`
    `(..., H, K, V)` in the accumulation dtype (float32 for 16-bit inputs), so a sequence
    streamed in pieces rounds its state no more than one pass.

  Raises:
    TypeError: for integer or complex inputs, or a non-boolean `reset`.
    ValueError: for shapes that do not fit `q`, a positive or non-finite `log_decay`
      known at trace time, an unknown `mode`, a non-positive `chunk_size`, or an
      `axis_name` that is not a mesh axis of an enclosing `shard_map`, or an unknown
      `impl`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit.scan import linear_attention
    >>> q = k = jnp.ones((3, 1, 2))  # T=3, one head, K=2
    >>> v = jnp.ones((3, 1, 1))
    >>> linear_attention(q, k, v, jnp.log(jnp.full((3, 1), 0.5)))[:, 0, 0]
    Array([2. , 3. , 3.5], dtype=float32)

  References:
    Katharopoulos et al., "Transformers are RNNs", ICML 2020; Sun et al., "Retentive
    network", 2023; Yang et al., "Gated linear attention transformers with
    hardware-efficient training", ICML 2024; Dao & Gu, "Transformers are SSMs", ICML 2024.
  """
  mode = common.check_options(mode, chunk_size, axis_name)
  impl = parse_impl(impl)
  x = prepare(q, k, v, log_decay=log_decay, beta=beta, initial_state=initial_state,
              reset=reset, check_log_decay=check_log_decay, grouped=True)

  def by_xla(x: Inputs, return_final_state: bool):
    per_key = x.log_decay is not None and x.log_decay.ndim == 4
    return common.evaluate(x, _exclusive_sequential if exclusive else _sequential,
                           functools.partial(_chunk_maps, exclusive=exclusive), matrix=False,
                           mode=mode, chunk_size=chunk_size, axis_name=axis_name,
                           precision=precision, return_final_state=return_final_state,
                           per_key_scores=per_key, chunked_values_rows=LINEAR_VALUES_CHUNKED_ROWS,
                           default_chunk_size=_default_chunk_size(x, mode, per_key))

  return common.evaluate_by(Impl.XLA if exclusive else impl, x, kernels.run, by_xla,
                            chunk_size=chunk_size, axis_name=axis_name, precision=precision,
                            return_final_state=return_final_state)
