"""PPO with recurrent policies on gymnax environments (`task: ppo`): its config, pieces, entry points."""

from ssmkit._src.train.ppo.agent import Agent, make_agent
from ssmkit._src.train.ppo.config import (
    EnvConfig,
    PolicyConfig,
    PPOConfig,
    PPOHyperparameters,
    PPOTrainConfig,
)
from ssmkit._src.train.ppo.env import VecEnv, make_env
from ssmkit._src.train.ppo.rollout import (
    ActorState,
    Rollout,
    advantages_and_targets,
    collect_rollout,
    evaluate_policy,
    init_actor,
)
from ssmkit._src.train.ppo.train import Setup, evaluate, load, setup, train_and_evaluate
from ssmkit._src.train.ppo.update import (
    PPOState,
    create_ppo_state,
    make_optimizer,
    ppo_loss,
    ppo_update,
    ppo_updates,
    sequences,
)

__all__ = [
    "ActorState",
    "Agent",
    "EnvConfig",
    "PPOConfig",
    "PPOHyperparameters",
    "PPOState",
    "PPOTrainConfig",
    "PolicyConfig",
    "Rollout",
    "Setup",
    "VecEnv",
    "advantages_and_targets",
    "collect_rollout",
    "create_ppo_state",
    "evaluate",
    "evaluate_policy",
    "init_actor",
    "load",
    "make_agent",
    "make_env",
    "make_optimizer",
    "ppo_loss",
    "ppo_update",
    "ppo_updates",
    "sequences",
    "setup",
    "train_and_evaluate",
]
