"""Training SSM models from YAML configs, in workdirs that survive interruption, and loading them.

    config = ssmkit.train.load_config("mnist1d_lru", ["train.epochs=5"])
    summary = ssmkit.train.train_and_evaluate(config, "runs/lru")   # resumes in runs/lru
    model, variables, config = ssmkit.train.load("runs/lru")
    logits = model.apply(variables, ssmkit.data.mnist1d().x_test)

Every config declares its task kind: `task: supervised` (the default; `Config`), `task: lm` or
`task: ppo`. The building blocks of each kind are in `ssmkit.train.supervised`, `ssmkit.train.lm`
and `ssmkit.train.ppo`; what
they share (the model section, the devices, the registry of task kinds) in `ssmkit.train.core`.
"""

from ssmkit._src.train.core.errors import ConfigError, Interrupted
from ssmkit._src.train.registry import evaluate, load, load_config, shipped_configs, train_and_evaluate
from ssmkit._src.train.supervised.config import Config
from ssmkit.train import core, lm, ppo, supervised

__all__ = [
    "Config",
    "ConfigError",
    "Interrupted",
    "core",
    "evaluate",
    "lm",
    "load",
    "load_config",
    "ppo",
    "shipped_configs",
    "supervised",
    "train_and_evaluate",
]
