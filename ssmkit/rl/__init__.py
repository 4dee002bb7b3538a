"""Return estimators for JAX reinforcement learning: rlax semantics, batched, truncation-aware."""

from ssmkit._src.returns import (
    discounted_returns,
    generalized_advantage_estimation,
    lambda_returns,
    n_step_returns,
)

__all__ = [
    "discounted_returns",
    "generalized_advantage_estimation",
    "lambda_returns",
    "n_step_returns",
]
