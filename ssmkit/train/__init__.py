"""Training and evaluation of `ssmkit.layers.SequenceModel` from YAML configs.

Supervised training on `ssmkit.data` tasks (`Config`, `train_and_evaluate`), and PPO with
recurrent policies on gymnax environments (`PPOConfig`, `train_ppo`).
"""

from ssmkit._src.train.config import (
    Config,
    DataConfig,
    MeshConfig,
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
from ssmkit._src.train.parallel import initialize_distributed
from ssmkit._src.train.ppo import Agent, PPOState, VecEnv, ppo_loss, ppo_update
from ssmkit._src.train.ppo_config import (
    EnvConfig,
    PolicyConfig,
    PPOConfig,
    PPOHyperparameters,
    PPOTrainConfig,
)
from ssmkit._src.train.ppo_loop import evaluate_ppo, make_agent, make_env, train_ppo
from ssmkit._src.train.steps import TrainState, eval_step, train_step

__all__ = [
    "Agent",
    "Config",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "Interrupted",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PPOConfig",
    "PPOHyperparameters",
    "PPOState",
    "PPOTrainConfig",
    "PolicyConfig",
    "TrainConfig",
    "TrainState",
    "VecEnv",
    "build_model",
    "eval_step",
    "evaluate",
    "evaluate_ppo",
    "initialize_distributed",
    "load_config",
    "make_agent",
    "make_env",
    "make_optimizer",
    "ppo_loss",
    "ppo_update",
    "shipped_configs",
    "train_and_evaluate",
    "train_ppo",
    "train_step",
]
