"""From the episode-end flags of Gymnasium-style rollouts to the estimators' arguments."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ssmkit._src import checks

Array = jax.Array
ArrayLike = jax.typing.ArrayLike


class EpisodeEnds(NamedTuple):
  """The `discounts` and `truncated` arguments of the `ssmkit.rl` estimators.

  Attributes:
    discounts: gamma, and 0 where the episode terminated.
    truncated: True where the episode was cut by a time limit and did not terminate.
  """

  discounts: Array
  truncated: Array


def from_gymnasium(terminated: ArrayLike, truncated: ArrayLike, gamma: ArrayLike) -> EpisodeEnds:
  """Discounts and truncation flags from Gymnasium's `terminated` and `truncated`.

  `env.step` returns both flags for the step just taken: `terminated` when the episode
  reached a terminal state (nothing follows: discount 0), `truncated` when a time limit or
  another outside cause cut it (the estimators then bootstrap from `final_values`, the
  value of the final observation). A step that is both is a termination. Pass the flags
  aligned with the rewards of the same steps: CleanRL's `dones` buffer holds them one step
  later (`dones[t + 1]` flags step t) and merges the two.

  Args:
    terminated: boolean, any shape, e.g. `(T, B)`: the `terminated` of every step.
    truncated: boolean, `terminated`'s shape: the `truncated` of every step.
    gamma: the discount, in [0, 1]: a scalar, or `terminated`'s shape.

  Returns:
    `EpisodeEnds(discounts, truncated)`: `discounts = gamma * (1 - terminated)` in
    `gamma`'s float dtype (JAX's default float for a Python number), and `truncated` with
    the terminated steps cleared.

  Examples:
    >>> import jax.numpy as jnp
    >>> from ssmkit import rl
    >>> ends = rl.from_gymnasium(jnp.array([False, True, False, True]),
    ...                          jnp.array([False, False, True, True]), 0.9)
    >>> ends.discounts
    Array([0.9, 0. , 0.9, 0. ], dtype=float32)
    >>> ends.truncated
    Array([False, False,  True, False], dtype=bool)
  """
  terminated, truncated = jnp.asarray(terminated), jnp.asarray(truncated)
  checks.check_bool(terminated, "terminated")
  checks.check_bool(truncated, "truncated")
  checks.check_shape(truncated, terminated.shape, "truncated", "the shape of `terminated`")
  gamma = jnp.asarray(gamma)
  dtype = gamma.dtype if jnp.issubdtype(gamma.dtype, jnp.floating) else jnp.result_type(float)
  gamma = gamma.astype(dtype)  # a Python number becomes a strongly typed array
  if gamma.ndim:
    checks.check_shape(gamma, terminated.shape, "gamma", "a scalar or the shape of `terminated`")
  if not isinstance(gamma, jax.core.Tracer):
    value = np.asarray(gamma)
    if not np.all((value >= 0) & (value <= 1)):
      raise ValueError(f"`gamma` must lie in [0, 1], got values in [{value.min()}, {value.max()}].")
  discounts = jnp.where(terminated, jnp.zeros_like(gamma), gamma)
  return EpisodeEnds(discounts, truncated & ~terminated)
