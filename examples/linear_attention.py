"""Runs linear attention (SSD-style decay) and the gated delta rule in every mode.

    python examples/linear_attention.py

Two packed sequences share one batch row (a reset where the second starts). For each
function and mode it prints the largest difference from the sequential mode, for the
outputs, the final state and the gradient of a loss with respect to the keys; then it
decodes the last 5 steps one at a time from the state the prefix leaves.
"""

import functools

import jax
import jax.numpy as jnp

from ssmkit.scan import delta_rule, linear_attention

BATCH, STEPS, HEADS, DIM = 2, 300, 4, 32


def inputs():
  keys = jax.random.split(jax.random.key(0), 5)
  shape = (BATCH, STEPS, HEADS, DIM)
  q = jax.random.normal(keys[0], shape) * DIM**-0.5
  k = jax.random.normal(keys[1], shape)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(keys[2], shape)
  log_decay = -jax.random.uniform(keys[3], shape[:3], minval=0.01, maxval=0.2)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], shape[:3]))
  reset = jnp.zeros((BATCH, STEPS), bool).at[:, 170].set(True)  # the second sequence starts
  return q, k, v, log_decay, beta, reset


def main() -> None:
  q, k, v, log_decay, beta, reset = inputs()
  functions = {
      "linear_attention": lambda q, k, v, mode: linear_attention(
          q, k, v, log_decay, reset=reset, mode=mode, return_final_state=True),
      "delta_rule": lambda q, k, v, mode: delta_rule(
          q, k, v, beta, log_decay, reset=reset, mode=mode, return_final_state=True),
  }
  for name, function in functions.items():
    run = jax.jit(function, static_argnames="mode")
    grad = jax.jit(jax.grad(lambda k, mode, f=function: jnp.sum(jnp.sin(f(q, k, v, mode)[0])),
                            argnums=0), static_argnames="mode")
    out, state = run(q, k, v, "sequential")
    grad_k = grad(k, "sequential")
    for mode in ("chunked", "parallel", "auto"):
      out_m, state_m = run(q, k, v, mode)
      print(f"{name:>16} {mode:>9}: max |o - sequential| = {jnp.abs(out_m - out).max():.1e}, "
            f"|S_T - sequential| = {jnp.abs(state_m - state).max():.1e}, "
            f"|dL/dk - sequential| = {jnp.abs(grad(k, mode) - grad_k).max():.1e}")

  # Decoding: run the first STEPS - 5 steps as one piece, then one step at a time.
  prefix = STEPS - 5
  piece = lambda x, start, stop: x[:, start:stop]
  step = jax.jit(functools.partial(linear_attention, return_final_state=True))
  full = linear_attention(q, k, v, log_decay, reset=reset)
  _, state = linear_attention(*(piece(x, 0, prefix) for x in (q, k, v, log_decay)),
                              reset=piece(reset, 0, prefix), return_final_state=True)
  decoded = []
  for t in range(prefix, STEPS):
    o_t, state = step(*(piece(x, t, t + 1) for x in (q, k, v, log_decay)),
                      initial_state=state, reset=piece(reset, t, t + 1))
    decoded.append(o_t)
  error = jnp.abs(jnp.concatenate(decoded, axis=1) - full[:, prefix:]).max()
  print(f"decoding the last 5 steps one at a time: max |o - one pass| = {error:.1e}")


if __name__ == "__main__":
  main()
