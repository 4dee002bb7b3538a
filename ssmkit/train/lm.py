"""Language models on text (`task: lm`): the config, the data it packs, and the entry points."""

from ssmkit._src.train.lm.config import LMConfig, LMDataConfig, LMSamplesConfig
from ssmkit._src.train.lm.train import (
    complete,
    dataset,
    evaluate,
    load,
    results,
    tokenizer,
    train_and_evaluate,
)

__all__ = [
    "LMConfig",
    "LMDataConfig",
    "LMSamplesConfig",
    "complete",
    "dataset",
    "evaluate",
    "load",
    "results",
    "tokenizer",
    "train_and_evaluate",
]
