"""Return estimators for JAX reinforcement learning: rlax semantics, batched, truncation-aware."""

from ssmkit._src.off_policy import (
    VTraceOutput,
    q_lambda,
    retrace,
    retrace_continuous,
    td_lambda,
    vtrace,
    vtrace_td_error_and_advantage,
)
from ssmkit._src.returns import (
    discounted_returns,
    generalized_advantage_estimation,
    lambda_returns,
    n_step_returns,
)
from ssmkit._src.rollouts import EpisodeEnds, from_gymnasium

__all__ = [
    "EpisodeEnds",
    "VTraceOutput",
    "discounted_returns",
    "from_gymnasium",
    "generalized_advantage_estimation",
    "lambda_returns",
    "n_step_returns",
    "q_lambda",
    "retrace",
    "retrace_continuous",
    "td_lambda",
    "vtrace",
    "vtrace_td_error_and_advantage",
]
