"""Trains an ssmkit model written in Flax NNX on MNIST-1D, then steps an NNX layer as a recurrent policy.

    python examples/nnx_training.py            # the recipe of configs/mnist1d_lru.yaml, 40 epochs
    python examples/nnx_training.py --epochs 2

The model, optimizer and data are those of `ssmkit train mnist1d_lru` (2 LRU blocks, BatchNorm,
GLU, dropout; AdamW with the LRU's recurrence parameters in their own group), read from the
same config, but the model is an `ssmkit.nnx.SequenceModel` trained with `nnx.Optimizer` and
`nnx.jit`. Prints the test accuracy and the wall time; docs/results.md has the linen run's.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ssmkit.nnx
import ssmkit.train
from ssmkit import data


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


# graph=False: the modules pass as pytrees, which skips nnx.jit's walk of the module graph
# on every call (about a millisecond for this model); the Variables are updated in place as in
# the default graph mode.
@nnx.jit(graph=False, graph_updates=False)
def train_step(model: ssmkit.nnx.SequenceModel, optimizer: nnx.Optimizer, x: jax.Array,
               y: jax.Array) -> jax.Array:
  """One AdamW step on a batch; the model's BatchNorm averages and dropout stream move on too."""
  loss, grads = nnx.value_and_grad(lambda model: cross_entropy(model(x), y))(model)
  optimizer.update(model, grads)
  return loss


@nnx.jit(graph=False, graph_updates=False)
def accuracy(model: ssmkit.nnx.SequenceModel, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(model(x), axis=-1) == y)


def train(epochs: int | None) -> None:
  config = ssmkit.train.load_config("mnist1d_lru")
  epochs = epochs or config.train.epochs
  dataset = data.load(config.data.name, **config.data.kwargs)
  batch, steps_per_epoch = config.data.batch_size, dataset.num_train // config.data.batch_size
  m = config.model
  model = ssmkit.nnx.SequenceModel(
      dataset.num_features, dataset.num_classes,
      layer=functools.partial(ssmkit.nnx.LRU, **m.layer_kwargs), features=m.features,
      num_blocks=m.num_blocks, pooling=m.pooling, norm=m.norm, activation=m.activation,
      dropout_rate=m.dropout_rate, prenorm=m.prenorm, rngs=nnx.Rngs(config.train.seed))
  # The config's optimizer: clipping, warmup and cosine decay, and three AdamW groups.
  tx = ssmkit.train.supervised.make_optimizer(config.optimizer, m.layer, epochs * steps_per_epoch)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  order = np.random.default_rng(config.train.seed)
  start = time.perf_counter()
  for epoch in range(epochs):
    model.train()
    permutation = order.permutation(dataset.num_train)
    for i in range(steps_per_epoch):
      index = permutation[i * batch : (i + 1) * batch]
      loss = train_step(model, optimizer, dataset.x_train[index], dataset.y_train[index])
    if (epoch + 1) % 10 == 0 or epoch + 1 == epochs:
      model.eval()
      test = float(accuracy(model, dataset.x_test, dataset.y_test))
      print(f"epoch {epoch + 1}: train loss {float(loss):.4f}, test accuracy {test:.3f}", flush=True)
  print(f"{epochs * steps_per_epoch} steps in {time.perf_counter() - start:.0f} s")


def recurrent_policy() -> None:
  """An NNX LRU as the memory of a policy: stepped through a rollout that crosses episode
  boundaries, then re-run on the whole rollout as one sequence, as a PPO update does."""
  rngs = nnx.Rngs(0)
  memory = ssmkit.nnx.LRU(8, d_state=16, rngs=rngs)
  head = nnx.Linear(8, 3, rngs=rngs)  # logits of 3 actions
  steps, envs = 50, 4
  observations = jax.random.normal(jax.random.key(1), (steps, envs, 8))
  episode_starts = jax.random.bernoulli(jax.random.key(2), 0.05, (steps, envs)).at[0].set(True)

  @nnx.scan(in_axes=(None, None, nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
  def act(memory, head, state, observation, start):
    state, features = memory.step(state, observation, start)
    return state, head(features)

  state = memory.initialize_state((envs, 8))
  state, logits = act(memory, head, state, observations, episode_starts)
  # Time on axis -2 for the sequence form: (envs, steps, features).
  again = head(memory(jnp.swapaxes(observations, 0, 1), jnp.swapaxes(episode_starts, 0, 1)))
  gap = float(jnp.max(jnp.abs(jnp.swapaxes(again, 0, 1) - logits)))
  print(f"policy over {steps} steps x {envs} environments: stepped and whole-sequence logits "
        f"differ by {gap:.1e}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, help="passes over the 4000 training sequences "
                      "(default: the config's 40)")
  args = parser.parse_args()
  recurrent_policy()
  train(args.epochs)


if __name__ == "__main__":
  main()
