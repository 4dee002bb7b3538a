"""Runs one linear recurrence in every ssmkit scan mode and checks they agree.

    python examples/scan_modes.py

Prints, for a decaying recurrence with episode resets, the largest difference of each
mode from the sequential result and the gradient of each mode's loss.
"""

import jax
import jax.numpy as jnp

import ssmkit


def main() -> None:
  key_a, key_b, key_r = jax.random.split(jax.random.key(0), 3)
  steps, features = 1000, 8
  a = jax.random.uniform(key_a, (steps, features), minval=0.9, maxval=1.0)
  b = jax.random.normal(key_b, (steps, features))
  reset = jax.random.bernoulli(key_r, 0.01, (steps, 1))

  def loss(a, b, mode):
    return jnp.sum(ssmkit.scan.linear_recurrence(a, b, reset=reset, mode=mode) ** 2)

  reference = ssmkit.scan.linear_recurrence(a, b, reset=reset, mode="sequential")
  for mode in ["sequential", "parallel", "chunked", "auto"]:
    h = jax.jit(ssmkit.scan.linear_recurrence, static_argnames="mode")(a, b, reset=reset, mode=mode)
    grad_a = jax.jit(jax.grad(loss), static_argnames="mode")(a, b, mode=mode)
    print(
        f"{mode:>10}: max |h - sequential| = {float(jnp.max(jnp.abs(h - reference))):.2e}, "
        f"|dL/da| = {float(jnp.linalg.norm(grad_a)):.4f}"
    )


if __name__ == "__main__":
  main()
