"""The pure step functions of supervised training: cross-entropy, `train_step`, `eval_step`, and the
spans of them that run on the device in one call, `train_steps` and `eval_steps`."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding

from ssmkit._src.layers.experts import AUX_LOSS
from ssmkit._src.train.core.loop import run_steps
from ssmkit._src.train.core.model import TrainState
from ssmkit._src.train.supervised.data import gather

Array = jax.Array
Batch = dict[str, Array]


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, example: Batch, key: Array,
                       mode: str, params: Any = None) -> TrainState:
  """Initialises `model` on `example`'s shapes and wraps it with the optimizer.

  Args:
    model: a `ssmkit.layers.SequenceModel`.
    tx: the optimizer.
    example: a batch with "x" and optionally "mask" (only shapes and dtypes matter).
    key: PRNG key of the parameter initialisation.
    mode: scan mode of the SSM layers, bound into the state's `apply_fn`.
    params: parameters to start from (a published checkpoint's) instead of the initial ones;
      they must have the initial ones' structure and shapes.

  Returns:
    The state at step 0.
  """
  init = lambda k: model.init(k, example["x"], example.get("mask"), mode=mode)
  # Parameters to start from leave only the shapes to initialise: a published checkpoint's
  # model is not drawn a second time at random, unless its BatchNorm (the one module that keeps
  # statistics) needs their initial values. Asked of the model, not of a trace of `init`,
  # which took 2.3 s for a 48-layer Qwen3-Next.
  draw = params is None or model.norm == "batch"

  def build(key: Array, params: Any) -> TrainState:
    variables = init(key) if draw else {}
    state = TrainState.create(
        apply_fn=functools.partial(model.apply, mode=mode),
        params=variables["params"] if params is None else params,
        tx=tx,
        batch_stats=variables.get("batch_stats", {}),
    )
    # An int32 array, not the Python int 0, so the first step does not trace with a weak type.
    return state.replace(step=jnp.zeros((), jnp.int32))

  # One program: the optimizer's moments built outside it would compile one per shape.
  return jax.jit(build)(key, params)


def metric_sums(logits: Array, batch: Batch) -> dict[str, Array]:
  """Summed cross-entropy and correct predictions over the scored targets, and their number.

  Targets -1 (per-step tasks) and examples with "valid" False (eval padding) are not scored.

  Args:
    logits: `(B, C)` for labels `(B,)`, or `(B, T, C)` for per-step targets `(B, T)`.
    batch: "y", `(B,)` or `(B, T)` int targets; optionally "valid", `(B,)` bool.

  Returns:
    {"loss": sum of cross-entropies, "correct": number of correct argmax predictions,
    "count": number of scored targets}, float32 scalars.
  """
  y = batch["y"]
  scored = y >= 0
  if "valid" in batch:
    scored = scored & (batch["valid"] if y.ndim == 1 else batch["valid"][:, None])
  labels = jnp.where(scored, y, jnp.zeros_like(y))
  weight = scored.astype(jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  return {"loss": jnp.sum(loss * weight), "correct": jnp.sum(correct * weight), "count": jnp.sum(weight)}


def train_step(state: TrainState, batch: Batch, rng: Array) -> tuple[TrainState, dict[str, Array]]:
  """One AdamW step on the mean cross-entropy of `batch`, plus the weighted load-balancing
  losses that the model's mixtures of experts sow (none without experts).

  Args:
    state: the current state.
    batch: "x" `(B, T, F)` or `(B, T)` tokens, "y" `(B,)` or `(B, T)`, optionally "mask" and
      "reset" `(B, T)`.
    rng: the run's dropout key; the step's key is `fold_in(rng, state.step)`, so a resumed run
      draws the same dropout masks.

  Returns:
    The new state and the batch's `metric_sums` before the update.
  """
  dropout_key = jax.random.fold_in(rng, state.step)

  def loss_fn(params: Any) -> tuple[Array, tuple[dict[str, Array], Any]]:
    logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats},
        batch["x"],
        batch.get("mask"),
        batch.get("reset"),
        train=True,
        rngs={"dropout": dropout_key},
        mutable=["batch_stats", AUX_LOSS],
    )
    sums = metric_sums(logits, batch)
    # The weighted load-balancing losses that mixtures of experts sow, one per block.
    aux = sum(jnp.sum(leaf) for leaf in jax.tree.leaves(updates.get(AUX_LOSS, {})))
    return sums["loss"] / jnp.maximum(sums["count"], 1.0) + aux, (sums, updates)

  grads, (sums, updates) = jax.grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads)
  state = state.replace(batch_stats=updates.get("batch_stats", state.batch_stats))
  return state, sums


def eval_step(state: TrainState, batch: Batch) -> dict[str, Array]:
  """The metric sums of `batch` with dropout off and BatchNorm on its running averages.

  Args:
    state: the state to evaluate.
    batch: like `train_step`'s, plus "valid" `(B,)` bool, False on padding examples.

  Returns:
    `metric_sums` of the batch.
  """
  logits = state.apply_fn(
      {"params": state.params, "batch_stats": state.batch_stats}, batch["x"], batch.get("mask"),
      batch.get("reset"), train=False,
  )
  return metric_sums(logits, batch)


def train_steps(state: TrainState, arrays: Batch, indices: Array, count: Array, rng: Array, *,
                sharding: NamedSharding) -> tuple[TrainState, dict[str, Array]]:
  """`count` train steps in one call, each on the batch it gathers from the resident `arrays`.

  Step i trains on the examples `indices[i]` exactly as `train_step` would on that batch.

  Args:
    state: the state before the first step.
    arrays: the train split on the device: "x" `(N, T, F)` or `(N, T)`, "y", optionally "mask"
      and "reset".
    indices: `(K, B)` int32 example indices of the batches; rows past `count` are ignored.
    count: int32 number of steps, at most K.
    rng: the run's dropout key (see `train_step`).
    sharding: how a batch is split over the devices.

  Returns:
    The state after `count` steps and `(K,)` arrays of every step's `metric_sums` (zero past
    `count`).
  """
  step = lambda state, i: train_step(state, gather(arrays, indices[i], sharding), rng)
  return run_steps(step, state, count, indices.shape[0])


def eval_steps(state: TrainState, arrays: Batch, indices: Array, valid: Array, *,
               sharding: NamedSharding) -> dict[str, Array]:
  """`eval_step` on every eval batch, gathered from the resident `arrays`, in one call.

  Args:
    state: the state to evaluate.
    arrays: the test split on the device, as `train_steps` takes the train split.
    indices: `(M, B)` int32 example indices of the batches.
    valid: `(M, B)` bool, False on padding examples.
    sharding: how a batch is split over the devices.

  Returns:
    `(M,)` arrays of every batch's `metric_sums`.
  """

  def step(_: None, batch: tuple[Array, Array]) -> tuple[None, dict[str, Array]]:
    batch_indices, batch_valid = batch
    batch = {**gather(arrays, batch_indices, sharding), "valid": batch_valid}
    return None, eval_step(state, batch)

  return lax.scan(step, None, (indices, valid))[1]


def mean_metrics(sums: dict[str, Any]) -> dict[str, float]:
  """{"loss", "accuracy"}: the means over the scored targets of `metric_sums` of many batches.

  Args:
    sums: `metric_sums` stacked on a leading axis, one row per batch (NumPy, on the host).
  """
  # Added in float32, one batch after the other.
  total = {key: sum(rows) for key, rows in sums.items()}
  count = max(float(total["count"]), 1.0)
  return {"loss": float(total["loss"]) / count, "accuracy": float(total["correct"]) / count}
