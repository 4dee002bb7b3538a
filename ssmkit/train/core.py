"""What every task kind of `ssmkit.train` shares: the model section, the devices, the task kinds."""

from ssmkit._src.train.core.checkpoint import Checkpoints
from ssmkit._src.train.core.loop import Loop, Rhythm, Span, run_steps
from ssmkit._src.train.core.model import (
    ModelConfig,
    TrainState,
    build_model,
    layer_names,
    parameter_labels,
)
from ssmkit._src.train.core.parallel import MeshConfig, initialize_distributed
from ssmkit._src.train.core.workdir import Workdir
from ssmkit._src.train.reference import config_reference
from ssmkit._src.train.registry import TASKS, TaskKind, describe_config, task_kind, workdir_task

__all__ = [
    "TASKS",
    "Checkpoints",
    "Loop",
    "MeshConfig",
    "ModelConfig",
    "Rhythm",
    "Span",
    "TaskKind",
    "TrainState",
    "Workdir",
    "build_model",
    "config_reference",
    "describe_config",
    "initialize_distributed",
    "layer_names",
    "parameter_labels",
    "run_steps",
    "task_kind",
    "workdir_task",
]
