"""Supervised training (`task: supervised`): its config, optimizer, step functions and entry points."""

from ssmkit._src.train.supervised.config import Config, DataConfig, OptimizerConfig, TrainConfig
from ssmkit._src.train.supervised.data import TrainOrder, eval_indices
from ssmkit._src.train.supervised.optim import learning_rate_schedule, make_optimizer
from ssmkit._src.train.supervised.steps import (
    create_train_state,
    eval_step,
    eval_steps,
    mean_metrics,
    metric_sums,
    train_step,
    train_steps,
)
from ssmkit._src.train.supervised.train import Setup, evaluate, load, setup, train_and_evaluate

__all__ = [
    "Config",
    "DataConfig",
    "OptimizerConfig",
    "Setup",
    "TrainConfig",
    "TrainOrder",
    "create_train_state",
    "eval_indices",
    "eval_step",
    "eval_steps",
    "evaluate",
    "learning_rate_schedule",
    "load",
    "make_optimizer",
    "mean_metrics",
    "metric_sums",
    "setup",
    "train_and_evaluate",
    "train_step",
    "train_steps",
]
