"""A layer added as a new layer is: this one file and one registry entry, nothing else.

`test_registry.py` runs every contract module with this file as a pytest plugin
(`-p throwaway_layer`), which registers the layer as "throwaway" before the tests are
collected, and writes the ids of every collected test to the file named by
`$SSMKIT_COLLECTED`, so that a contract which leaves a registered layer out shows.

The layer is an exponential moving average of a projection of the input, per state channel:
h_t = a h_{t-1} + (1 - a) B x_t, y_t = C h_t + D x_t, with a = sigmoid(a_logit).
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssmkit._src.layers import common, functional, initializers, registry
from ssmkit._src.linear_recurrence import accumulation_dtype, linear_recurrence
from ssmkit._src.modes import Mode

Array = jax.Array


def param_specs(cfg: Any, features: int) -> dict[str, common.ParamSpec]:
  """a_logit `(N,)`, B `(N, H)`, C `(H, N)`, D `(H,)`."""
  common.check_positive_int(cfg.d_state, "d_state")
  n = cfg.d_state
  return {
      "a_logit": common.ParamSpec((n,), initializers.uniform(3.0)),
      "B": common.ParamSpec((n, features), initializers.uniform(features**-0.5)),
      "C": common.ParamSpec((features, n), initializers.uniform(n**-0.5)),
      "D": common.ParamSpec((features,), nn.initializers.ones),
  }


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> Array:
  return jnp.zeros((*tuple(input_shape)[:-1], cfg.d_state), jnp.float32)


def _parts(params: dict[str, Array], x: Array) -> tuple[Array, Array]:
  a = jax.nn.sigmoid(params["a_logit"])
  return a, (x @ params["B"].T) * common.leading_ones(1 - a, x.ndim)


def _read(params: dict[str, Array], h: Array, x: Array) -> Array:
  return h @ params["C"].T + x * common.leading_ones(params["D"], x.ndim)


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: str | Mode, *,
             initial_state: Array | None = None, axis_name: Hashable | None = None
             ) -> tuple[Array, Array]:
  state = functional.starting_state(initialize_state, cfg, x, initial_state)
  xf = x.astype(accumulation_dtype(x.dtype))
  a, b = _parts(params, xf)
  h, last = linear_recurrence(a, b, state, reset=reset, axis=-2, mode=mode, return_final_state=True,
                              axis_name=axis_name)
  return _read(params, h, xf).astype(x.dtype), last


def step(cfg: Any, params: dict[str, Array], state: Array, x_t: Array,
         reset: Array | None = None) -> tuple[Array, Array]:
  return functional.one_step(sequence, cfg, params, state, x_t, reset)


class Throwaway(functional.LinenLayer):
  """h_t = a h_{t-1} + (1 - a) B x_t, y_t = C h_t + D x_t."""

  d_state: int = 8
  param_dtype: jnp.dtype = jnp.float32

  parameter_groups = common.ParameterGroups(recurrence=frozenset({"a_logit"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state)


def pytest_configure(config) -> None:
  registry.LAYERS["throwaway"] = registry.Entry(Throwaway, ({"d_state": 5}, {"d_state": 3}))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items) -> None:
  with open(os.environ["SSMKIT_COLLECTED"], "w") as f:
    f.write("\n".join(item.nodeid for item in items))


# Its reference test.


def test_throwaway_matches_a_float64_loop():
  layer = Throwaway(d_state=3)
  x = jax.random.normal(jax.random.key(0), (17, 4))
  reset = np.asarray(jax.random.bernoulli(jax.random.key(1), 0.2, (17,)))
  params = layer.init(jax.random.key(2), x)
  p = {k: np.asarray(v, np.float64) for k, v in params["params"].items()}
  a = 1 / (1 + np.exp(-p["a_logit"]))
  h, expected = np.zeros(3), []
  for t in range(17):
    h = (0 if reset[t] else a * h) + (1 - a) * (p["B"] @ np.asarray(x[t], np.float64))
    expected.append(p["C"] @ h + p["D"] * np.asarray(x[t], np.float64))
  np.testing.assert_allclose(layer.apply(params, x, jnp.asarray(reset)), np.stack(expected),
                             rtol=1e-5, atol=1e-5 * math.sqrt(3))
