"""`ssmkit.layers.MixtureOfExperts` as a Flax NNX module: the same parameters and maths."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ssmkit._src.layers import common
from ssmkit._src.layers.experts import Experts, mixture, param_specs, sow_balance

Array = jax.Array


class MixtureOfExperts(nnx.Module):
  """A mixture of experts over `features` channels (see `ssmkit.layers.Experts`).

  Its parameters have the linen module's names; its weighted load-balancing loss is sown as
  the `nnx.Intermediate` "load_balancing" when `config.balance_weight` > 0, the last call's.

  Attributes:
    config: the mixture's configuration.
    dtype: the computation dtype; None: the inputs'.
    param_dtype: the parameters' dtype.
  """

  def __init__(self, features: int, config: Experts, *, dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    common.check_positive_int(features, "features")
    self.config, self.dtype, self.param_dtype = config, dtype, param_dtype
    params = common.create_params(param_specs(config, features), param_dtype,
                                  lambda name, init, shape, dtype: init(rngs.params(), shape, dtype))
    for name, value in params.items():
      setattr(self, name, nnx.Param(value))

  def __call__(self, x: Array, axis_name: Hashable | None = None) -> Array:
    params = {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}
    dtype = x.dtype if self.dtype is None else self.dtype
    y, balance = mixture(self.config, params, x, common.computation_dtype(dtype), axis_name)
    sow_balance(self, self.config, balance)
    return y.astype(dtype)
