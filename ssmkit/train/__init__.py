"""Training and evaluation of `ssmkit.layers.SequenceModel` on `ssmkit.data` tasks from YAML configs."""

from ssmkit._src.train.config import (
    Config,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
    load_config,
    shipped_configs,
)
from ssmkit._src.train.errors import ConfigError, Interrupted
from ssmkit._src.train.loop import evaluate, train_and_evaluate
from ssmkit._src.train.model import build_model
from ssmkit._src.train.optim import make_optimizer
from ssmkit._src.train.steps import TrainState, eval_step, train_step

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "Interrupted",
    "ModelConfig",
    "OptimizerConfig",
    "TrainConfig",
    "TrainState",
    "build_model",
    "eval_step",
    "evaluate",
    "load_config",
    "make_optimizer",
    "shipped_configs",
    "train_and_evaluate",
    "train_step",
]
